//! Structured output through the real binary: a request's `Format` (a JSON Schema, `"json"`, a
//! Lark grammar) is enforced token by token. The fixture models are random, so unconstrained
//! they emit byte soup: every completion below is valid only because the grammar made it so.
//! Each one is checked with an independent JSON Schema validator.

mod common;
use common::*;
use serde_json::{json, Value};
use std::sync::Arc;

/// Schemas covering nested objects, arrays, enums, bounded numbers, required and optional
/// properties, patterns and `anyOf`; bounded so that a random model always finishes.
fn schemas() -> Vec<Value> {
    vec![
        json!({
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 8},
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
                "nick": {"type": "string", "pattern": "^[a-z]{1,6}$"}
            },
            "required": ["name", "age"],
            "additionalProperties": false
        }),
        json!({
            "type": "object",
            "properties": {
                "point": {
                    "type": "object",
                    "properties": {
                        "x": {"type": "integer", "minimum": -50, "maximum": 50},
                        "y": {"type": "integer", "minimum": -50, "maximum": 50}
                    },
                    "required": ["x", "y"],
                    "additionalProperties": false
                },
                "colour": {"enum": ["red", "green", "blue"]},
                "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}, "maxItems": 3}
            },
            "required": ["point", "colour", "tags"],
            "additionalProperties": false
        }),
        json!({
            "anyOf": [
                {"type": "integer", "minimum": 1000, "maximum": 9999},
                {"type": "boolean"},
                {"type": "object", "properties": {"ok": {"const": true}}, "required": ["ok"], "additionalProperties": false}
            ]
        }),
        json!({
            "type": "array",
            "items": {"type": "string", "pattern": "^[0-9]{2}-[A-Z]$"},
            "minItems": 1,
            "maxItems": 4
        }),
    ]
}

fn text_and_end(lines: &[Value]) -> (String, i64) {
    let last = lines.last().unwrap();
    (text_of(lines), last["DoneReason"].as_i64().unwrap_or(-1))
}

fn constrained(
    r: &Runner,
    prompt: &str,
    format: &Value,
    temperature: f64,
    seed: i64,
) -> (String, i64) {
    text_and_end(&r.complete(&json!({
        "Prompt": prompt,
        "Format": format,
        "Options": {"num_predict": 400, "temperature": temperature, "seed": seed, "top_k": 0},
    })))
}

#[test]
fn every_completion_keeps_to_its_schema() {
    for model in ["gemma4_e2b_like", "glm4_moe_lite"] {
        let runner = Arc::new(Runner::start(
            model,
            &["--parallel", "4", "--draft-depth", "0"],
        ));
        for (n, schema) in schemas().into_iter().enumerate() {
            let validator = jsonschema::validator_for(&schema).unwrap();
            // Greedy for a few prompts, then 50 seeds of sampling, four requests at a time
            // (so masked and unmasked rows share batches).
            let mut cases: Vec<(String, f64, i64)> = ["Hi", "The quick brown fox", "zz"]
                .iter()
                .map(|p| (p.to_string(), 0.0, 0))
                .collect();
            cases.extend((0..50).map(|s| ("Hello".to_string(), 1.0, 100 + s)));
            let schema = Arc::new(schema);
            for chunk in cases.chunks(4) {
                let handles: Vec<_> = chunk
                    .iter()
                    .cloned()
                    .map(|(p, t, s)| {
                        let (r, schema) = (Arc::clone(&runner), Arc::clone(&schema));
                        std::thread::spawn(move || (constrained(&r, &p, &schema, t, s), p, s))
                    })
                    .collect();
                for h in handles {
                    let ((text, end), p, s) = h.join().unwrap();
                    assert_eq!(
                        end, 0,
                        "{model} schema {n} {p:?} seed {s}: did not stop: {text:?}"
                    );
                    let v: Value = serde_json::from_str(&text)
                        .unwrap_or_else(|e| panic!("{model} schema {n} seed {s}: {e}: {text:?}"));
                    assert!(
                        validator.is_valid(&v),
                        "{model} schema {n} seed {s}: {text} is not valid"
                    );
                }
            }
        }
    }
}

