//! Safetensors files from outside: whatever their bytes, loading answers Ok or a clear error,
//! never a panic or an abort from MLX's reader behind our validation.

use proptest::prelude::*;
use serde_json::{json, Map, Value};

fn dtype() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("F32"),
        Just("F16"),
        Just("BF16"),
        Just("I32"),
        Just("I64"),
        Just("U8"),
        Just("U32"),
        Just("BOOL"),
        Just("F64"),
        Just("F8_E4M3"),
        Just("X9"),
        Just(""),
    ]
    .prop_map(String::from)
}

fn dim() -> impl Strategy<Value = i64> {
    prop_oneof![8 => 0i64..6, 1 => Just(-1i64), 1 => Just(1i64 << 40)]
}

/// A header entry: dtype, shape, data offsets, and whether the offsets are made consistent with
/// the data (most of the time) or left as drawn.
type Entry = (String, Vec<i64>, (i64, i64), bool);

fn entry() -> impl Strategy<Value = Entry> {
    (
        dtype(),
        prop::collection::vec(dim(), 0..4),
        (0i64..200, 0i64..200),
        any::<bool>(),
    )
}

fn file(
    entries: Vec<Entry>,
    metadata: Option<Value>,
    slack: usize,
    header_len_delta: i64,
) -> Vec<u8> {
    let mut header = Map::new();
    let mut offset = 0i64;
    for (i, (dtype, shape, raw, consistent)) in entries.into_iter().enumerate() {
        let size = match dtype.as_str() {
            "F32" | "I32" | "U32" => 4,
            "F16" | "BF16" => 2,
            "I64" | "F64" => 8,
            _ => 1,
        };
        let n: i64 = shape.iter().fold(1i64, |n, &d| n.saturating_mul(d.max(0)));
        let offsets = if consistent {
            let end = offset.saturating_add(n.saturating_mul(size));
            let o = (offset, end);
            offset = end;
            o
        } else {
            raw
        };
        header.insert(
            format!("t{i}"),
            json!({"dtype": dtype, "shape": shape, "data_offsets": [offsets.0, offsets.1]}),
        );
    }
    if let Some(m) = metadata {
        header.insert("__metadata__".into(), m);
    }
    let text = Value::Object(header).to_string();
    let len = (text.len() as i64 + header_len_delta).max(0) as u64;
    let mut bytes = len.to_le_bytes().to_vec();
    bytes.extend_from_slice(text.as_bytes());
    bytes.extend(std::iter::repeat_n(
        7u8,
        offset.clamp(0, 4096) as usize + slack,
    ));
    bytes
}

fn check(bytes: &[u8]) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("x.safetensors");
    std::fs::write(&path, bytes).unwrap();
    for load in [mlx::io::load_safetensors, mlx::io::load_safetensors_mmap] {
        if let Ok(t) = load(&path) {
            // What loads must also evaluate.
            for a in t.arrays.values() {
                a.eval().unwrap();
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn structured_headers(
        entries in prop::collection::vec(entry(), 0..4),
        metadata in prop_oneof![
            Just(None),
            Just(Some(json!({"format": "pt"}))),
            Just(Some(json!([1, 2]))),
            Just(Some(json!({"quant_type": 4}))),
        ],
        slack in 0usize..8,
        delta in prop_oneof![6 => Just(0i64), 1 => -8i64..8, 1 => Just(1i64 << 40)],
    ) {
        check(&file(entries, metadata, slack, delta));
    }

    #[test]
    fn arbitrary_bytes(bytes in prop::collection::vec(any::<u8>(), 0..64)) {
        check(&bytes);
    }

    #[test]
    fn arbitrary_header_text(text in ".{0,40}", slack in 0usize..16) {
        let mut bytes = (text.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(text.as_bytes());
        bytes.extend(std::iter::repeat_n(0u8, slack));
        check(&bytes);
    }
}
