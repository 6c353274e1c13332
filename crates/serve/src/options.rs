//! Request options: ollama's defaults, under the model's PARAMETERs, under the request's own
//! (`api.Options.FromMap` twice over `api.DefaultOptions`), sent to the runner as Go's
//! `json.Marshal` with `omitempty` sends them: a zero value is absent. The runner applies no
//! defaults of its own, so this is the one place they are decided.

use base::options::{Kind, Options, KEYS as SAMPLING};
use serde_json::{Map, Value};

/// The `api.Options` keys that are not sampling options (those are [`base::options::KEYS`]),
/// with their types. Unknown keys are ignored, as ollama ignores them (with a warning).
const OTHER_KEYS: &[(&str, Kind)] = &[
    ("num_keep", Kind::Int),
    ("num_predict", Kind::Int),
    ("typical_p", Kind::Float),
    ("stop", Kind::Strings),
    ("num_ctx", Kind::Int),
    ("num_batch", Kind::Int),
    ("num_gpu", Kind::Int),
    ("main_gpu", Kind::Int),
    ("use_mmap", Kind::Bool),
    ("num_thread", Kind::Int),
    ("draft_num_predict", Kind::Int),
    ("penalize_newline", Kind::Bool),
    ("mirostat", Kind::Int),
    ("mirostat_tau", Kind::Float),
    ("mirostat_eta", Kind::Float),
    ("tfs_z", Kind::Float),
    ("low_vram", Kind::Bool),
    ("f16_kv", Kind::Bool),
    ("logits_all", Kind::Bool),
    ("vocab_only", Kind::Bool),
    ("use_mlock", Kind::Bool),
    ("numa", Kind::Bool),
    ("renderer", Kind::Text),
];

/// Every `api.Options` key's type.
fn kind(key: &str) -> Option<Kind> {
    SAMPLING
        .iter()
        .chain(OTHER_KEYS)
        .find(|(name, _)| *name == key)
        .map(|&(_, k)| k)
}

/// The context length when neither the request nor the model says (`OLLAMA_CONTEXT_LENGTH`'s
/// default).
pub const DEFAULT_NUM_CTX: i64 = 4096;

/// `api.DefaultOptions()`.
pub fn defaults(num_ctx: i64) -> Map<String, Value> {
    let mut m = Map::new();
    for ((name, kind), (_, v)) in SAMPLING.iter().zip(Options::ollama().values()) {
        let v = match kind {
            // As Go marshals a float32: its shortest decimal (0.9, not 0.8999999761581421).
            Kind::Float => (v as f32)
                .to_string()
                .parse::<f64>()
                .map_or(Value::Null, Value::from),
            _ => Value::from(v as i64),
        };
        m.insert(name.to_string(), v);
    }
    let mut set = |k: &str, v: Value| {
        m.insert(k.to_string(), v);
    };
    set("num_predict", (-1).into());
    set("num_keep", 4.into());
    set("typical_p", 1.0.into());
    set("num_ctx", num_ctx.into());
    set("num_batch", 512.into());
    set("num_gpu", (-1).into());
    set("draft_num_predict", 4.into());
    m
}

/// Lays `over` onto `base` with `FromMap`'s type rules: an integer option takes any number
/// (truncated), a float option a number, `stop` an array of strings; `null` leaves the value;
/// a wrong type is an error naming the option.
pub fn apply(base: &mut Map<String, Value>, over: &Map<String, Value>) -> Result<(), String> {
    for (k, v) in over {
        let Some(kind) = kind(k) else {
            tracing::warn!(option = %k, "invalid option provided");
            continue;
        };
        if v.is_null() {
            continue;
        }
        let value = match kind {
            Kind::Int => match v.as_f64() {
                Some(f) if v.is_i64() || v.is_u64() => Value::from(v.as_i64().unwrap_or(f as i64)),
                Some(f) => Value::from(f.trunc() as i64),
                None => return Err(format!("option {k:?} must be of type integer")),
            },
            Kind::Float => match v.as_f64() {
                Some(f) => Value::from(f),
                None => return Err(format!("option {k:?} must be of type float32")),
            },
            Kind::Bool => match v.as_bool() {
                Some(b) => Value::from(b),
                None => return Err(format!("option {k:?} must be of type boolean")),
            },
            Kind::Text => match v.as_str() {
                Some(s) => Value::from(s),
                None => return Err(format!("option {k:?} must be of type string")),
            },
            Kind::Strings => match v.as_array() {
                Some(items) if items.iter().all(Value::is_string) => v.clone(),
                Some(_) => return Err(format!("option {k:?} must be of an array of strings")),
                None => return Err(format!("option {k:?} must be of type array")),
            },
        };
        base.insert(k.clone(), value);
    }
    Ok(())
}

/// The options as the Go parent marshals them: zero values (0, false, "", []) left out.
pub fn omit_empty(m: Map<String, Value>) -> Map<String, Value> {
    m.into_iter()
        .filter(|(_, v)| match v {
            Value::Null => false,
            Value::Bool(b) => *b,
            Value::Number(n) => n.as_f64() != Some(0.0),
            Value::String(s) => !s.is_empty(),
            Value::Array(a) => !a.is_empty(),
            Value::Object(o) => !o.is_empty(),
        })
        .collect()
}

/// Adds `stops` to the `stop` list (once each).
pub fn add_stops(m: &mut Map<String, Value>, stops: &[&str]) {
    let list = m.entry("stop").or_insert_with(|| Value::Array(Vec::new()));
    if let Value::Array(items) = list {
        for s in stops {
            if !items.iter().any(|i| i.as_str() == Some(*s)) {
                items.push(Value::from(*s));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn obj(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn request_over_model_over_defaults() {
        let mut m = defaults(DEFAULT_NUM_CTX);
        apply(&mut m, &obj(json!({"temperature": 0.2, "stop": ["a"]}))).unwrap();
        apply(
            &mut m,
            &obj(json!({"temperature": 0, "top_k": 5.7, "bogus": 1})),
        )
        .unwrap();
        let sent = omit_empty(m);
        // Zero temperature is absent on the wire: the runner reads it as greedy.
        assert!(!sent.contains_key("temperature"));
        assert_eq!(sent["top_k"], json!(5));
        assert_eq!(sent["top_p"], json!(0.9));
        assert_eq!(sent["stop"], json!(["a"]));
        assert_eq!(sent["seed"], json!(-1));
        assert!(!sent.contains_key("bogus"));
    }

    #[test]
    fn wrong_types_are_named() {
        let mut m = defaults(DEFAULT_NUM_CTX);
        let e = apply(&mut m, &obj(json!({"top_k": "many"}))).unwrap_err();
        assert_eq!(e, "option \"top_k\" must be of type integer");
        let e = apply(&mut m, &obj(json!({"stop": [1]}))).unwrap_err();
        assert!(e.contains("array of strings"));
        let e = apply(&mut m, &obj(json!({"temperature": true}))).unwrap_err();
        assert!(e.contains("float32"));
    }
}
