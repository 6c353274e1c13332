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
            Format::Json => TopLevelGrammar::from_json_schema(compact(serde_json::json!({}))),
            Format::Schema(Value::Bool(true)) => {
                TopLevelGrammar::from_json_schema(compact(serde_json::json!({})))
            }
            Format::Schema(s) => TopLevelGrammar::from_json_schema(compact(s.clone())),
            Format::Lark(g) => TopLevelGrammar::from_lark(g.clone()),
        }
    }
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
        Ok(Vocabulary {
            factory,
            eos: eos.into(),
            size,
        })
    }

    pub fn size(&self) -> usize {
        self.size
    }

    /// Compiles `format` for one request; an invalid schema or grammar is named in the error.
    pub fn constrain(&self, format: &Format) -> Result<Constraint> {
        let parser = self
            .factory
            .create_parser(format.grammar())
            .map_err(|e| GrammarError::Invalid(format!("invalid Format: {e}")))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(GrammarError::Invalid(format!("invalid Format: {e}")));
        }
        Ok(Constraint {
            matcher,
            eos: Arc::clone(&self.eos),
            size: self.size,
        })
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
    fn failed(&self, e: impl std::fmt::Display) -> GrammarError {
        GrammarError::Matcher(self.matcher.get_error().unwrap_or_else(|| e.to_string()))
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
        let mut vocab: serde_json::Map<String, Value> = (0u32..256)
            .map(|b| (format!("<0x{b:02X}>"), json!(b)))
            .collect();
        vocab.insert("<eos>".into(), json!(256));
        let tokenizer = json!({
            "decoder": {"type": "Sequence", "decoders": [{"type": "ByteFallback"}]},
            "added_tokens": [{"id": 256, "content": "<eos>", "special": true}],
            "model": {"vocab": vocab},
        });
        let v = Vocabulary::new(&tokenizer, 260, &[256]).unwrap();
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
}
