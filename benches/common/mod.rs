//! What the benchmarks share: paths, medians, the peer's Python and the benchmark model.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The affine-quantized matrix `<base>.weight` among a checkpoint's arrays (mlx-lm's layout:
/// `.scales` and `.biases` beside the packed words), in MLX's row layout; `None` where the
/// weight has no scales (a float matrix).
pub fn affine_matrix(
    arrays: &std::collections::HashMap<String, mlx::Array>,
    base: &str,
    group_size: i32,
    bits: i32,
) -> Option<mlx::Quantized> {
    Some(mlx::Quantized {
        weight: arrays.get(&format!("{base}.weight"))?.clone(),
        scales: arrays.get(&format!("{base}.scales"))?.clone(),
        biases: arrays.get(&format!("{base}.biases")).cloned(),
        group_size,
        bits,
        mode: mlx::QuantMode::Affine,
        panels: false,
    })
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
    bench_model_as(python, "target/bench-model", &[])
}

/// The benchmark model with every layer attending globally (`make_bench_model.py --global`),
/// in target/bench-model-global.
pub fn global_bench_model(python: &std::path::Path) -> Option<PathBuf> {
    bench_model_as(python, "target/bench-model-global", &["--global"])
}

fn bench_model_as(python: &std::path::Path, dir: &str, args: &[&str]) -> Option<PathBuf> {
    let model = root().join(dir);
    if !model.join("model.safetensors").exists() {
        let ok = Command::new(python)
            .arg(root().join("benches/make_bench_model.py"))
            .arg(&model)
            .args(args)
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            eprintln!("could not write the benchmark model");
            return None;
        }
    }
    Some(model)
}

/// A tower benchmark's transformers peer: .venv-golden's Python (tests/fixtures/requirements.txt)
/// and the benchmark's checkpoint, written by `benches/<script> make DIR` on first use. `None`
/// (said why) without the environment.
pub fn tower_peer(script: &str, dir: &str) -> Option<(PathBuf, PathBuf)> {
    let python = root().join(".venv-golden/bin/python");
    if !python.exists() {
        eprintln!("no .venv-golden (tests/fixtures/requirements.txt): skipping");
        return None;
    }
    let dir = root().join(dir);
    if !dir.join("model.safetensors").exists() {
        let ok = Command::new(&python)
            .arg(root().join("benches").join(script))
            .arg("make")
            .arg(&dir)
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "could not write the {script} benchmark model");
    }
    Some((python, dir))
}

/// Resident memory now, with the peak reset to it (Linux: `/proc/self/clear_refs`), in bytes.
pub fn rss_reset() -> u64 {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
    proc_status("VmRSS")
}

/// The resident peak since [`rss_reset`], in bytes.
pub fn rss_peak() -> u64 {
    proc_status("VmHWM")
}

