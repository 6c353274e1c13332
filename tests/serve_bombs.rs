//! Property tests of what `serve` and the runner compile from a request: random Jinja programs
//! through serve's template renderer (the real worker processes), random JSON Schemas through
//! the grammar compiler. Every one is answered within a bound, with a value or a client error,
//! and never takes the process down or hangs.

use proptest::prelude::*;
use serde_json::{json, Value};
use serve::template::{Limits, OwnedContext, RenderError, Renderer, LIMITS};
use std::time::{Duration, Instant};

/// Pieces of templates, the costly constructs of the bombs among them.
fn jinja() -> impl Strategy<Value = String> {
    let n = prop::sample::select(vec![0u64, 1, 3, 1000, 100_000, 10_000_000]);
    // The errors are rarer than the rest: one anywhere decides the whole program.
    let leaf = prop_oneof![
        3 => Just("x".to_string()),
        3 => Just("{{ messages[0].content }}".to_string()),
        3 => Just("{% set ns.s = ns.s ~ ns.s %}".to_string()),
        3 => Just("{{ ns.s }}".to_string()),
        1 => Just("{{ nothing.here }}".to_string()),
        1 => Just("{{ raise_exception('refused') }}".to_string()),
        1 => Just("{% for %}".to_string()),
        3 => n.clone().prop_map(|n| format!("{{{{ 'ab' * {n} }}}}")),
        3 => n.clone().prop_map(|n| format!("{{{{ range({n}) | list | length }}}}")),
        3 => prop::sample::select(vec![3u64, 12, 30]).prop_map(|n| format!("{{{{ f({n}) }}}}")),
    ];
    leaf.prop_recursive(4, 24, 3, move |inner| {
        let n = prop::sample::select(vec![1u64, 2, 10, 1000, 100_000]);
        prop_oneof![
            (n.clone(), inner.clone()).prop_map(|(n, b)| format!("{{% for i in range({n}) %}}{b}{{% endfor %}}")),
            inner.clone().prop_map(|b| format!("{{% if messages %}}{b}{{% endif %}}")),
            prop::collection::vec(inner.clone(), 1..3).prop_map(|v| v.concat()),
            inner.prop_map(|b| format!("{{% set ns.s = ns.s ~ '{}' %}}{b}", "z".repeat(8))),
        ]
    })
    .prop_map(|body| {
        // A namespace to grow and a macro that fans out, for the leaves that use them.
        format!(
            "{{% set ns = namespace(s='ab') %}}{{% macro f(n) %}}{{% if n > 0 %}}{{{{ f(n - 1) }}}}{{{{ f(n - 1) }}}}{{% endif %}}{{% endmacro %}}{body}"
        )
    })
}

