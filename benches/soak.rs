//! Soak: many clients against one runner for a while, with random options, random prompt
//! lengths up to past the context, and random cancels; it reports requests served, errors by
//! class and the runner's resident memory over time, and checks that greedy outputs are the same
//! after as before.
//!
//! ```sh
//! SOAK_SECONDS=600 SOAK_CLIENTS=16 cargo bench --bench soak
//! SOAK_THROUGH=serve SOAK_SECONDS=300 cargo bench --bench soak
//! ```
//!
//! `SOAK_THROUGH=serve` soaks `mlx-runner serve` instead, over a temporary store holding the
//! gemma4 and GLM fixtures: clients alternate models and APIs (ollama's `/api/chat`, OpenAI's
//! `/v1/chat/completions`, both streamed), 30% of streams are cancelled, and it reports serve's
//! and each runner's resident memory over time. Serve runs with `--memory-limit` of
//! `SOAK_MEMORY_LIMIT` bytes (512 MiB), so each runner's prefix cache gets a budget it fills
//! within a few minutes. It exits non-zero on a failed request, a dead runner, serve's memory
//! growing past its start plus a fixed margin, or a runner's past its resident memory after
//! loading plus its prefix-cache budget plus a fixed margin (what a runner holds beyond its
//! cache: MLX's buffers for live sequences, the allocator's slack).
//!
//! `SOAK_MODEL` (default: the gemma4 E2B-like fixture, drafting with its assistant),
//! `SOAK_CTX` (256) and `SOAK_BUDGET` (prefix cache bytes, 64 MiB) shape the run. It exits
//! non-zero when the runner dies, a greedy output changes, a request fails in a way that is
//! not the client's doing, or memory grows past the budget plus the model and a fixed margin.

mod common;

use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A small deterministic generator per client (reproducible runs for a given seed).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

const WORDS: &[&str] = &[
    "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "and", "then", "runs", "far",
    "away", "into", "deep", "dark", "forest", "where", "no", "one", "can", "find", "it", "again",
];

fn rss_kib(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
}

#[derive(Default)]
struct Tally {
    served: u64,
    cancelled: u64,
    tokens: u64,
    errors: BTreeMap<String, u64>,
}

impl Tally {
    fn error(&mut self, class: &str) {
        *self.errors.entry(class.to_string()).or_default() += 1;
    }
}

fn greedy(port: u16, prompt: &str) -> String {
    let body = json!({"Prompt": prompt, "Options": {"num_predict": 16}});
    let text = ureq::post(&format!("http://127.0.0.1:{port}/v1/completions"))
        .send_string(&body.to_string())
        .expect("a greedy check request")
        .into_string()
        .unwrap();
    text.lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter_map(|v| v["Content"].as_str().map(String::from))
        .collect()
}

