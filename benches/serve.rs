//! `serve`'s cost over talking to the runner directly: `cargo bench --bench serve`.
//!
//! On the benchmark model (target/bench-model, written by `cargo bench --bench generate`): the
//! same greedy completion streamed from `mlx-runner runner` over its protocol, and through
//! `mlx-runner serve` (ollama's `/api/generate`, `raw`, and OpenAI's `/v1/completions`), and
//! the same runner (the one serve spawned for the stored model) talked to directly. Timed from the client: time to
//! the first text, and decode tokens/s after it. The requests alternate; medians of several
//! rounds; the model is loaded before timing starts (load time is not part of either).

mod common;
use common::{free_port, median, root, wait_for, Server};

use serde_json::{json, Value};
use std::io::BufRead;
use std::process::Command;
use std::time::Instant;

const ROUNDS: usize = 21;
const TOKENS: usize = 48;

/// (seconds to the first text, decode tokens/s) of one streamed request whose lines carry their
/// text at `text` and their token count at `count` on the last line (`None` for SSE, where each
/// text event is a token).
fn timed(url: &str, body: &Value, text: &str, count: Option<&str>) -> (f64, f64) {
    let start = Instant::now();
    let resp = ureq::post(url).send_string(&body.to_string()).unwrap();
    let (mut first, mut last, mut tokens) = (None, start, 0usize);
    for line in std::io::BufReader::new(resp.into_reader()).lines() {
        let line = line.unwrap();
        let data = line.strip_prefix("data: ").unwrap_or(&line);
        if data.trim().is_empty() || data.trim() == "[DONE]" {
            continue;
        }
        let v: Value = serde_json::from_str(data).unwrap();
        if v.pointer(text)
            .and_then(Value::as_str)
            .is_some_and(|t| !t.is_empty())
        {
            first.get_or_insert_with(Instant::now);
            last = Instant::now();
            if count.is_none() {
                tokens += 1;
            }
        }
        if let Some(c) = count.and_then(|c| v.pointer(c)).and_then(Value::as_u64) {
            tokens = c as usize;
        }
    }
    let first = first.expect("no text streamed");
    (
        (first - start).as_secs_f64(),
        tokens.saturating_sub(1) as f64 / (last - first).as_secs_f64().max(1e-9),
    )
}

/// The `--port` of the runner child of `serve_pid` (from /proc).
fn runner_port(serve_pid: u32) -> Option<u16> {
    for e in std::fs::read_dir("/proc").ok()?.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let Some(after) = stat.rfind(')').map(|i| &stat[i + 2..]) else {
            continue;
        };
        if after.split(' ').nth(1).and_then(|p| p.parse::<u32>().ok()) != Some(serve_pid) {
            continue;
        }
        let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let args: Vec<String> = cmd
            .split(|&b| b == 0)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        if let Some(i) = args.iter().position(|a| a == "--port") {
            return args.get(i + 1)?.parse().ok();
        }
    }
    None
}

fn main() {
    let model = root().join("target/bench-model");
    if !model.join("model.safetensors").exists() {
        eprintln!("run `cargo bench --bench generate` first (it writes target/bench-model)");
        return;
    }
    let exe = env!("CARGO_BIN_EXE_mlx-runner");
    let store = root().join("target/bench-serve-store");
    let _ = std::fs::remove_dir_all(&store);
    std::fs::create_dir_all(&store).unwrap();
    let mf = store.join("Modelfile");
    std::fs::write(&mf, format!("FROM {}\n", model.display())).unwrap();
    let created = Command::new(exe)
        .env("MLX_RUNNER_MODELS", store.join("models"))
        .args(["create", "bench", "-f"])
        .arg(&mf)
        .output()
        .unwrap();
    assert!(
        created.status.success(),
        "{}",
        String::from_utf8_lossy(&created.stderr)
    );

    let serve_port = free_port();
    let serve = Server(
        Command::new(exe)
            .env("MLX_RUNNER_MODELS", store.join("models"))
            .args([
                "serve",
                "--port",
                &serve_port.to_string(),
                "--keep-alive=-1",
            ])
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    assert!(
        wait_for(&format!("http://127.0.0.1:{serve_port}/")),
        "serve did not start"
    );
    // Load the model before timing.
    ureq::post(&format!("http://127.0.0.1:{serve_port}/api/generate"))
        .send_string(&json!({"model": "bench"}).to_string())
        .unwrap();
    // The runner serve spawned, talked to directly: the same process on both paths.
    let port = runner_port(serve.0.id()).expect("serve has no runner");

    // The options serve sends for {temperature: 0, num_predict: N}: ollama's defaults merged.
    let merged = json!({"num_predict": TOKENS, "num_keep": 4, "top_k": 40, "top_p": 0.9, "typical_p": 1.0,
        "repeat_last_n": 64, "repeat_penalty": 1.0, "seed": -1, "num_ctx": 4096, "num_batch": 512,
        "num_gpu": -1, "draft_num_predict": 4});
    // A short prompt: its prefill is short and steady, so what serve adds to the time to the
    // first token is not lost in the prefill's noise.
    let prompt = "The quick brown fox jumps over the lazy dog.";
    let (mut dt, mut dd, mut st, mut sd, mut ot, mut od) =
        (vec![], vec![], vec![], vec![], vec![], vec![]);
    for round in 0..ROUNDS {
        // A different prompt per round and per path keeps the prefix cache out of it; the
        // three are the same length in tokens.
        let p = |path: &str| {
            let k = ["direct", "ollama", "openai"]
                .iter()
                .position(|x| *x == path)
                .unwrap();
            format!("Round {}. {prompt}", 10 + round * 3 + k)
        };
        let (t, d) = timed(
            &format!("http://127.0.0.1:{port}/v1/completions"),
            &json!({"Prompt": p("direct"), "Options": merged}),
            "/Content",
            Some("/EvalCount"),
        );
        dt.push(t);
        dd.push(d);
        let (t, d) = timed(
            &format!("http://127.0.0.1:{serve_port}/api/generate"),
            &json!({"model": "bench", "prompt": p("ollama"), "raw": true,
                    "options": {"temperature": 0, "num_predict": TOKENS}}),
            "/response",
            Some("/eval_count"),
        );
        st.push(t);
        sd.push(d);
        let (t, d) = timed(
            &format!("http://127.0.0.1:{serve_port}/v1/completions"),
            &json!({"model": "bench", "prompt": p("openai"), "temperature": 0, "top_p": 0.9,
                    "max_tokens": TOKENS, "stream": true}),
            "/choices/0/text",
            None,
        );
        ot.push(t);
        od.push(d);
    }
    let (dt, dd) = (median(dt), median(dd));
    println!(
        "serve vs the runner directly, {TOKENS} greedy tokens, medians of {ROUNDS} (bench model)"
    );
    println!("| path | TTFT | decode tok/s | decode vs direct | TTFT added |");
    println!("|---|---|---|---|---|");
    println!(
        "| runner protocol (direct) | {:.1} ms | {dd:.2} | 1.000 | |",
        dt * 1e3
    );
    for (name, t, d) in [
        ("serve /api/generate", median(st), median(sd)),
        ("serve /v1/completions", median(ot), median(od)),
    ] {
        println!(
            "| {name} | {:.1} ms | {d:.2} | {:.3} | {:+.1} ms |",
            t * 1e3,
            d / dd,
            (t - dt) * 1e3
        );
    }
    let _ = std::fs::remove_dir_all(&store);
}