fn context() -> OwnedContext {
    OwnedContext {
        messages: vec![json!({"role": "user", "content": "hello"})],
        tools: None,
        add_generation_prompt: true,
        bos_token: "<bos>".into(),
        eos_token: "<eos>".into(),
        enable_thinking: None,
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn every_template_is_rendered_or_refused_within_its_bounds(source in jinja()) {
        let rt = tokio::runtime::Runtime::new().unwrap();
        // A shorter wall-clock bound than serve's, so that the cases it stops stay quick.
        let time = Duration::from_secs(2);
        let renderer = Renderer::new(env!("CARGO_BIN_EXE_mlx-runner").into()).with_time_limit(time);
        let limits = Limits { max_output: 1 << 20, ..LIMITS };
        let t = Instant::now();
        let out = rt.block_on(renderer.render(source.clone(), context(), limits));
        prop_assert!(t.elapsed() < time + Duration::from_secs(3), "{:?}: {source}", t.elapsed());
        match out {
            Ok(text) => prop_assert!(text.len() <= limits.max_output),
            Err(RenderError::Unavailable(m)) => prop_assert!(false, "the renderer failed: {m}: {source}"),
            Err(_) => {}
        }
    }
}

/// Properties in a schema, nested ones included.
fn properties(v: &Value) -> usize {
    match v {
        Value::Object(o) => {
            let own = o
                .get("properties")
                .and_then(Value::as_object)
                .map_or(0, |p| p.len());
            own + o.values().map(properties).sum::<usize>()
        }
        Value::Array(a) => a.iter().map(properties).sum(),
        _ => 0,
    }
}

/// The most properties an object's list multiplies to: past every bound, short of what makes
/// building the case costly.
const MOST_PROPERTIES: usize = 20_000;

/// Random schemas: objects, arrays, alternatives, references (cycles among them), enums, and
/// property lists of every size.
fn schema() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(json!({"type": "string"})),
        Just(json!({"type": "integer", "minimum": 0})),
        Just(json!({"type": "number"})),
        Just(json!({"type": "boolean"})),
        Just(json!({"enum": ["a", "b", 3]})),
        Just(json!({"$ref": "#/$defs/node"})),
        Just(json!({"$ref": "#/$defs/loop"})),
        Just(json!({"type": "string", "pattern": "^(a|b)*c{2,5}$"})),
        Just(json!(true)),
        Just(json!({"not": {}})),
    ];
    leaf.prop_recursive(5, 48, 4, |inner| {
        let n = prop::sample::select(vec![1usize, 3, 50, 600, 2500]);
        prop_oneof![
            (n, inner.clone(), any::<bool>()).prop_map(|(n, s, req)| {
                // Every size of list, but not a list of large lists: 2,500 copies of an object
                // of 2,500 properties would make the strategy itself gigabytes.
                let n = n.min((MOST_PROPERTIES / properties(&s).max(1)).max(1));
                let p: serde_json::Map<String, Value> =
                    (0..n).map(|i| (format!("k{i}"), s.clone())).collect();
                let keys: Vec<String> = if req {
                    p.keys().cloned().collect()
                } else {
                    Vec::new()
                };
                json!({"type": "object", "properties": p, "required": keys})
            }),
            inner
                .clone()
                .prop_map(|s| json!({"type": "array", "items": s, "maxItems": 3})),
            prop::collection::vec(inner.clone(), 1..4).prop_map(|v| json!({"anyOf": v})),
            prop::collection::vec(inner, 1..3).prop_map(|v| json!({"allOf": v})),
        ]
    })
    .prop_map(|root| {
        let mut s = json!({"$defs": {
            "node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}}},
            "loop": {"$ref": "#/$defs/loop2"}, "loop2": {"$ref": "#/$defs/loop"}}});
        if let (Value::Object(o), Value::Object(r)) = (&mut s, root.clone()) {
            o.extend(r);
            s
        } else {
            root
        }
    })
}

fn vocabulary() -> &'static grammar::Vocabulary {
    static V: std::sync::OnceLock<grammar::Vocabulary> = std::sync::OnceLock::new();
    V.get_or_init(|| {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/models/gemma4_e2b_like/tokenizer.json"
        );
        let json: Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
        let size = json["model"]["vocab"].as_object().map_or(0, |m| m.len())
            + json["added_tokens"].as_array().map_or(0, Vec::len);
        grammar::Vocabulary::new(&json, size.max(1024), &[1]).unwrap()
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn every_schema_compiles_or_is_refused_in_plain_words(s in schema()) {
        let t = Instant::now();
        match vocabulary().constrain(&grammar::Format::Schema(s.clone())) {
            Ok(mut c) => {
                // Enforceable: its first steps compute.
                prop_assert!(c.allowed().is_ok());
            }
            Err(grammar::GrammarError::Invalid(m)) => {
                prop_assert!(!m.contains("<state>") && !m.contains("<grammar>"), "{m}");
            }
            Err(e) => prop_assert!(false, "{e}: {s}"),
        }
        prop_assert!(t.elapsed() < Duration::from_secs(30), "{:?}", t.elapsed());
    }
}
