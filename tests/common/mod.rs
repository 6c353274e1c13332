//! Spawning the real binary the way a parent does: a free port, `/v1/status` polled until
//! ready, NDJSON streamed over real loopback HTTP.
#![allow(dead_code)]

use serde_json::Value;

pub mod cluster;
pub mod serve;
pub mod turn;
use std::io::{BufRead, BufReader, Read};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/models")
        .join(name)
}

pub fn golden(name: &str) -> std::collections::HashMap<String, mlx::Array> {
    mlx::io::load_safetensors(fixture(name).join("golden.safetensors"))
        .unwrap()
        .arrays
}

/// A folder holding a fixture's config and tokenizer files but not its weights (for tests that
/// put something else where the weights go).
pub fn fixture_without_weights(name: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for f in [
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        std::fs::copy(fixture(name).join(f), dir.path().join(f)).unwrap();
    }
    dir
}

/// A port nothing listens on now and that no other test in this process was given: tests run
/// on parallel threads, and two of them picking the same port before either child binds it
/// would each talk to the other's process.
pub fn free_port() -> u16 {
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        if !given.contains(&port) {
            given.push(port);
            return port;
        }
    }
}

pub fn binary() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_mlx-runner"));
    c.env_remove("LD_LIBRARY_PATH");
    // A developer's own ollama models must not leak into the tests (a test that wants ollama's
    // store sets its own).
    c.env("OLLAMA_MODELS", "/nonexistent/ollama-models");
    c
}

pub struct Runner {
    pub child: Child,
    pub port: u16,
    stderr: Option<std::thread::JoinHandle<String>>,
}

impl Runner {
    pub fn start(model: &str, extra: &[&str]) -> Runner {
        Self::start_with(fixture(model).as_os_str(), extra, &[])
    }

    /// `--model` given as is (a directory or a stored model's name), with extra environment.
    pub fn start_with(
        model: &std::ffi::OsStr,
        extra: &[&str],
        env: &[(&str, &std::ffi::OsStr)],
    ) -> Runner {
        // Another process (another test binary's runner) can take the port between our pick and
        // the child's bind: then the child exits, or the other process answers; pick again.
        for _ in 0..8 {
            let port = free_port();
            let mut child = binary()
                .args(["runner", "--model"])
                .arg(model)
                .args(["--port", &port.to_string()])
                .args(extra)
                .envs(env.iter().copied())
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap();
            let mut err = child.stderr.take().unwrap();
            let stderr = std::thread::spawn(move || {
                let mut s = String::new();
                let _ = err.read_to_string(&mut s);
                s
            });
            let mut r = Runner {
                child,
                port,
                stderr: Some(stderr),
            };
            if r.wait_ready() {
                return r;
            }
        }
        panic!("no free port for the runner after 8 tries");
    }

    /// True once our own child answers ready; false if the port turned out to be another
    /// process's. A child that exits for any other reason fails the test with its stderr.
    fn wait_ready(&mut self) -> bool {
        let start = Instant::now();
        let ours = self.child.id();
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                let err = self.stderr.take().unwrap().join().unwrap_or_default();
                if err.contains("cannot listen") {
                    return false;
                }
                panic!("runner exited while loading ({status}): {err}");
            }
            if let Ok(resp) = ureq::get(&self.url("/v1/status")).call() {
                if resp.status() == 200 {
                    let body: Value = resp
                        .into_string()
                        .ok()
                        .and_then(|s| serde_json::from_str(&s).ok())
                        .unwrap_or_default();
                    return body["Pid"].as_u64() == Some(u64::from(ours));
                }
            }
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "runner did not become ready"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    /// POSTs a completion and collects the NDJSON lines.
    pub fn complete(&self, body: &Value) -> Vec<Value> {
        let resp = ureq::post(&self.url("/v1/completions"))
            .send_string(&body.to_string())
            .unwrap_or_else(|e| panic!("completion failed: {e}"));
        assert_eq!(resp.header("content-type"), Some("application/jsonl"));
        BufReader::new(resp.into_reader())
            .lines()
            .map(|l| serde_json::from_str(&l.unwrap()).unwrap())
            .collect()
    }