/// One request with random everything; records how it went.
fn one_request(port: u16, rng: &mut Rng, ctx: u64, tally: &Mutex<Tally>) {
    // Prompts from a few words to near the context, and one in ten past it.
    let words = if rng.below(10) == 0 {
        ctx + rng.below(ctx)
    } else {
        2 + rng.below(ctx / 3)
    };
    let prompt: Vec<&str> = (0..words)
        .map(|_| WORDS[rng.below(WORDS.len() as u64) as usize])
        .collect();
    let mut options = serde_json::Map::new();
    options.insert("num_predict".into(), json!(rng.below(48) as i64 - 4));
    if rng.below(2) == 0 {
        options.insert("temperature".into(), json!(0.2 + rng.unit()));
        options.insert("top_k".into(), json!(rng.below(60) as i64 - 5));
        options.insert("top_p".into(), json!(rng.unit() * 1.2));
        if rng.below(2) == 0 {
            options.insert("seed".into(), json!(rng.below(1000)));
        }
    }
    if rng.below(3) == 0 {
        options.insert("repeat_penalty".into(), json!(0.8 + rng.unit()));
        options.insert("repeat_last_n".into(), json!(rng.below(600) as i64 - 1));
    }
    if rng.below(4) == 0 {
        options.insert(
            "stop".into(),
            json!([WORDS[rng.below(WORDS.len() as u64) as usize]]),
        );
    }
    let body = json!({
        "Prompt": prompt.join(" "),
        "Options": options,
        "Logprobs": rng.below(5) == 0,
        "TopLogprobs": rng.below(4),
    });
    // A quarter of the requests are abandoned after a few chunks.
    let cancel_after = (rng.below(4) == 0).then(|| rng.below(6) as usize);
    let resp = ureq::post(&format!("http://127.0.0.1:{port}/v1/completions"))
        .timeout(Duration::from_secs(300))
        .send_string(&body.to_string());
    let resp = match resp {
        Ok(r) => r,
        Err(ureq::Error::Status(400, r)) => {
            let msg = r.into_string().unwrap_or_default();
            let class = if msg.contains("too long") {
                "400 prompt too long (expected)"
            } else {
                "400 other"
            };
            tally.lock().unwrap().error(class);
            return;
        }
        Err(ureq::Error::Status(code, _)) => {
            tally.lock().unwrap().error(&format!("HTTP {code}"));
            return;
        }
        Err(e) => {
            tally.lock().unwrap().error(&format!("transport: {e}"));
            return;
        }
    };
    for (read, line) in BufReader::new(resp.into_reader()).lines().enumerate() {
        let Ok(line) = line else {
            tally.lock().unwrap().error("stream read");
            return;
        };
        if cancel_after.is_some_and(|n| read >= n) {
            tally.lock().unwrap().cancelled += 1;
            return; // dropping the reader closes the connection
        }
        let Ok(v) = serde_json::from_str::<Value>(&line) else {
            tally.lock().unwrap().error("unparseable line");
            return;
        };
        if v.get("Error").is_some() {
            tally.lock().unwrap().error("in-stream error");
            return;
        }
        if v["Done"] == true {
            let mut t = tally.lock().unwrap();
            t.served += 1;
            t.tokens += v["EvalCount"].as_u64().unwrap_or(0);
            return;
        }
    }
    tally.lock().unwrap().error("stream ended without Done");
}

