//! Completion requests from outside: any body parses or gets a message for a 400, never a panic;
//! what parses is always within the ranges the sampler is given.

use proptest::prelude::*;
use runner::protocol::CompletionRequest;
use serde_json::{json, Value};

fn value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>()
            .prop_filter("JSON numbers are finite", |f| f.is_finite())
            .prop_map(Value::from),
        Just(json!(1e39)),
        Just(json!(-1)),
        Just(json!(2147483648u64)),
        ".{0,8}".prop_map(Value::from),
    ];
    leaf.prop_recursive(2, 8, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..3).prop_map(Value::from),
            prop::collection::btree_map("[a-zA-Z_]{1,12}", inner, 0..3)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

fn key() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("num_predict"),
        Just("temperature"),
        Just("top_k"),
        Just("top_p"),
        Just("min_p"),
        Just("repeat_last_n"),
        Just("repeat_penalty"),
        Just("presence_penalty"),
        Just("frequency_penalty"),
        Just("seed"),
        Just("stop"),
        Just("num_ctx"),
        Just("TEMPERATURE"),
        Just("mirostat"),
    ]
    .prop_map(String::from)
}

fn check(body: &[u8]) {
    if let Ok(r) = CompletionRequest::parse(body) {
        // Media items decode or are refused, never panic.
        let _ = r.media_items();
        if r.validate().is_ok() {
            let o = r.sampler_options().normalized(4096);
            assert!(o.top_k >= 0 && o.top_p > 0.0 && o.top_p <= 1.0);
            assert!((0.0..=1.0).contains(&o.min_p) && o.temperature >= 0.0);
            assert!((0..=4096).contains(&o.repeat_last_n));
            assert!(r.num_ctx(4096) >= 1 && r.num_ctx(4096) <= 4096);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1024, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes(bytes in prop::collection::vec(any::<u8>(), 0..64)) {
        check(&bytes);
    }

    #[test]
    fn arbitrary_json(v in value()) {
        check(v.to_string().as_bytes());
    }

    #[test]
    fn request_shaped_json(
        prompt in value(),
        options in prop::collection::btree_map(key(), value(), 0..6),
        logprobs in value(),
        top in value(),
        media in value(),
    ) {
        let body = json!({
            "Prompt": prompt,
            "Options": Value::Object(options.into_iter().collect()),
            "Logprobs": logprobs,
            "TopLogprobs": top,
            "Media": media,
        });
        check(body.to_string().as_bytes());
    }
}