/// The same seed gives the same constrained output alone and batched, and greedy constrained
/// output does not depend on what shares the batch.
#[test]
fn constrained_rows_batch_and_stay_exact() {
    let schema = &schemas()[1];
    let solo = Runner::start("gemma4_e2b_like", &["--parallel", "1"]);
    let alone: Vec<(String, i64)> = (0..4)
        .map(|i| {
            constrained(
                &solo,
                &format!("prompt {i}"),
                schema,
                if i % 2 == 0 { 0.0 } else { 0.9 },
                i,
            )
        })
        .collect();
    drop(solo);
    let batched = Arc::new(Runner::start("gemma4_e2b_like", &["--parallel", "8"]));
    let handles: Vec<_> = (0..8)
        .map(|i| {
            let r = Arc::clone(&batched);
            let schema = schema.clone();
            std::thread::spawn(move || {
                if i < 4 {
                    Some(constrained(
                        &r,
                        &format!("prompt {i}"),
                        &schema,
                        if i % 2 == 0 { 0.0 } else { 0.9 },
                        i as i64,
                    ))
                } else {
                    // Unconstrained neighbours.
                    r.complete(&json!({"Prompt": "free text", "Options": {"num_predict": 30}}));
                    None
                }
            })
        })
        .collect();
    for (i, h) in handles.into_iter().enumerate() {
        if let Some(got) = h.join().unwrap() {
            assert_eq!(got, alone[i], "request {i}");
        }
    }
}

/// Drafting under a grammar: each drafter kind's drafts are masked too and the verification
/// applies the grammar at every position of the block, so greedy constrained output is exactly
/// what plain constrained decoding gives, with rounds of fixed depth (and with the target
/// drafting for itself, where every masked draft is accepted).
#[test]
fn drafting_under_a_grammar_gives_the_plain_output() {
    let assistant = fixture("gemma4_assistant");
    let itself = fixture("gemma4_31b_like");
    for (model, draft) in [
        ("gemma4_e2b_like", Some(assistant.to_str().unwrap())),
        ("glm4_moe_lite", None),
        ("gemma4_31b_like", Some(itself.to_str().unwrap())),
    ] {
        let mut extra = vec!["--parallel", "4"];
        if let Some(d) = draft {
            extra.extend(["--draft", d]);
        }
        let plain = Runner::start(model, &[&extra[..], &["--draft-depth", "0"]].concat());
        let cases: Vec<(usize, &str)> = (0..4)
            .map(|n| (n, ["Hi", "Hello there", "zz", "a b c"][n]))
            .collect();
        let want: Vec<(String, i64)> = cases
            .iter()
            .map(|&(n, p)| constrained(&plain, p, &schemas()[n], 0.0, 0))
            .collect();
        drop(plain);
        let drafting = Arc::new(Runner::start(
            model,
            &[&extra[..], &["--draft-depth", "3"]].concat(),
        ));
        // Alone, then all four at once (batched rounds).
        for (i, &(n, p)) in cases.iter().enumerate() {
            assert_eq!(
                constrained(&drafting, p, &schemas()[n], 0.0, 0),
                want[i],
                "{model} schema {n}"
            );
        }
        let handles: Vec<_> = cases
            .iter()
            .map(|&(n, p)| {
                let r = Arc::clone(&drafting);
                std::thread::spawn(move || constrained(&r, p, &schemas()[n], 0.0, 0))
            })
            .collect();
        for (i, h) in handles.into_iter().enumerate() {
            assert_eq!(h.join().unwrap(), want[i], "{model} schema {i}, batched");
        }
        let metrics = ureq::get(&drafting.url("/metrics"))
            .call()
            .unwrap()
            .into_string()
            .unwrap();
        let drafted = metrics
            .lines()
            .find_map(|l| l.strip_prefix("mlx_runner_draft_tokens_total "))
            .map_or(0, |v| v.trim().parse::<u64>().unwrap());
        assert!(drafted > 0, "{model}: nothing was drafted");
        if model == "gemma4_31b_like" {
            let accepted = metrics
                .lines()
                .find_map(|l| l.strip_prefix("mlx_runner_draft_accepted_total "))
                .map_or(0, |v| v.trim().parse::<u64>().unwrap());
            assert_eq!(
                accepted, drafted,
                "{model}: a masked self-draft was rejected"
            );
        }
    }
}

#[test]
fn json_lark_and_limits() {
    let r = Runner::start("gemma4_e2b_like", &[]);
    // "json": any JSON value.
    let mut finished = 0;
    for seed in 0..10 {
        let (text, end) = constrained(&r, "Hi", &json!("json"), 1.0, seed);
        if end == 0 {
            // Syntax only: JSON numbers have no range (serde_json's f64 would refuse 1e400).
            serde_json::from_str::<serde::de::IgnoredAny>(&text)
                .unwrap_or_else(|e| panic!("{e}: {text:?}"));
            finished += 1;
        }
    }
    assert!(
        finished > 0,
        "no JSON completion finished within 400 tokens"
    );
    // A Lark grammar.
    let lark = json!("start: (\"yes\" | \"no\") \" \" /[0-9]{2}/");
    for seed in 0..10 {
        let (text, end) = constrained(&r, "Hi", &lark, 1.0, seed);
        assert_eq!(end, 0);
        let (word, num) = text.split_once(' ').unwrap();
        assert!(word == "yes" || word == "no", "{text:?}");
        assert!(
            num.len() == 2 && num.chars().all(|c| c.is_ascii_digit()),
            "{text:?}"
        );
    }
    // num_predict first: the reason is length, the text a prefix of what the grammar allows.
    let lines = r.complete(&json!({
        "Prompt": "Hi",
        "Format": schemas()[1],
        "Options": {"num_predict": 5},
    }));
    let (text, end) = text_and_end(&lines);
    assert_eq!(end, 1, "{text:?}");
    assert!(
        !text.is_empty() && "{\"point\":{\"x\":".starts_with(&text),
        "{text:?}"
    );
}