fn main() {
    if std::env::var("SOAK_THROUGH").as_deref() == Ok("serve") {
        return soak_serve();
    }
    let env = |k: &str, d: u64| {
        std::env::var(k)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(d)
    };
    let seconds = env("SOAK_SECONDS", 60);
    let clients = env("SOAK_CLIENTS", 16);
    let ctx = env("SOAK_CTX", 256);
    let budget = env("SOAK_BUDGET", 64 << 20);
    let root = common::root();
    let fixture = |n: &str| root.join("tests/fixtures/models").join(n);
    let model = std::env::var("SOAK_MODEL")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|_| fixture("gemma4_e2b_like"));
    let draft = fixture("gemma4_assistant");
    let mut extra = vec![
        "--ctx-size".to_string(),
        ctx.to_string(),
        "--cache-budget".to_string(),
        budget.to_string(),
        "--parallel".to_string(),
        "4".to_string(),
    ];
    if std::env::var("SOAK_MODEL").is_err() {
        extra.extend(["--draft".to_string(), draft.display().to_string()]);
    }
    let extra_refs: Vec<&str> = extra.iter().map(String::as_str).collect();
    let (mut server, port) = common::runner(&model, &extra_refs);
    let pid = server.0.id();
    let checks = ["The quick brown fox", "Hello, world!", "Once upon a time"];
    let before: Vec<String> = checks.iter().map(|p| greedy(port, p)).collect();
    let loaded_rss = rss_kib(pid).unwrap_or(0);
    println!(
        "soak: {clients} clients for {seconds} s, context {ctx}, cache budget {} MiB, {} (RSS after load {} MiB)",
        budget >> 20,
        model.display(),
        loaded_rss / 1024
    );

    let tally = Arc::new(Mutex::new(Tally::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let samples = Arc::new(Mutex::new(Vec::<(f64, u64)>::new()));
    let start = Instant::now();
    let sampler = {
        let (stop, samples) = (Arc::clone(&stop), Arc::clone(&samples));
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                if let Some(r) = rss_kib(pid) {
                    samples
                        .lock()
                        .unwrap()
                        .push((start.elapsed().as_secs_f64(), r));
                }
                std::thread::sleep(Duration::from_secs(1));
            }
        })
    };
    let workers: Vec<_> = (0..clients)
        .map(|i| {
            let (stop, tally) = (Arc::clone(&stop), Arc::clone(&tally));
            std::thread::spawn(move || {
                let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ (i + 1).wrapping_mul(0x1234_5678_9ABC));
                while !stop.load(Ordering::Relaxed) {
                    one_request(port, &mut rng, ctx, &tally);
                }
            })
        })
        .collect();
    while start.elapsed() < Duration::from_secs(seconds) {
        std::thread::sleep(Duration::from_secs(1));
        if let Ok(Some(status)) = server.0.try_wait() {
            eprintln!("the runner died: {status}");
            std::process::exit(1);
        }
    }
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        let _ = w.join();
    }
    let _ = sampler.join();
    let elapsed = start.elapsed().as_secs_f64();
    let after: Vec<String> = checks.iter().map(|p| greedy(port, p)).collect();

    let t = tally.lock().unwrap();
    let samples = samples.lock().unwrap();
    println!(
        "served {} requests ({:.1}/s), {} tokens ({:.1} tok/s), {} cancelled by their client",
        t.served,
        t.served as f64 / elapsed,
        t.tokens,
        t.tokens as f64 / elapsed,
        t.cancelled
    );
    for (class, n) in &t.errors {
        println!("  {n:>6}  {class}");
    }
    let mib = |k: u64| k as f64 / 1024.0;
    let peak = samples.iter().map(|s| s.1).max().unwrap_or(0);
    println!("RSS over time (MiB):");
    let step = (samples.len() / 10).max(1);
    for s in samples.iter().step_by(step) {
        println!("  {:>7.0} s  {:>8.1}", s.0, mib(s.1));
    }
    let last = samples.last().map_or(0, |s| s.1);
    println!(
        "  loaded {:.1}, peak {:.1}, last {:.1}",
        mib(loaded_rss),
        mib(peak),
        mib(last)
    );
    let mut failed = false;
    if before != after {
        println!("GREEDY OUTPUT CHANGED:\n  before {before:?}\n  after  {after:?}");
        failed = true;
    } else {
        println!("greedy outputs before and after: identical");
    }
    let bad: u64 = t
        .errors
        .iter()
        .filter(|(c, _)| !c.contains("(expected)"))
        .map(|(_, n)| n)
        .sum();
    if bad > 0 {
        println!("{bad} requests failed in ways that are not the client's doing");
        failed = true;
    }
    // The cache's budget, the model and a fixed margin for MLX's buffers and the tokenizer.
    let margin_kib = 512 * 1024;
    let bound = loaded_rss + budget / 1024 + margin_kib;
    if peak > bound {
        println!(
            "RSS peaked at {:.1} MiB, past the bound of {:.1}",
            mib(peak),
            mib(bound)
        );
        failed = true;
    }
    if failed {
        std::process::exit(1);
    }
}

/// The runner children of `serve`, by the model each serves (`--model NAME`).
/// The port a runner process was told to listen on.
fn runner_port(pid: u32) -> Option<u16> {
    let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let args: Vec<String> = cmd
        .split(|&b| b == 0)
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    let i = args.iter().position(|a| a == "--port")?;
    args.get(i + 1)?.parse().ok()
}