    /// POSTs a raw body and returns (status, parsed body).
    pub fn post_raw(&self, path: &str, body: &str) -> (u16, Value) {
        match ureq::post(&self.url(path)).send_string(body) {
            Ok(r) => {
                let status = r.status();
                let text = r.into_string().unwrap();
                (
                    status,
                    serde_json::from_str(&text).unwrap_or(Value::String(text)),
                )
            }
            Err(ureq::Error::Status(code, r)) => {
                let text = r.into_string().unwrap();
                (
                    code,
                    serde_json::from_str(&text).unwrap_or(Value::String(text)),
                )
            }
            Err(e) => panic!("{e}"),
        }
    }

    /// Sends SIGTERM and waits for the exit; returns the status and everything on stderr.
    pub fn terminate(mut self) -> (std::process::ExitStatus, String) {
        // SAFETY: kill with a valid pid and signal has no memory-safety preconditions.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let status = wait_timeout(&mut self.child, Duration::from_secs(10))
            .expect("runner did not exit after SIGTERM");
        let err = self
            .stderr
            .take()
            .map(|h| h.join().unwrap())
            .unwrap_or_default();
        (status, err)
    }
}

impl Drop for Runner {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn wait_timeout(child: &mut Child, t: Duration) -> Option<std::process::ExitStatus> {
    let start = Instant::now();
    while start.elapsed() < t {
        if let Ok(Some(s)) = child.try_wait() {
            return Some(s);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}

/// Sends `request` as is on a new connection and returns what comes back before the server
/// closes it or `wait` passes (then `None`: the server kept the connection open).
pub fn raw_http(port: u16, request: &[u8], wait: Duration) -> Option<String> {
    use std::io::Write;
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.write_all(request).unwrap();
    s.set_read_timeout(Some(wait)).unwrap();
    let mut out = Vec::new();
    let start = Instant::now();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return Some(String::from_utf8_lossy(&out).into_owned()),
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {
                return Some(String::from_utf8_lossy(&out).into_owned())
            }
            Err(_) => return None,
        }
        if start.elapsed() > wait {
            return None;
        }
    }
}

/// The text of a stream: every Content, in order.
pub fn text_of(lines: &[Value]) -> String {
    lines.iter().filter_map(|l| l["Content"].as_str()).collect()
}

pub fn done_of(lines: &[Value]) -> &Value {
    let last = lines.last().expect("empty stream");
    assert_eq!(last["Done"], true, "last line is not final: {last}");
    last
}

/// What a request's answer was: its text and its tokens' logprobs.
pub fn outcome(lines: &[Value]) -> (String, Vec<f64>) {
    let lps = lines
        .iter()
        .filter_map(|l| l["Logprobs"].as_array())
        .flatten()
        .map(|e| e["logprob"].as_f64().unwrap())
        .collect();
    (text_of(lines), lps)
}

/// `requests` answered one at a time by a runner of `model` (`--parallel 1`), then all at once
/// by one that batches them in small prefill chunks (`--parallel 4 --prefill-chunk 8`): each
/// gets the same text and logprobs within 1e-4 both ways. Returns the answers alone.
pub fn answers_alone_and_together(model: &str, requests: &[Value]) -> Vec<(String, Vec<f64>)> {
    let solo = Runner::start(model, &["--parallel", "1"]);
    let alone: Vec<(String, Vec<f64>)> = requests
        .iter()
        .map(|b| outcome(&solo.complete(b)))
        .collect();
    drop(solo);
    let together = std::sync::Arc::new(Runner::start(
        model,
        &["--parallel", "4", "--prefill-chunk", "8"],
    ));
    let handles: Vec<_> = requests
        .iter()
        .cloned()
        .map(|b| {
            let r = std::sync::Arc::clone(&together);
            std::thread::spawn(move || outcome(&r.complete(&b)))
        })
        .collect();
    for (i, h) in handles.into_iter().enumerate() {
        let (text, lps) = h.join().unwrap();
        assert_eq!(text, alone[i].0, "request {i}");
        assert_eq!(lps.len(), alone[i].1.len(), "request {i}");
        for (a, b) in lps.iter().zip(&alone[i].1) {
            assert!((a - b).abs() < 1e-4, "request {i}: {a} vs {b}");
        }
    }
    alone
}