#[test]
fn invalid_formats_are_refused_before_generating() {
    let r = Runner::start("gemma4_e2b_like", &[]);
    for (format, needle) in [
        (json!({"type": "objec"}), "invalid Format"),
        (
            json!({"type": "integer", "minimum": 5, "maximum": 1}),
            "invalid Format",
        ),
        (json!("start: foo"), "invalid Format"),
        (json!("start: \"a\" ("), "invalid Format"),
        (json!(3), "Format must be"),
        (json!(["json"]), "Format must be"),
    ] {
        let resp = ureq::post(&r.url("/v1/completions"))
            .send_string(&json!({"Prompt": "Hi", "Format": format}).to_string());
        match resp {
            Err(ureq::Error::Status(400, resp)) => {
                let body = resp.into_string().unwrap();
                assert!(body.contains(needle), "{format}: {body}");
            }
            other => panic!("{format}: expected a 400, got {other:?}"),
        }
    }
    // The runner still serves.
    let (text, _) = constrained(&r, "Hi", &schemas()[0], 0.0, 0);
    serde_json::from_str::<Value>(&text).unwrap();
}

/// A grammar that allows every token (llguidance's `<[*]>`) changes nothing: the same text and
/// logprobs as the unconstrained request, greedy and seeded sampling, special tokens included.
#[test]
fn a_grammar_that_allows_everything_changes_nothing() {
    let r = Runner::start("gemma4_e2b_like", &[]);
    for (i, prompt) in ["Hi", "The quick brown fox", "a", "zz"].iter().enumerate() {
        for temperature in [0.0, 0.8] {
            let body = |format: Option<&str>| {
                let mut b = json!({
                    "Prompt": prompt,
                    "Options": {"num_predict": 40, "temperature": temperature, "seed": i, "top_k": 20},
                    "Logprobs": true,
                });
                if let Some(f) = format {
                    b["Format"] = json!(f);
                }
                r.complete(&b)
            };
            let logprobs = |lines: &[Value]| -> Vec<f64> {
                lines
                    .iter()
                    .filter_map(|l| l["Logprobs"].as_array())
                    .flatten()
                    .map(|e| e["logprob"].as_f64().unwrap())
                    .collect()
            };
            let (free, all) = (body(None), body(Some("start: <[*]>*")));
            assert_eq!(
                text_and_end(&all),
                text_and_end(&free),
                "{prompt:?} t={temperature}"
            );
            let (a, b) = (logprobs(&all), logprobs(&free));
            assert!(!a.is_empty() && a.len() == b.len());
            for (x, y) in a.iter().zip(&b) {
                assert!((x - y).abs() < 1e-4, "{prompt:?}: {x} vs {y}");
            }
        }
    }
}

/// A model whose tokenizer llguidance cannot read (a decoder that is neither byte-level nor
/// byte-fallback) still serves free text; a request with a `Format` gets a 400 saying why.
#[test]
fn a_tokenizer_without_bytes_refuses_formats_only() {
    let dir = fixture_without_weights("gemma4_e2b_like");
    std::fs::copy(
        fixture("gemma4_e2b_like").join("model.safetensors"),
        dir.path().join("model.safetensors"),
    )
    .unwrap();
    let path = dir.path().join("tokenizer.json");
    let mut tok: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    tok["decoder"] = json!({"type": "Strip", "content": " ", "start": 0, "stop": 0});
    std::fs::write(&path, tok.to_string()).unwrap();
    let r = Runner::start_with(dir.path().as_os_str(), &[], &[]);
    for _ in 0..2 {
        match ureq::post(&r.url("/v1/completions"))
            .send_string(&json!({"Prompt": "Hi", "Format": "json"}).to_string())
        {
            Err(ureq::Error::Status(400, resp)) => {
                let body = resp.into_string().unwrap();
                assert!(body.contains("structured output is unavailable"), "{body}");
            }
            other => panic!("expected a 400, got {other:?}"),
        }
    }
    let lines = r.complete(&json!({"Prompt": "Hi", "Options": {"num_predict": 4}}));
    assert_eq!(lines.last().unwrap()["EvalCount"], 4);
}
