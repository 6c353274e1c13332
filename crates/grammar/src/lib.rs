//! Structured output: a request's `Format` (any JSON, a JSON Schema, or a Lark grammar) compiled
//! by llguidance into a [`Constraint`] that says, step by step, which tokens may come next.
//!
//! A [`Vocabulary`] is built once per model from its `tokenizer.json` (every token's bytes,
//! special tokens marked so that no text can spell them) and shared by every request; each
//! request compiles its own [`Constraint`], so grammar state is per request and rewinds with
//! the request's tokens. EOS is allowed exactly when the grammar accepts, and then every one of
//! the model's EOS ids is.
//!
//! JSON is generated compact (no optional whitespace), unless the schema says otherwise in
//! llguidance's own `x-guidance` key: whitespace is the one thing a schema never bounds, and a
//! model that keeps choosing it would never finish.
//!
//! Schemas are read as ollama's `format` is (through llama.cpp's schema converter) and as
//! OpenAI's strict mode requires: `"json"` is an object, and an object schema that lists
//! `properties` without saying `additionalProperties` has exactly those keys.
//!
//! A format is a program the request brings, so compiling one is bounded ([`Bounds`]: its
//! size, nesting and property count, each refused with the bound's name) and runs on a thread
//! whose stack is sized for the nesting allowed: no format can take the process down.

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, TokRxInfo, TokTrie, TokenId};
use llguidance::{Matcher, ParserFactory};
use serde_json::Value;
use std::sync::Arc;

#[derive(Debug, thiserror::Error)]
pub enum GrammarError {
    /// The request's format is not one we can enforce (answer 400).
    #[error("{0}")]
    Invalid(String),
    /// The model's tokenizer cannot be used for constrained decoding.
    #[error("structured output is unavailable for this model: {0}")]
    Vocabulary(String),
    /// The grammar reached a state it cannot continue from.
    #[error("structured output failed: {0}")]
    Matcher(String),
}

pub type Result<T> = std::result::Result<T, GrammarError>;

/// What a request asks its output to be.
#[derive(Debug, Clone, PartialEq)]
pub enum Format {
    /// Any JSON value.
    Json,
    /// A value valid under this JSON Schema.
    Schema(Value),
    /// Text in this Lark grammar (llguidance's dialect).
    Lark(String),
}

impl Format {
    /// Reads the request's `Format`: as ollama's parent sends it (`"json"` or a schema object;
    /// absent, `null` or `""` for none), or a string holding a Lark grammar (ours).
    pub fn from_request(v: &Value) -> Result<Option<Format>> {
        match v {
            Value::Null => Ok(None),
            Value::String(s) if s.trim().is_empty() => Ok(None),
            Value::String(s) if s == "json" => Ok(Some(Format::Json)),
            Value::String(s) => Ok(Some(Format::Lark(s.clone()))),
            Value::Object(_) => Ok(Some(Format::Schema(v.clone()))),
            Value::Bool(true) => Ok(Some(Format::Schema(v.clone()))),
            other => Err(GrammarError::Invalid(format!(
                "Format must be \"json\", a JSON Schema object or a Lark grammar string, got {other}"
            ))),
        }
    }

    fn grammar(&self) -> TopLevelGrammar {
        let compact = |mut schema: Value| {
            if let Value::Object(o) = &mut schema {
                o.entry("x-guidance")
                    .or_insert_with(|| serde_json::json!({"whitespace_flexible": false}));
            }
            schema
        };
        match self {
            Format::Json => TopLevelGrammar::from_lark(JSON_OBJECT.to_string()),
            Format::Schema(Value::Bool(true)) => {
                TopLevelGrammar::from_json_schema(compact(serde_json::json!({})))
            }
            Format::Schema(s) => {
                let mut s = s.clone();
                closed_objects(&mut s);
                TopLevelGrammar::from_json_schema(compact(s))
            }
            Format::Lark(g) => TopLevelGrammar::from_lark(g.clone()),
        }
    }
}