fn runners_of(serve: u32) -> Vec<(String, u32)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let after = &stat[stat.rfind(')').map_or(0, |i| i + 2)..];
        if after.split(' ').nth(1).and_then(|p| p.parse::<u32>().ok()) != Some(serve) {
            continue;
        }
        let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let args: Vec<String> = cmd
            .split(|&b| b == 0)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        if args.get(1).map(String::as_str) == Some("runner") {
            if let Some(i) = args.iter().position(|a| a == "--model") {
                out.push((args.get(i + 1).cloned().unwrap_or_default(), pid));
            }
        }
    }
    out
}

/// One chat through serve: a random model, API and options; a third abandoned mid-stream.
fn one_chat(port: u16, rng: &mut Rng, tally: &Mutex<Tally>) {
    let model = ["gem", "glm"][rng.below(2) as usize];
    let words: Vec<&str> = (0..2 + rng.below(60))
        .map(|_| WORDS[rng.below(WORDS.len() as u64) as usize])
        .collect();
    let messages = json!([{"role": "user", "content": words.join(" ")}]);
    let n = 1 + rng.below(40) as i64;
    let temperature = if rng.below(2) == 0 {
        0.0
    } else {
        0.2 + rng.unit()
    };
    let openai = rng.below(2) == 0;
    let (path, body) = if openai {
        (
            "/v1/chat/completions",
            json!({"model": model, "messages": messages, "stream": true, "max_tokens": n,
                "temperature": temperature, "reasoning_effort": "none"}),
        )
    } else {
        (
            "/api/chat",
            json!({"model": model, "messages": messages, "think": false,
                "options": {"num_predict": n, "temperature": temperature}}),
        )
    };
    let cancel_after = (rng.below(10) < 3).then(|| rng.below(4) as usize);
    let resp = ureq::post(&format!("http://127.0.0.1:{port}{path}"))
        .timeout(Duration::from_secs(300))
        .send_string(&body.to_string());
    let resp = match resp {
        Ok(r) => r,
        Err(ureq::Error::Status(code, r)) => {
            let msg = r.into_string().unwrap_or_default();
            tally.lock().unwrap().error(&format!(
                "HTTP {code}: {}",
                msg.chars().take(80).collect::<String>()
            ));
            return;
        }
        Err(e) => {
            tally.lock().unwrap().error(&format!("transport: {e}"));
            return;
        }
    };
    for (read, line) in BufReader::new(resp.into_reader()).lines().enumerate() {
        let Ok(line) = line else {
            tally.lock().unwrap().error("stream read");
            return;
        };
        if cancel_after.is_some_and(|n| read >= n) {
            tally.lock().unwrap().cancelled += 1;
            return;
        }
        let data = line.strip_prefix("data: ").unwrap_or(&line).trim();
        if data.is_empty() {
            continue;
        }
        if data == "[DONE]" {
            tally.lock().unwrap().served += 1;
            return;
        }
        let Ok(v) = serde_json::from_str::<Value>(data) else {
            tally.lock().unwrap().error("unparseable line");
            return;
        };
        if v.get("error").is_some() {
            tally.lock().unwrap().error("in-stream error");
            return;
        }
        if !openai && v["done"] == true {
            let mut t = tally.lock().unwrap();
            t.served += 1;
            t.tokens += v["eval_count"].as_u64().unwrap_or(0);
            return;
        }
        if openai && v["choices"][0]["delta"]["content"].is_string() {
            tally.lock().unwrap().tokens += 1;
        }
    }
    tally.lock().unwrap().error("stream ended without its end");
}

