//! A forced call's grammar and its family's parser agree, string for string: texts drawn at
//! random from the grammar (each byte chosen among those llguidance allows, like a model that
//! samples anything the grammar permits) always parse back into one call whose arguments have
//! the declared types.

use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use serve::forced::{grammar as call_grammar, Forced, Marks};

/// One token per byte, and `<eos>` (256): the grammar decides every byte.
fn bytes_vocabulary() -> grammar::Vocabulary {
    let mut vocab: serde_json::Map<String, Value> = (0u32..256)
        .map(|b| (format!("<0x{b:02X}>"), json!(b)))
        .collect();
    vocab.insert("<eos>".into(), json!(256));
    let tokenizer = json!({
        "decoder": {"type": "Sequence", "decoders": [{"type": "ByteFallback"}]},
        "added_tokens": [{"id": 256, "content": "<eos>", "special": true}],
        "model": {"vocab": vocab},
    });
    grammar::Vocabulary::new(&tokenizer, 260, &[256]).unwrap()
}

fn tool() -> Value {
    json!({"type": "function", "function": {"name": "plan", "parameters": {"type": "object",
        "properties": {
            "count": {"type": "integer"},
            "ratio": {"type": "number"},
            "score": {"type": "integer", "minimum": 1, "maximum": 5},
            "title": {"type": "string", "maxLength": 12},
            "unit": {"enum": ["c", "f"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
            "sizes": {"type": "array", "items": {"type": "number"}, "maxItems": 3},
            "where": {"type": "object", "properties": {"lat": {"type": "number"},
                "n": {"type": "integer"}}, "required": ["lat"]},
            "note": {"type": "string", "maxLength": 8}
        },
        "required": ["count", "ratio", "score", "title", "unit", "tags", "sizes", "where"]}}})
}

/// A text the grammar admits, chosen byte by byte at random; ends once the grammar does.
fn walk(v: &grammar::Vocabulary, g: &str, rng: &mut impl Rng) -> String {
    let mut c = v.constrain(&grammar::Format::Lark(g.to_string())).unwrap();
    let mut out = Vec::new();
    for _ in 0..4000 {
        let allowed = c.allowed().unwrap();
        if allowed.contains(256) {
            break;
        }
        let choices: Vec<u32> = (0..256).filter(|&b| allowed.contains(b)).collect();
        let b = choices[rng.random_range(0..choices.len())];
        c.consume(b).unwrap();
        out.push(b as u8);
    }
    assert!(
        c.is_accepting(),
        "the walk did not end: {:?}",
        String::from_utf8_lossy(&out)
    );
    String::from_utf8_lossy(&out).into_owned()
}

fn check_types(args: &Value, text: &str) {
    let a = |k: &str| &args[k];
    assert!(a("count").is_i64(), "count: {args} from {text}");
    assert!(a("ratio").is_number(), "ratio: {args} from {text}");
    let score = a("score")
        .as_i64()
        .unwrap_or_else(|| panic!("score: {args} from {text}"));
    assert!((1..=5).contains(&score), "score {score} from {text}");
    assert!(a("title").is_string(), "title: {args} from {text}");
    assert!(
        ["c", "f"].contains(&a("unit").as_str().unwrap_or("")),
        "unit: {args}"
    );
    assert!(
        a("tags")
            .as_array()
            .is_some_and(|t| t.iter().all(Value::is_string)),
        "tags: {args} from {text}"
    );
    assert!(
        a("sizes")
            .as_array()
            .is_some_and(|t| t.iter().all(Value::is_number)),
        "sizes: {args} from {text}"
    );
    let w = a("where")
        .as_object()
        .unwrap_or_else(|| panic!("where: {args} from {text}"));
    assert!(w["lat"].is_number(), "where.lat: {args} from {text}");
    assert!(
        w.keys().all(|k| k == "lat" || k == "n"),
        "where's keys: {args}"
    );
    assert!(w.get("n").is_none_or(Value::is_i64), "where.n: {args}");
    assert!(
        args.get("note").is_none_or(Value::is_string),
        "note: {args}"
    );
    let keys = [
        "count", "ratio", "score", "title", "unit", "tags", "sizes", "where", "note",
    ];
    assert!(
        args.as_object()
            .unwrap()
            .keys()
            .all(|k| keys.contains(&k.as_str())),
        "{args}"
    );
}

fn family_round_trips(family: &str) {
    let v = bytes_vocabulary();
    let none = |_: &str| None;
    let tools = [tool()];
    let g = call_grammar(family, &tools, &Forced::Any, &Marks { special: &none }).unwrap();
    for seed in 0..200u64 {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let text = walk(&v, &g, &mut rng);
        let mut p = serve::parse::parser(family, &tools, false, "");
        let parsed = p.add(&text, true);
        assert_eq!(
            parsed.tool_calls.len(),
            1,
            "seed {seed}: no call from {text:?}"
        );
        let f = &parsed.tool_calls[0]["function"];
        assert_eq!(f["name"], "plan");
        check_types(&f["arguments"], &text);
    }
}

#[test]
fn gemma4_forced_calls_always_parse_into_their_types() {
    family_round_trips("gemma4");
}

#[test]
fn glm_forced_calls_always_parse_into_their_types() {
    family_round_trips("glm-4.7");
}
