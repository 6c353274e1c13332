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

/// A free port on loopback.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A server process, killed when dropped.
pub struct Server(pub std::process::Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Polls `url` until it answers (true) or two minutes pass (false).
pub fn wait_for(url: &str) -> bool {
    let start = std::time::Instant::now();
    while start.elapsed() < std::time::Duration::from_secs(120) {
        if ureq::get(url).call().is_ok() {
            return true;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    false
}

/// `mlx-runner runner --model <model> <extra>` on a free port, once it is ready.
pub fn runner(model: &std::path::Path, extra: &[&str]) -> (Server, u16) {
    let port = free_port();
    let child = Command::new(env!("CARGO_BIN_EXE_mlx-runner"))
        .args(["runner", "--model"])
        .arg(model)
        .args(["--port", &port.to_string()])
        .args(extra)
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let server = Server(child);
    assert!(
        wait_for(&format!("http://127.0.0.1:{port}/v1/status")),
        "runner did not start"
    );
    (server, port)
}
