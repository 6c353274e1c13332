//! What the benchmarks share: paths, medians, the peer's Python and the benchmark model.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::Command;

pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The peer environment's Python (benches/peer-venv.sh), if it has been made.
pub fn peer_python() -> Option<PathBuf> {
    let python = root().join(".venv-peer/bin/python");
    if python.exists() {
        Some(python)
    } else {
        eprintln!("no peer environment: run benches/peer-venv.sh first");
        None
    }
}

/// target/bench-model: a ~120M-parameter float32 gemma4-shaped model that mlx-lm itself writes
/// (benches/make_bench_model.py), made on first use.
pub fn bench_model(python: &std::path::Path) -> Option<PathBuf> {
    let model = root().join("target/bench-model");
    if !model.join("model.safetensors").exists() {
        let ok = Command::new(python)
            .arg(root().join("benches/make_bench_model.py"))
            .arg(&model)
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            eprintln!("could not write the benchmark model");
            return None;
        }
    }
    Some(model)
}