/// `"json"`: an object, compact, its numbers within what every JSON reader holds (llama.cpp's
/// `json.gbnf`, which ollama's `"json"` is, bounds digits too): at most 16 digits before the
/// point and a two-digit exponent, so no `1e400` that a reader turns into an error or infinity.
const JSON_OBJECT: &str = r#"start: object
value: object | array | STRING | NUMBER | "true" | "false" | "null"
object: "{" (pair ("," pair)*)? "}"
pair: STRING ":" value
array: "[" (value ("," value)*)? "]"
STRING: /"(\\(["\\\/bfnrt]|u[0-9a-fA-F]{4})|[^"\\\x00-\x1F\x7F])*"/
NUMBER: /-?(0|[1-9][0-9]{0,15})(\.[0-9]{1,16})?([eE][-+]?[0-9]{1,2})?/
"#;

/// An object schema that lists `properties` and says nothing of others admits no others
/// (llama.cpp's converter, which ollama's `format` goes through, reads it so; pydantic's
/// schemas leave the key out). Walks only where JSON Schema puts subschemas, so a property
/// that happens to be named `properties` is not mistaken for a schema.
pub fn closed_objects(schema: &mut Value) {
    let Value::Object(o) = schema else { return };
    if o.get("properties").is_some_and(Value::is_object)
        && !o.contains_key("additionalProperties")
        && !o.contains_key("patternProperties")
        && !o.contains_key("unevaluatedProperties")
    {
        o.insert("additionalProperties".into(), Value::Bool(false));
    }
    for (key, sub) in o.iter_mut() {
        match key.as_str() {
            "properties" | "patternProperties" | "$defs" | "definitions" | "dependentSchemas" => {
                if let Value::Object(m) = sub {
                    m.values_mut().for_each(closed_objects);
                }
            }
            "items" | "prefixItems" | "anyOf" | "oneOf" | "allOf" => match sub {
                Value::Array(a) => a.iter_mut().for_each(closed_objects),
                other => closed_objects(other),
            },
            "additionalItems"
            | "contains"
            | "not"
            | "if"
            | "then"
            | "else"
            | "additionalProperties"
            | "unevaluatedProperties"
            | "unevaluatedItems"
            | "propertyNames" => closed_objects(sub),
            _ => {}
        }
    }
}

/// What a format may be, so that compiling it stays within a second or two and a bounded stack,
/// and enforcing it within llguidance's per-step limits. Compile time grows with the square of
/// an object's optional properties (2,000 take ~2 s in a debug build, 5,000 ~13 s), which is
/// why the property bound is below OpenAI's 5,000; nesting is far past what real schemas use.
#[derive(Debug, Clone, Copy)]
pub struct Bounds {
    /// Bytes of the schema (as JSON) or of the Lark grammar.
    pub max_bytes: usize,
    /// Nesting of objects and arrays in the schema's JSON.
    pub max_depth: usize,
    /// Properties, summed over every object in the schema.
    pub max_properties: usize,
}

pub const BOUNDS: Bounds = Bounds {
    max_bytes: 512 << 10,
    max_depth: 64,
    max_properties: 2_000,
};

impl Bounds {
    /// Refuses a format past a bound, naming it. The cost is bounded by the bounds, not by the
    /// format: a schema of millions of properties is refused after reading its first bytes'
    /// worth, never serialized or walked whole.
    pub fn check(&self, format: &Format) -> Result<()> {
        let too_large = |bytes: String| {
            GrammarError::Invalid(format!(
                "Format is too large: {bytes} bytes, over the limit of {} bytes",
                self.max_bytes
            ))
        };
        let s = match format {
            Format::Json => return Ok(()),
            Format::Lark(g) if g.len() > self.max_bytes => {
                return Err(too_large(g.len().to_string()))
            }
            Format::Lark(_) => return Ok(()),
            Format::Schema(s) => s,
        };
        let mut counted = Counted {
            bytes: 0,
            limit: self.max_bytes,
        };
        if serde_json::to_writer(&mut counted, s).is_err() {
            return Err(too_large(format!("over {}", self.max_bytes)));
        }
        let mut shape = Shape::default();
        // Within the byte bound, a walk is short; it still stops at the first bound crossed.
        let over = shape.measure(s, 1, self);
        if over && shape.depth > self.max_depth {
            return Err(GrammarError::Invalid(format!(
                "Format nests too deeply: over {} levels of JSON objects and arrays",
                self.max_depth
            )));
        }
        if over {
            return Err(GrammarError::Invalid(format!(
                "Format has too many properties: over the limit of {}",
                self.max_properties
            )));
        }
        Ok(())
    }
}

/// A writer that only counts, and fails once past `limit`.
struct Counted {
    bytes: usize,
    limit: usize,
}

impl std::io::Write for Counted {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.bytes += buf.len();
        if self.bytes > self.limit {
            return Err(std::io::ErrorKind::FileTooLarge.into());
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The deepest nesting and the properties seen so far in a schema's JSON.
#[derive(Default)]
struct Shape {
    depth: usize,
    properties: usize,
}

impl Shape {
    /// Walks `v` at nesting `level`; true as soon as a bound is crossed.
    fn measure(&mut self, v: &Value, level: usize, bounds: &Bounds) -> bool {
        self.depth = self.depth.max(level);
        if self.depth > bounds.max_depth {
            return true;
        }
        match v {
            Value::Object(o) => {
                if let Some(Value::Object(p)) = o.get("properties") {
                    self.properties += p.len();
                    if self.properties > bounds.max_properties {
                        return true;
                    }
                }
                o.values().any(|c| self.measure(c, level + 1, bounds))
            }
            Value::Array(a) => a.iter().any(|c| self.measure(c, level + 1, bounds)),
            _ => false,
        }
    }
}

/// Stack for compiling a format: llguidance's schema compiler recurses by the schema's
/// nesting and its property lists; a format within [`BOUNDS`] needs well under this. Only the
/// pages used are ever touched.
const COMPILE_STACK: usize = 256 << 20;

/// llguidance's messages, in the terms of the request.
fn plain(e: &str) -> String {
    let e = e.lines().next().unwrap_or_default().trim();
    let lower = e.to_ascii_lowercase();
    let why = if lower.contains("schema too large") || lower.contains("too many") {
        format!("too complex to enforce ({e}); simplify the schema")
    } else if lower.contains("unsatisfiable") {
        format!("admits no value ({e})")
    } else {
        e.to_string()
    };
    format!("invalid Format: {why}")
}

/// A model's tokens as llguidance sees them, and the factory that compiles formats over them.
pub struct Vocabulary {
    factory: ParserFactory,
    eos: Arc<[u32]>,
    size: usize,
}

impl Vocabulary {
    /// From the model's `tokenizer.json` (parsed), the width of its logits and its EOS ids.
    pub fn new(tokenizer_json: &Value, size: usize, eos: &[u32]) -> Result<Vocabulary> {
        let Some(&first_eos) = eos.first() else {
            return Err(GrammarError::Vocabulary(
                "the model has no EOS token".into(),
            ));
        };
        // llguidance's reader asserts on what it does not expect; a bad file must not take the
        // runner down.
        let words = std::panic::catch_unwind(|| {
            llguidance::token_bytes_from_tokenizer_json(tokenizer_json)
        })
        .map_err(|_| GrammarError::Vocabulary("tokenizer.json could not be read".into()))?
        .map_err(|e| GrammarError::Vocabulary(e.to_string()))?;
        if words.len() > size {
            return Err(GrammarError::Vocabulary(format!(
                "the tokenizer has {} tokens, the model's logits {size}",
                words.len()
            )));
        }
        let mut words = words;
        // Byte-fallback tokens (`<0x41>`) that the file lists as special added tokens are still
        // bytes of text, not markers.
        if let Some(added) = tokenizer_json["added_tokens"].as_array() {
            for t in added {
                let (Some(id), Some(content)) = (t["id"].as_u64(), t["content"].as_str()) else {
                    continue;
                };
                if let Some(byte) = byte_token(content) {
                    if let Some(w) = words.get_mut(id as usize) {
                        *w = vec![byte];
                    }
                }
            }
        }
        // Ids past the tokenizer's (padding rows of the embedding) have no text: never allowed.
        words.resize(size, Vec::new());
        let info = TokRxInfo::new(size as u32, first_eos);
        let trie = TokTrie::from(&info, &words);
        let env = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&(env as llguidance::toktrie::TokEnv))
            .map_err(|e| GrammarError::Vocabulary(e.to_string()))?;
        factory.set_stderr_log_level(0);
        // An object of n optional properties makes Earley rows of about 4n items: rows sized
        // for the properties [`BOUNDS`] allow, so a schema that compiles is also enforced to
        // its end. Errors are for the request, without llguidance's parser state.
        let limits = factory.limits_mut();
        limits.max_items_in_row = limits
            .max_items_in_row
            .max(4 * BOUNDS.max_properties + 2_000);
        limits.step_max_items = limits
            .step_max_items
            .max(8 * BOUNDS.max_properties + 10_000);
        limits.verbose_errors = false;
        Ok(Vocabulary {
            factory,
            eos: eos.into(),
            size,
        })
    }

    pub fn size(&self) -> usize {
        self.size
    }

    /// Compiles `format` for one request under [`BOUNDS`], on a thread of its own with a
    /// stack sized for them; an invalid or oversized schema or grammar is named in the error.
    pub fn constrain(&self, format: &Format) -> Result<Constraint> {
        BOUNDS.check(format)?;
        let compiled = std::thread::scope(|scope| {
            std::thread::Builder::new()
                .name("grammar".into())
                .stack_size(COMPILE_STACK)
                .spawn_scoped(scope, || self.compile(format))
                .map_err(|e| {
                    GrammarError::Invalid(format!("no thread to compile the Format on: {e}"))
                })?
                .join()
                // llguidance asserts on what it does not expect.
                .unwrap_or_else(|_| {
                    Err(GrammarError::Invalid(
                        "Format could not be compiled into a grammar".into(),
                    ))
                })
        })?;
        Ok(compiled)
    }

    fn compile(&self, format: &Format) -> Result<Constraint> {
        let parser = self
            .factory
            .create_parser(format.grammar())
            .map_err(|e| GrammarError::Invalid(plain(&e.to_string())))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(GrammarError::Invalid(plain(&e)));
        }
        let mut c = Constraint {
            matcher,
            eos: Arc::clone(&self.eos),
            size: self.size,
        };
        // A grammar with no first token (a `$ref` that only refers back to itself, parts that
        // contradict) is the request's error, found now rather than mid-stream.
        if c.allowed().is_err() {
            return Err(GrammarError::Invalid(
                "Format admits no value: no text can start it (a $ref that only refers back to itself, or parts that contradict each other)".into(),
            ));
        }
        Ok(c)
    }
}

/// The byte a byte-fallback token such as `<0x0A>` stands for.
fn byte_token(content: &str) -> Option<u8> {
    let hex = content.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

/// One request's grammar state.
#[derive(Clone)]
pub struct Constraint {
    matcher: Matcher,
    eos: Arc<[u32]>,
    size: usize,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("stopped", &self.matcher.is_stopped())
            .finish()
    }
}

/// The tokens allowed at one step, as a bit set over the vocabulary.
#[derive(Debug, Clone)]
pub struct Allowed {
    words: Vec<u32>,
    size: usize,
}

impl Allowed {
    pub fn contains(&self, t: u32) -> bool {
        let t = t as usize;
        t < self.size && self.words[t / 32] & (1 << (t % 32)) != 0
    }

    pub fn count(&self) -> usize {
        self.words.iter().map(|w| w.count_ones() as usize).sum()
    }

    /// An additive logit bias over `width` entries: 0 where allowed, −∞ elsewhere.
    pub fn bias(&self, width: usize) -> Vec<f32> {
        let mut out = vec![f32::NEG_INFINITY; width];
        for (i, &w) in self.words.iter().enumerate() {
            let mut w = w;
            while w != 0 {
                let b = w.trailing_zeros() as usize;
                let t = i * 32 + b;
                if t < width {
                    out[t] = 0.0;
                }
                w &= w - 1;
            }
        }
        out
    }
}

impl Constraint {
    /// The matcher's error, without the parser state llguidance appends to it.
    fn failed(&self, e: impl std::fmt::Display) -> GrammarError {
        let full = self.matcher.get_error().unwrap_or_else(|| e.to_string());
        let first = full.lines().next().unwrap_or_default().trim();
        GrammarError::Matcher(first.to_string())
    }

    /// The tokens that may come next: those the grammar allows and, when it accepts (or is
    /// complete), every EOS id. Never empty: a grammar with nowhere to go is an error.
    pub fn allowed(&mut self) -> Result<Allowed> {
        let vob = self
            .matcher
            .compute_mask_or_eos()
            .map_err(|e| self.failed(e))?;
        let mut words = vec![0u32; self.size.div_ceil(32)];
        let n = words.len().min(vob.as_slice().len());
        words[..n].copy_from_slice(&vob.as_slice()[..n]);
        if !self.size.is_multiple_of(32) {
            let last = words.len() - 1;
            words[last] &= (1u32 << (self.size % 32)) - 1;
        }
        let mut allowed = Allowed {
            words,
            size: self.size,
        };
        if self.eos.iter().any(|&e| allowed.contains(e)) {
            for &e in self.eos.iter() {
                if (e as usize) < self.size {
                    allowed.words[e as usize / 32] |= 1 << (e % 32);
                }
            }
        }
        if allowed.count() == 0 {
            return Err(GrammarError::Matcher(
                "the grammar allows no token here".into(),
            ));
        }
        Ok(allowed)
    }

    /// Takes in a generated token (any EOS id as the grammar's end).
    pub fn consume(&mut self, t: u32) -> Result<()> {
        let t = if self.eos.contains(&t) {
            self.eos[0]
        } else {
            t
        };
        self.matcher
            .consume_token(t as TokenId)
            .map_err(|e| self.failed(e))
    }

    /// Forgets the last `n` tokens taken in.
    pub fn rollback(&mut self, n: usize) -> Result<()> {
        self.matcher.rollback(n).map_err(|e| self.failed(e))
    }

    /// Whether the text so far is complete under the grammar.
    pub fn is_accepting(&mut self) -> bool {
        self.matcher.is_accepting().unwrap_or(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn formats_as_the_parent_sends_them() {
        assert_eq!(Format::from_request(&Value::Null).unwrap(), None);
        assert_eq!(Format::from_request(&json!("")).unwrap(), None);
        assert_eq!(
            Format::from_request(&json!("json")).unwrap(),
            Some(Format::Json)
        );
        let s = json!({"type": "object"});
        assert_eq!(
            Format::from_request(&s).unwrap(),
            Some(Format::Schema(s.clone()))
        );
        assert_eq!(
            Format::from_request(&json!("start: \"a\"")).unwrap(),
            Some(Format::Lark("start: \"a\"".into()))
        );
        assert!(Format::from_request(&json!(3)).is_err());
        assert!(Format::from_request(&json!([1])).is_err());
    }

    #[test]
    fn a_mask_is_a_bias() {
        let mut a = Allowed {
            words: vec![0; 2],
            size: 40,
        };
        for t in [0u32, 31, 32, 39] {
            a.words[t as usize / 32] |= 1 << (t % 32);
        }
        assert_eq!(a.count(), 4);
        assert!(a.contains(31) && !a.contains(30) && !a.contains(40));
        let b = a.bias(40);
        assert_eq!(b.iter().filter(|v| **v == 0.0).count(), 4);
        assert_eq!(b[32], 0.0);
        assert_eq!(b[33], f32::NEG_INFINITY);
    }

    #[test]
    fn byte_fallback_tokens_are_bytes() {
        assert_eq!(byte_token("<0x0A>"), Some(10));
        assert_eq!(byte_token("<0xff>"), Some(255));
        assert_eq!(byte_token("<0x1>"), None);
        assert_eq!(byte_token("<pad>"), None);
    }

    /// A vocabulary that byte-level text can spell: the schema's output is forced through it,
    /// EOS comes exactly when the value is complete, and rollback undoes tokens.
    #[test]
    fn a_walk_through_a_schema() {
        let v = bytes_vocabulary();
        let mut c = v
            .constrain(&Format::Schema(json!({"enum": ["ab", "ac"]})))
            .unwrap();
        let a = c.allowed().unwrap();
        assert!(a.contains(b'"' as u32) && !a.contains(256) && a.count() == 1);
        for b in b"\"a" {
            c.consume(*b as u32).unwrap();
        }
        let a = c.allowed().unwrap();
        assert!(a.contains(b'b' as u32) && a.contains(b'c' as u32) && a.count() == 2);
        c.consume(b'c' as u32).unwrap();
        c.rollback(1).unwrap();
        c.consume(b'b' as u32).unwrap();
        c.consume(b'"' as u32).unwrap();
        assert!(c.is_accepting());
        let a = c.allowed().unwrap();
        assert!(a.contains(256) && a.count() == 1);
        assert!(matches!(
            v.constrain(&Format::Lark("start: (".into())),
            Err(GrammarError::Invalid(_))
        ));
    }

    /// One token per byte, and `<eos>` (256).
    fn bytes_vocabulary() -> Vocabulary {
        let mut vocab: serde_json::Map<String, Value> = (0u32..256)
            .map(|b| (format!("<0x{b:02X}>"), json!(b)))
            .collect();
        vocab.insert("<eos>".into(), json!(256));
        let tokenizer = json!({
            "decoder": {"type": "Sequence", "decoders": [{"type": "ByteFallback"}]},
            "added_tokens": [{"id": 256, "content": "<eos>", "special": true}],
            "model": {"vocab": vocab},
        });
        Vocabulary::new(&tokenizer, 260, &[256]).unwrap()
    }

    /// Whether `text` is a complete answer under `format`.
    fn accepts(v: &Vocabulary, format: &Format, text: &str) -> bool {
        let mut c = v.constrain(format).unwrap();
        for b in text.bytes() {
            if !c.allowed().unwrap().contains(b as u32) || c.consume(b as u32).is_err() {
                return false;
            }
        }
        c.is_accepting()
    }

    #[test]
    fn json_mode_is_an_object() {
        let v = bytes_vocabulary();
        assert!(accepts(&v, &Format::Json, r#"{"a":[1,2.5,"x"]}"#));
        assert!(accepts(&v, &Format::Json, "{}"));
        assert!(accepts(
            &v,
            &Format::Json,
            r#"{"a\"b\u00e9":{"n":-0.5e-12,"t":true,"z":null,"e":[]}}"#
        ));
        // Numbers every reader holds.
        assert!(!accepts(&v, &Format::Json, r#"{"x":1e400}"#));
        assert!(!accepts(&v, &Format::Json, r#"{"x":01}"#));
        assert!(!accepts(&v, &Format::Json, r#"{"x":12345678901234567}"#));
        assert!(!accepts(&v, &Format::Json, "{ }"));
        for other in ["1.5", "true", "\"text\"", "[1]", "null"] {
            assert!(!accepts(&v, &Format::Json, other), "{other}");
        }
    }

    #[test]
    fn listed_properties_are_the_only_ones_unless_the_schema_says_otherwise() {
        let v = bytes_vocabulary();
        let person = json!({"type": "object", "properties": {"name": {"type": "string"},
            "pet": {"type": "object", "properties": {"kind": {"type": "string"}}}},
            "required": ["name"]});
        let f = Format::Schema(person.clone());
        assert!(accepts(&v, &f, r#"{"name":"a","pet":{"kind":"cat"}}"#));
        assert!(!accepts(&v, &f, r#"{"name":"a","age":3}"#));
        assert!(!accepts(
            &v,
            &f,
            r#"{"name":"a","pet":{"kind":"cat","x":1}}"#
        ));
        let mut open = person;
        open["additionalProperties"] = json!(true);
        assert!(accepts(
            &v,
            &Format::Schema(open),
            r#"{"name":"a","age":3}"#
        ));
        // A property named `properties` is a property, not a schema keyword.
        let f = Format::Schema(json!({"type": "object",
            "properties": {"properties": {"type": "integer"}}, "required": ["properties"]}));
        assert!(accepts(&v, &f, r#"{"properties":1}"#));
        // In definitions and alternatives too.
        let f = Format::Schema(json!({"$defs": {"p": {"type": "object",
            "properties": {"a": {"type": "integer"}}}},
            "anyOf": [{"$ref": "#/$defs/p"}, {"type": "array", "items": {"$ref": "#/$defs/p"}}]}));
        assert!(accepts(&v, &f, r#"[{"a":1}]"#));
        assert!(!accepts(&v, &f, r#"[{"a":1,"b":2}]"#));
    }

    #[test]
    fn formats_past_a_bound_are_refused_naming_it() {
        let v = bytes_vocabulary();
        let props = |n: usize| {
            let p: serde_json::Map<String, Value> = (0..n)
                .map(|i| (format!("p{i}"), json!({"type": "integer"})))
                .collect();
            Format::Schema(json!({"type": "object", "properties": p}))
        };
        let err = |f: &Format| match v.constrain(f) {
            Err(GrammarError::Invalid(m)) => m,
            other => panic!("{other:?}"),
        };
        assert!(err(&props(BOUNDS.max_properties + 1)).contains("too many properties"));
        let deep = (0..BOUNDS.max_depth).fold(
            json!({"type": "integer"}),
            |inner, _| json!({"type": "array", "items": inner}),
        );
        assert!(err(&Format::Schema(deep)).contains("nests too deeply"));
        let big = Format::Lark(format!("start: \"{}\"", "a".repeat(BOUNDS.max_bytes)));
        assert!(err(&big).contains("too large"));
        // Objects of objects: 400,000 properties, megabytes as JSON. Refused on the byte bound
        // after writing just past it; the rest is never serialized.
        let inner: serde_json::Map<String, Value> = (0..2_000)
            .map(|i| (format!("p{i}"), json!({"type": "boolean"})))
            .collect();
        let outer: serde_json::Map<String, Value> = (0..200)
            .map(|i| {
                (
                    format!("o{i}"),
                    json!({"type": "object", "properties": inner}),
                )
            })
            .collect();
        let huge = Format::Schema(json!({"type": "object", "properties": outer}));
        assert!(
            err(&huge).contains("too large: over 524288 bytes"),
            "{}",
            err(&huge)
        );
        let mut w = Counted { bytes: 0, limit: 4 };
        assert!(std::io::Write::write_all(&mut w, b"abcd").is_ok());
        assert!(std::io::Write::write_all(&mut w, b"e").is_err());
        let cycle = Format::Schema(json!({"$defs": {"a": {"$ref": "#/$defs/b"},
            "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}));
        assert!(err(&cycle).contains("admits no value"));
        // Up to the bounds, a format compiles: on a thread with room for it.
        let deepest = (0..BOUNDS.max_depth - 2).fold(
            json!({"type": "integer"}),
            |inner, _| json!({"type": "array", "items": inner}),
        );
        assert!(v.constrain(&Format::Schema(deepest)).is_ok());
    }
}
