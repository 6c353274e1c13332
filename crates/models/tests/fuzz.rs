//! Text and configurations from outside: the tokenizer takes any text and any ids, and a
//! model whose config.json has any field changed or removed loads or is refused with a clear
//! error, never a panic or an abort.

use models::{load, DtypeChoice, StreamDecoder, Tokenizer};
use proptest::prelude::*;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::sync::OnceLock;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/models")
        .join(name)
}

fn tokenizers() -> &'static [Tokenizer] {
    static T: OnceLock<Vec<Tokenizer>> = OnceLock::new();
    T.get_or_init(|| {
        ["gemma4_e2b_like", "glm4_moe_lite"]
            .iter()
            .map(|m| Tokenizer::load(&fixture(m)).unwrap())
            .collect()
    })
}

fn odd_value() -> impl Strategy<Value = Option<Value>> {
    prop_oneof![
        Just(None),
        Just(Some(json!(0))),
        Just(Some(json!(-1))),
        Just(Some(json!(1))),
        Just(Some(json!(3))),
        Just(Some(json!(2147483648u64))),
        Just(Some(json!(1e30))),
        Just(Some(json!(0.5))),
        Just(Some(json!("x"))),
        Just(Some(json!(null))),
        Just(Some(json!([]))),
        Just(Some(json!([1, 2]))),
        Just(Some(json!({}))),
        Just(Some(json!(true))),
    ]
}

/// Every key path of a JSON object (objects only).
fn paths(v: &Value, prefix: Vec<String>, out: &mut Vec<Vec<String>>) {
    if let Value::Object(m) = v {
        for (k, child) in m {
            let mut p = prefix.clone();
            p.push(k.clone());
            out.push(p.clone());
            paths(child, p, out);
        }
    }
}

fn mutate(config: &mut Value, path: &[String], to: Option<Value>) {
    let (last, parents) = path.split_last().unwrap();
    let mut node = config;
    for p in parents {
        node = &mut node[p];
    }
    if let Value::Object(m) = node {
        match to {
            Some(v) => {
                m.insert(last.clone(), v);
            }
            None => {
                m.remove(last);
            }
        }
    }
}

fn load_mutated(model: &str, pick: usize, to: Option<Value>) {
    let dir = tempfile::tempdir().unwrap();
    for f in std::fs::read_dir(fixture(model)).unwrap() {
        let p = f.unwrap().path();
        let dest = dir.path().join(p.file_name().unwrap());
        // The weights are large next to the rest: link rather than copy.
        if p.extension().is_some_and(|e| e == "safetensors") {
            std::os::unix::fs::symlink(&p, &dest).unwrap();
        } else {
            std::fs::copy(&p, &dest).unwrap();
        }
    }
    let cfg_path = dir.path().join("config.json");
    let mut cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    let mut all = Vec::new();
    paths(&cfg, Vec::new(), &mut all);
    let path = all[pick % all.len()].clone();
    mutate(&mut cfg, &path, to);
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    match load(dir.path(), DtypeChoice::Auto) {
        Ok(m) => {
            // What loads must run.
            let ids = mlx::Array::from_slice(&[1i32, 2, 3], &[1, 3]).unwrap();
            let mut caches = m.model.make_caches();
            if let Ok(h) = m.model.forward(&ids, &mut caches) {
                if let Ok(l) = m.model.logits(&h) {
                    let _ = l.eval();
                }
            }
        }
        Err(e) => assert!(!e.to_string().is_empty(), "{path:?}"),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn tokenizer_takes_any_text(text in "(?s).{0,64}", bytes in prop::collection::vec(any::<u8>(), 0..32)) {
        let lossy = String::from_utf8_lossy(&bytes).into_owned();
        for t in tokenizers() {
            for s in [&text, &lossy] {
                let ids = t.encode(s).unwrap();
                let _ = t.decode(&ids).unwrap();
            }
        }
    }

    #[test]
    fn tokenizer_takes_any_ids(ids in prop::collection::vec(0u32..2048, 0..24)) {
        for t in tokenizers() {
            let _ = t.decode(&ids);
            let mut d = StreamDecoder::new();
            let mut text = String::new();
            for &id in &ids {
                if let Ok(piece) = d.push(t, id) {
                    text.push_str(&piece);
                }
                let _ = t.token_text(id);
            }
            if let Ok(tail) = d.flush(t) {
                text.push_str(&tail);
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn gemma4_config_fields(pick in any::<usize>(), to in odd_value()) {
        load_mutated("gemma4_e2b_like", pick, to);
    }

    #[test]
    fn glm_config_fields(pick in any::<usize>(), to in odd_value()) {
        load_mutated("glm4_moe_lite", pick, to);
    }
}