fn proc_status(key: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// `python benches/<script> ARGS…`, a tower peer: its seconds per measured run (lines holding
/// a number; a warm-up is printed as `warmup SECONDS` and left out), and the growth of its
/// resident memory during its first run (its `peak BYTES` line).
pub fn tower_peer_times(python: &Path, script: &str, args: &[String]) -> (Vec<f64>, u64) {
    let out = Command::new(python)
        .arg(root().join("benches").join(script))
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let peak = text
        .lines()
        .find_map(|l| l.strip_prefix("peak ")?.trim().parse().ok())
        .unwrap_or(0);
    let times = text.lines().filter_map(|l| l.trim().parse().ok()).collect();
    (times, peak)
}

/// Our side of a tower benchmark, medians over the measured runs: the whole (prepare and
/// encode, evaluated), the preparing alone (decoding and preprocessing), the growth of resident
/// memory in the first (cold, unmeasured) run, the last prepared input and the soft tokens made.
pub struct TowerRuns<P> {
    pub total: f64,
    pub prepare: f64,
    pub grew: u64,
    pub prepared: P,
    pub tokens: i32,
}

pub fn tower_runs<P>(
    runs: usize,
    prepare: impl Fn() -> P,
    encode: impl Fn(&P) -> mlx::Array,
) -> TowerRuns<P> {
    let (mut total, mut prepared_s) = (Vec::new(), Vec::new());
    let mut grew = 0;
    let mut last = None;
    for i in 0..=runs {
        let base = rss_reset();
        let t0 = std::time::Instant::now();
        let prepared = prepare();
        let t1 = std::time::Instant::now();
        let soft = encode(&prepared);
        soft.eval().unwrap();
        if i == 0 {
            grew = rss_peak().saturating_sub(base);
        } else {
            total.push(t0.elapsed().as_secs_f64());
            prepared_s.push((t1 - t0).as_secs_f64());
        }
        last = Some((prepared, soft.dim(0).unwrap()));
    }
    let (prepared, tokens) = last.unwrap();
    TowerRuns {
        total: median(total),
        prepare: median(prepared_s),
        grew,
        prepared,
        tokens,
    }
}

/// One peer's line in a tower benchmark: its median time against ours and the resident memory
/// its first encode grew.
pub fn print_tower_peer<P>(name: &str, ours: &TowerRuns<P>, (times, peak): (Vec<f64>, u64)) {
    let theirs = median(times);
    println!(
        "  {name:<25} {theirs:.3} s: ours takes {:.3}x its time; resident memory grown by the \
         first encode {:.0} MB (ours {:.0} MB)",
        ours.total / theirs,
        peak as f64 / 1e6,
        ours.grew as f64 / 1e6
    );
}

/// mlx-vlm, the tower benchmarks' MLX peer (benches/vlm_peer.py): the peer environment's Python
/// when it has mlx-vlm (benches/peer-venv.sh), else `None` (said why).
pub fn vlm_peer() -> Option<PathBuf> {
    let python = peer_python()?;
    let ok = Command::new(&python)
        .args(["-c", "import mlx_vlm"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        eprintln!("the peer environment has no mlx-vlm: run benches/peer-venv.sh");
        return None;
    }
    Some(python)
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
        .stderr(if std::env::var("BENCH_RUNNER_LOG").is_ok() {
            std::process::Stdio::inherit()
        } else {
            std::process::Stdio::null()
        })
        .spawn()
        .unwrap();
    let server = Server(child);
    assert!(
        wait_for(&format!("http://127.0.0.1:{port}/v1/status")),
        "runner did not start"
    );
    (server, port)
}

/// One streamed completion, timed from the client.
pub struct Timing {
    pub start: std::time::Instant,
    /// The first chunk with text.
    pub first: std::time::Instant,
    /// The last chunk with text.
    pub last: std::time::Instant,
    /// The end of the stream.
    pub end: std::time::Instant,
    /// Tokens generated (our `EvalCount`; the peer's text chunks).
    pub tokens: usize,
    /// When each chunk with text arrived.
    pub chunks: Vec<std::time::Instant>,
}

impl Timing {
    /// Seconds to the first text.
    pub fn ttft(&self) -> f64 {
        (self.first - self.start).as_secs_f64()
    }

    /// Tokens after the first over the time between the first text and the last.
    pub fn decode_rate(&self) -> f64 {
        self.tokens.saturating_sub(1) as f64 / (self.last - self.first).as_secs_f64().max(1e-9)
    }
}

/// A greedy completion of `n` tokens from `mlx-runner runner` on `port`.
/// The constructed target/drafter pair of benches/speculative.rs (acceptance 1):
/// `(target, draft-good)`, or `None` (with a message) before that bench has written it.
pub fn spec_pair() -> Option<(PathBuf, PathBuf)> {
    let dir = root().join("target/bench-spec");
    if !dir.join("draft-good/model.safetensors").exists() {
        eprintln!("(no drafting section: run `cargo bench --bench speculative` first; it writes target/bench-spec)");
        return None;
    }
    Some((dir.join("target"), dir.join("draft-good")))
}

/// Posts a completion `body` to the runner on `port` and returns the stream's last line (the
/// one with `EvalCount`, `EvalDuration` and the draft counts).
pub fn complete_last(port: u16, body: &serde_json::Value) -> serde_json::Value {
    use std::io::BufRead;
    let resp = ureq::post(&format!("http://127.0.0.1:{port}/v1/completions"))
        .send_string(&body.to_string())
        .unwrap();
    std::io::BufReader::new(resp.into_reader())
        .lines()
        .map_while(|l| l.ok())
        .filter_map(|l| serde_json::from_str(&l).ok())
        .last()
        .unwrap_or(serde_json::Value::Null)
}

pub fn stream_ours(port: u16, prompt: &str, n: usize) -> Timing {
    use std::io::BufRead;
    let body = serde_json::json!({"Prompt": prompt, "Options": {"num_predict": n, "temperature": 0, "repeat_penalty": 1.0}});
    let start = std::time::Instant::now();
    let resp = ureq::post(&format!("http://127.0.0.1:{port}/v1/completions"))
        .send_string(&body.to_string())
        .unwrap();
    let (mut first, mut last, mut tokens, mut chunks) = (None, start, 0, Vec::new());
    for line in std::io::BufReader::new(resp.into_reader()).lines() {
        let v: serde_json::Value = serde_json::from_str(&line.unwrap()).unwrap();
        if v["Done"] == true {
            tokens = v["EvalCount"].as_u64().unwrap_or(0) as usize;
            break;
        }
        if !v["Content"].as_str().unwrap_or("").is_empty() {
            first.get_or_insert_with(std::time::Instant::now);
            last = std::time::Instant::now();
            chunks.push(last);
        }
    }
    let end = std::time::Instant::now();
    Timing {
        start,
        first: first.unwrap_or(end),
        last,
        end,
        tokens,
        chunks,
    }
}

/// The same completion from `mlx_lm.server` on `port` (OpenAI completions, streamed).
pub fn stream_peer(port: u16, prompt: &str, n: usize) -> Timing {
    use std::io::BufRead;
    let body =
        serde_json::json!({"prompt": prompt, "max_tokens": n, "temperature": 0.0, "stream": true});
    let start = std::time::Instant::now();
    let resp = ureq::post(&format!("http://127.0.0.1:{port}/v1/completions"))
        .send_string(&body.to_string())
        .unwrap();
    let (mut first, mut last, mut tokens, mut chunks) = (None, start, 0, Vec::new());
    for line in std::io::BufReader::new(resp.into_reader()).lines() {
        let line = line.unwrap();
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data.trim() == "[DONE]" {
            break;
        }
        let v: serde_json::Value = serde_json::from_str(data).unwrap_or(serde_json::Value::Null);
        if v["choices"][0]["text"]
            .as_str()
            .is_some_and(|t| !t.is_empty())
        {
            first.get_or_insert_with(std::time::Instant::now);
            last = std::time::Instant::now();
            chunks.push(last);
            tokens += 1;
        }
    }
    let end = std::time::Instant::now();
    Timing {
        start,
        first: first.unwrap_or(end),
        last,
        end,
        tokens,
        chunks,
    }
}

/// `mlx_lm.server` (the peer) on `model` with `extra` arguments, on a free port, once it
/// answers; OpenBLAS preloaded when the system has it (ours links it too).
pub fn peer_server(
    python: &std::path::Path,
    model: &std::path::Path,
    extra: &[&str],
) -> (Server, u16) {
    let port = free_port();
    let mut cmd = Command::new(python);
    cmd.args(["-m", "mlx_lm", "server", "--model"])
        .arg(model)
        .args(["--port", &port.to_string(), "--prompt-cache-size", "0"])
        .args(extra)
        .stdout(std::process::Stdio::null())
        .stderr(if std::env::var("BENCH_RUNNER_LOG").is_ok() {
            std::process::Stdio::inherit()
        } else {
            std::process::Stdio::null()
        });
    let blas = std::path::Path::new("/lib/x86_64-linux-gnu/libopenblas.so.0");
    if blas.exists() {
        cmd.env("LD_PRELOAD", blas);
    }
    let server = Server(cmd.spawn().unwrap());
    assert!(
        wait_for(&format!("http://127.0.0.1:{port}/v1/models")),
        "mlx_lm.server did not start"
    );
    (server, port)
}

/// The number just before `unit` on the line that starts with `label`.
pub fn rate(text: &str, label: &str, unit: &str) -> Option<f64> {
    let line = text.lines().find(|l| l.contains(label))?;
    let at = line.find(label)? + label.len();
    let rest = &line[at..];
    let end = rest.find(unit)?;
    rest[..end]
        .rsplit([',', ' '])
        .find(|s| !s.is_empty())?
        .trim()
        .parse()
        .ok()
}

/// The system's OpenBLAS, preloaded into the peer so that both sides run the same BLAS.
pub fn system_openblas() -> Option<&'static str> {
    [
        "/lib/x86_64-linux-gnu/libopenblas.so.0",
        "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    ]
    .into_iter()
    .find(|p| std::path::Path::new(p).exists())
}

/// One `generate` run: prefill and decode tokens/s, and the process's peak resident memory.
pub struct Generation {
    pub prefill: f64,
    pub decode: f64,
    pub peak_rss: u64,
}

/// `mlx-runner generate` on `model`: (prefill tok/s, decode tok/s).
pub fn ours_generate(model: &std::path::Path, prompt: &str, tokens: &str) -> (f64, f64) {
    let g = ours_run(model, prompt, tokens, &[]);
    (g.prefill, g.decode)
}

/// `mlx-runner generate` on `model`, with extra environment (a model store, say).
pub fn ours_run(
    model: &std::path::Path,
    prompt: &str,
    tokens: &str,
    env: &[(&str, &std::ffi::OsStr)],
) -> Generation {
    let (_, err, peak_rss) = output_with_peak_rss(
        Command::new(env!("CARGO_BIN_EXE_mlx-runner"))
            .args(["generate", "--model"])
            .arg(model)
            .args(["--prompt", prompt, "-n", tokens])
            .envs(env.iter().copied()),
    );
    Generation {
        prefill: rate(&err, "prompt:", "tok/s").unwrap_or(f64::NAN),
        decode: rate(&err, "generated:", "tok/s").unwrap_or(f64::NAN),
        peak_rss,
    }
}

/// `mlx_lm generate` (the peer) on `model`: (prefill tok/s, decode tok/s).
pub fn peer_generate(
    python: &std::path::Path,
    model: &std::path::Path,
    prompt: &str,
    tokens: &str,
) -> (f64, f64) {
    let g = peer_run(python, model, prompt, tokens);
    (g.prefill, g.decode)
}

/// `mlx_lm generate` (the peer) on `model`, OpenBLAS preloaded.
pub fn peer_run(
    python: &std::path::Path,
    model: &std::path::Path,
    prompt: &str,
    tokens: &str,
) -> Generation {
    let mut peer = Command::new(python);
    peer.args(["-m", "mlx_lm", "generate", "--model"])
        .arg(model)
        .args(["--prompt", prompt, "-m", tokens, "--ignore-chat-template"]);
    if let Some(lib) = system_openblas() {
        peer.env("LD_PRELOAD", lib);
    }
    let (out, err, peak_rss) = output_with_peak_rss(&mut peer);
    let text = out + &err;
    Generation {
        prefill: rate(&text, "Prompt:", "tokens-per-sec").unwrap_or(f64::NAN),
        decode: rate(&text, "Generation:", "tokens-per-sec").unwrap_or(f64::NAN),
        peak_rss,
    }
}

/// The fixture generator's English corpus, repeated, cut at `chars` characters: a prompt of
/// ordinary text.
pub fn corpus_prompt(chars: usize) -> String {
    let text =
        std::fs::read_to_string(root().join("tests/fixtures/generate.py")).unwrap_or_default();
    let start = text.find("CORPUS = \"\"\"").map(|i| i + 12).unwrap_or(0);
    let end = text[start..]
        .find("\"\"\"")
        .map(|i| start + i)
        .unwrap_or(text.len());
    let corpus = text[start..end].replace('\n', " ");
    corpus.repeat(4).chars().take(chars).collect()
}

/// The bench model quantized by `mlx_lm convert -q` (affine, `bits`, `group`), made once into
/// target/bench-model-q{bits}-g{group}.
pub fn quantized_model(python: &Path, base: &Path, bits: u32, group: u32) -> Option<PathBuf> {
    quantized_model_as(python, base, "affine", bits, group)
}

/// The bench model converted by `mlx_lm convert -q` in MLX's quantization `mode` (`affine`, or a
/// microscaling mode, which fixes its own bits and group), kept under target/ between runs.
pub fn quantized_model_as(
    python: &Path,
    base: &Path,
    mode: &str,
    bits: u32,
    group: u32,
) -> Option<PathBuf> {
    let name = match mode {
        "affine" => format!("q{bits}-g{group}"),
        other => other.to_string(),
    };
    let dir = root().join(format!("target/bench-model-{name}"));
    if !dir.join("config.json").exists() {
        let mut cmd = Command::new(python);
        cmd.args(["-m", "mlx_lm", "convert", "--hf-path"])
            .arg(base)
            .arg("--mlx-path")
            .arg(&dir)
            .args(["-q", "--q-mode", mode]);
        if mode == "affine" {
            cmd.args([
                "--q-bits",
                &bits.to_string(),
                "--q-group-size",
                &group.to_string(),
            ]);
        }
        if !cmd.output().is_ok_and(|o| o.status.success()) {
            eprintln!("mlx_lm convert failed for {name}");
            return None;
        }
    }
    Some(dir)
}

/// Runs `cmd` to completion: (stdout, stderr, the child's peak resident memory in bytes), the
/// last read from `wait4`'s rusage, so each child is measured alone (a measure both sides share).
// The child is reaped by `wait4` (which also reports its rusage), not by `Child::wait`.
#[allow(clippy::zombie_processes)]
pub fn output_with_peak_rss(cmd: &mut Command) -> (String, String, u64) {
    use std::io::Read;
    use std::process::Stdio;
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let mut out = child.stdout.take().unwrap();
    let mut err = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let mut stderr = String::new();
    let _ = err.read_to_string(&mut stderr);
    let stdout = reader.join().unwrap();
    let mut status = 0;
    // SAFETY: rusage is plain data written by the kernel; the pid is our own unwaited child.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    let pid = child.id() as libc::pid_t;
    unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
    (stdout, stderr, usage.ru_maxrss as u64 * 1024)
}

/// A model of real widths with random 4-bit weights (benches/make_real_shape_models.py;
/// `which`: `e2b` or `glm`, `layers` instead of its default), written into `dir` once.
pub fn real_shape_model(
    python: &Path,
    which: &str,
    dir: PathBuf,
    layers: Option<&str>,
) -> Option<PathBuf> {
    if !dir.join("config.json").exists() {
        let ok = Command::new(python)
            .arg(root().join("benches/make_real_shape_models.py"))
            .arg(which)
            .arg(&dir)
            .args(layers)
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            eprintln!("could not write {}", dir.display());
            return None;
        }
    }
    Some(dir)
}