fn soak_serve() {
    let env = |k: &str, d: u64| {
        std::env::var(k)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(d)
    };
    let seconds = env("SOAK_SECONDS", 60);
    let clients = env("SOAK_CLIENTS", 16);
    let memory_limit = env("SOAK_MEMORY_LIMIT", 512 << 20);
    let exe = env!("CARGO_BIN_EXE_mlx-runner");
    let root = common::root();
    let dir = tempfile::tempdir().unwrap();
    let models = dir.path().join("models");
    for (name, fixture, draft) in [
        ("gem", "gemma4_e2b_like", Some("gemma4_assistant")),
        ("glm", "glm4_moe_lite", None),
    ] {
        let fixtures = root.join("tests/fixtures/models");
        let mut mf = format!("FROM {}\n", fixtures.join(fixture).display());
        if let Some(d) = draft {
            mf.push_str(&format!("DRAFT {}\n", fixtures.join(d).display()));
        }
        let path = dir.path().join(format!("Modelfile.{name}"));
        std::fs::write(&path, mf).unwrap();
        let out = std::process::Command::new(exe)
            .env("MLX_RUNNER_MODELS", &models)
            .args(["create", name, "-f"])
            .arg(&path)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let port = common::free_port();
    let mut server = common::Server(
        std::process::Command::new(exe)
            .env("MLX_RUNNER_MODELS", &models)
            .env("MLX_RUNNER_HOST", format!("127.0.0.1:{port}"))
            .env("MLX_RUNNER_KEEP_ALIVE", "-1")
            .env("MLX_RUNNER_MEMORY_LIMIT", memory_limit.to_string())
            .env("OLLAMA_MODELS", "/nonexistent")
            .arg("serve")
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    assert!(
        common::wait_for(&format!("http://127.0.0.1:{port}/")),
        "serve did not start"
    );
    let pid = server.0.id();
    // Both runners loaded before the clock starts.
    for model in ["gem", "glm"] {
        let body = json!({"model": model, "messages": [{"role": "user", "content": "hi"}],
            "stream": false, "think": false, "options": {"num_predict": 1}});
        ureq::post(&format!("http://127.0.0.1:{port}/api/chat"))
            .send_string(&body.to_string())
            .expect("a warm-up request");
    }
    let serve_start = rss_kib(pid).unwrap_or(0);
    println!(
        "soak through serve: {clients} clients for {seconds} s over gem (with its assistant) and glm, both APIs, 30% cancelled (serve {} MiB at start, --memory-limit {} MiB)",
        serve_start / 1024,
        memory_limit >> 20
    );
    // Each runner's resident memory after loading and its prefix-cache budget (its status).
    let runners_start: Vec<(String, u64, u64)> = runners_of(pid)
        .into_iter()
        .map(|(name, p)| {
            let status = runner_port(p)
                .and_then(|port| {
                    ureq::get(&format!("http://127.0.0.1:{port}/v1/status"))
                        .call()
                        .ok()?
                        .into_string()
                        .ok()
                        .and_then(|b| serde_json::from_str::<Value>(&b).ok())
                })
                .unwrap_or(Value::Null);
            let budget = status["CacheBudget"].as_u64().unwrap_or(0);
            println!(
                "  runner {name}: {} MiB resident after loading, prefix-cache budget {} MiB",
                rss_kib(p).unwrap_or(0) / 1024,
                budget >> 20
            );
            (name, rss_kib(p).unwrap_or(0), budget / 1024)
        })
        .collect();
    let tally = Arc::new(Mutex::new(Tally::default()));
    let stop = Arc::new(AtomicBool::new(false));
    // (seconds, serve, gem's runner, glm's runner), KiB.
    let samples = Arc::new(Mutex::new(Vec::<(f64, u64, u64, u64)>::new()));
    let start = Instant::now();
    let sampler = {
        let (stop, samples) = (Arc::clone(&stop), Arc::clone(&samples));
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let runners = runners_of(pid);
                let of = |name: &str| {
                    runners
                        .iter()
                        .find(|(m, _)| m.starts_with(name))
                        .and_then(|(_, p)| rss_kib(*p))
                        .unwrap_or(0)
                };
                samples.lock().unwrap().push((
                    start.elapsed().as_secs_f64(),
                    rss_kib(pid).unwrap_or(0),
                    of("gem"),
                    of("glm"),
                ));
                std::thread::sleep(Duration::from_secs(1));
            }
        })
    };
    let workers: Vec<_> = (0..clients)
        .map(|i| {
            let (stop, tally) = (Arc::clone(&stop), Arc::clone(&tally));
            std::thread::spawn(move || {
                let mut rng = Rng(0x2545_F491_4F6C_DD1D ^ (i + 1).wrapping_mul(0x9E37_79B9));
                while !stop.load(Ordering::Relaxed) {
                    one_chat(port, &mut rng, &tally);
                }
            })
        })
        .collect();
    while start.elapsed() < Duration::from_secs(seconds) {
        std::thread::sleep(Duration::from_secs(1));
        if let Ok(Some(status)) = server.0.try_wait() {
            eprintln!("serve died: {status}");
            std::process::exit(1);
        }
    }
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        let _ = w.join();
    }
    let _ = sampler.join();
    let elapsed = start.elapsed().as_secs_f64();
    let t = tally.lock().unwrap();
    println!(
        "served {} requests ({:.1}/s), {} tokens ({:.1} tok/s), {} cancelled by their client",
        t.served,
        t.served as f64 / elapsed,
        t.tokens,
        t.tokens as f64 / elapsed,
        t.cancelled
    );
    for (class, n) in &t.errors {
        println!("  {n:>6}  {class}");
    }
    let samples = samples.lock().unwrap();
    let mib = |k: u64| k as f64 / 1024.0;
    println!("resident memory over time (MiB):");
    println!(
        "  {:>7}  {:>8}  {:>8}  {:>8}",
        "time", "serve", "gem", "glm"
    );
    let step = (samples.len() / 12).max(1);
    for s in samples.iter().step_by(step).chain(samples.last()) {
        println!(
            "  {:>5.0} s  {:>8.1}  {:>8.1}  {:>8.1}",
            s.0,
            mib(s.1),
            mib(s.2),
            mib(s.3)
        );
    }
    let peak = |f: fn(&(f64, u64, u64, u64)) -> u64| samples.iter().map(f).max().unwrap_or(0);
    println!(
        "  peaks: serve {:.1}, gem {:.1}, glm {:.1}",
        mib(peak(|s| s.1)),
        mib(peak(|s| s.2)),
        mib(peak(|s| s.3))
    );
    let mut failed = false;
    let bad: u64 = t.errors.values().sum();
    if bad > 0 {
        println!("{bad} requests failed");
        failed = true;
    }
    if runners_of(pid).len() != 2 {
        println!("a runner died: {:?}", runners_of(pid));
        failed = true;
    }
    // A runner holds its model, its prefix cache within the budget, and a bounded rest.
    let runner_margin_kib = 256 * 1024;
    for (name, start, budget) in &runners_start {
        let col: fn(&(f64, u64, u64, u64)) -> u64 = if name.starts_with("gem") {
            |s| s.2
        } else {
            |s| s.3
        };
        let bound = start + budget + runner_margin_kib;
        if peak(col) > bound {
            println!(
                "runner {name}'s memory peaked at {:.1} MiB, past {:.1} after loading + {:.1} budget + {} MiB",
                mib(peak(col)),
                mib(*start),
                mib(*budget),
                runner_margin_kib / 1024
            );
            failed = true;
        }
    }
    // Serve holds requests' buffers, not models: its memory stays near where it started.
    let margin_kib = 200 * 1024;
    if peak(|s| s.1) > serve_start + margin_kib {
        println!(
            "serve's memory peaked at {:.1} MiB, past its start plus {} MiB",
            mib(peak(|s| s.1)),
            margin_kib / 1024
        );
        failed = true;
    }
    if failed {
        std::process::exit(1);
    }
}
