//! Time to first token with media: `cargo bench --bench media`.
//!
//! The runner serves the 4-bit benchmark text model (mlx-lm's conversion of target/bench-model)
//! with gemma4 E2B's vision and audio towers in float32 (random weights;
//! benches/make_media_model.py writes target/bench-media). Through its HTTP API, one token
//! asked each time, timed from the client: a prompt of text alone; with a 640x480 image never
//! seen before; the same conversation again with the same image and a further question (the
//! prefix cache holds the encoded image: no encoder time); with a 10 s clip never heard before.
//! Medians of three runs. Then a row decoding while another request brings a new image: the
//! decoding row's longest wait between tokens while the image is encoded and prefilled, against
//! its wait alone and against one 512-token prompt chunk's time (the goal: slowed by at most one
//! chunk). Then the runner's peak resident memory.
//!
//! The towers' own times against their peers are `cargo bench --bench vision` and `--bench
//! audio`; this one is what a client waits for. Needs .venv-golden (the towers' checkpoints,
//! tests/fixtures/requirements.txt) and .venv-peer (the 4-bit text model: benches/peer-venv.sh).

mod common;

use base64::Engine;
use common::{bench_model, median, peer_python, quantized_model, root, runner, tower_peer};
use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::Command;
use std::time::Instant;

const RUNS: usize = 3;

fn main() {
    let Some((_, vision)) = tower_peer("vision_peer.py", "target/bench-vision") else {
        return;
    };
    let Some((_, audio)) = tower_peer("audio_peer.py", "target/bench-audio") else {
        return;
    };
    let Some(python) = peer_python() else {
        return;
    };
    let Some(text) = bench_model(&python).and_then(|m| quantized_model(&python, &m, 4, 64)) else {
        return;
    };
    let dir = root().join("target/bench-media");
    if !dir.join("model.safetensors").exists() {
        let ok = Command::new(&python)
            .arg(root().join("benches/make_media_model.py"))
            .args([&dir, &text, &vision, &audio])
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "could not write the media benchmark model");
    }
    let (server, port) = runner(&dir, &[]);
    // Warm-up: both towers and the text model have run once before anything is timed.
    ask(
        port,
        "Warm-up. [img-0] and [img-1].",
        &[media(&dir, "image3.png", 0), media(&dir, "clip3.wav", 1)],
    );

    let mut rows: Vec<(&str, Vec<(f64, f64)>)> = Vec::new();
    let mut runs = |label, f: &dyn Fn(usize) -> (f64, f64)| {
        rows.push((label, (0..RUNS).map(f).collect()));
    };
    runs("text alone", &|i| {
        ask(
            port,
            &format!("Request {i} asks about nothing in particular today."),
            &[],
        )
    });
    runs("one 640x480 image, new", &|i| {
        ask(
            port,
            &format!("Request {i}: [img-0] What is in this picture?"),
            &[media(&dir, &format!("image{i}.png"), 0)],
        )
    });
    runs("the same image again", &|i| {
        let prompt =
            format!("Request {i}: [img-0] What is in this picture? It is noise. And its colours?");
        ask(port, &prompt, &[media(&dir, &format!("image{i}.png"), 0)])
    });
    runs("10 s clip, new", &|i| {
        ask(
            port,
            &format!("Request {i}: [img-0] Transcribe this clip."),
            &[media(&dir, &format!("clip{i}.wav"), 0)],
        )
    });

    println!("time to first token, gemma4 E2B towers (float32) + 4-bit benchmark text model, CPU");
    println!("  {:<26} {:>10} {:>14}", "prompt", "client", "prompt eval");
    for (label, times) in rows {
        let client = median(times.iter().map(|t| t.0).collect());
        let eval = median(times.iter().map(|t| t.1).collect());
        println!("  {label:<26} {client:>9.3}s {eval:>13.3}s");
    }
    let b = beside(port, &dir);
    println!("a row decoding while another request brings a new 640x480 image:");
    println!(
        "  its wait between tokens alone (median):        {:.3} s",
        b.alone
    );
    println!(
        "  its longest wait while the image was encoded:  {:.3} s",
        b.longest
    );
    println!(
        "  one 512-token prompt chunk alone:              {:.3} s: slowed by {:.2} chunks",
        b.chunk,
        (b.longest - b.alone) / b.chunk
    );
    println!(
        "  runner's peak resident memory: {:.0} MB",
        peak_rss(server.0.id()) as f64 / 1e6
    );
}

struct Beside {
    alone: f64,
    longest: f64,
    chunk: f64,
}

/// A row decoding 400 tokens; after its 30th, another request brings a new image. The decoding
/// row's waits between tokens before that request and while it runs, and the time of one
/// 512-token chunk of a text prompt alone (~450 tokens timed, scaled).
fn beside(port: u16, dir: &Path) -> Beside {
    let (count, prompt_eval) = {
        let text = common::corpus_prompt(1000);
        let body = json!({"Prompt": text, "Options": {"num_predict": 1, "temperature": 0}});
        let last = common::complete_last(port, &body);
        (
            last["PromptEvalCount"].as_f64().unwrap(),
            last["PromptEvalDuration"].as_f64().unwrap() / 1e9,
        )
    };
    assert!(count <= 512.0, "the chunk prompt is one chunk");
    let (tx, rx) = std::sync::mpsc::channel::<Instant>();
    let decoding = std::thread::spawn(move || {
        let body = json!({"Prompt": "Count slowly, one number a line, from one onwards:",
                          "Options": {"num_predict": 400, "temperature": 0}});
        let resp = ureq::post(&format!("http://127.0.0.1:{port}/v1/completions"))
            .send_string(&body.to_string())
            .unwrap();
        for line in BufReader::new(resp.into_reader()).lines() {
            let _ = tx.send(Instant::now());
            if line.unwrap().contains("\"Done\":true") {
                break;
            }
        }
    });
    let mut tokens = Vec::new();
    while tokens.len() < 30 {
        tokens.push(rx.recv().unwrap());
    }
    let asked = Instant::now();
    ask(
        port,
        "A new picture: [img-0] What is in it?",
        &[media(dir, "image4.png", 0)],
    );
    let answered = Instant::now();
    decoding.join().unwrap();
    tokens.extend(rx.try_iter());
    assert!(
        tokens.last().is_some_and(|&t| t > answered),
        "the decoding row ended before the image's request was answered"
    );
    let gaps = |from: Instant, to: Instant| -> Vec<f64> {
        tokens
            .windows(2)
            .filter(|w| w[1] > from && w[0] < to)
            .map(|w| (w[1] - w[0]).as_secs_f64())
            .collect()
    };
    let before = gaps(tokens[0], asked);
    let during = gaps(asked, answered);
    Beside {
        alone: median(before),
        longest: during.into_iter().fold(0.0, f64::max),
        chunk: prompt_eval * 512.0 / count,
    }
}

/// A media item as the parent sends it: the file's bytes, base64, with its tag's number.
fn media(dir: &Path, name: &str, id: u32) -> Value {
    let bytes = std::fs::read(dir.join(name)).unwrap();
    json!({"data": base64::engine::general_purpose::STANDARD.encode(bytes), "id": id})
}

/// One greedy token for `prompt`: (seconds from sending to the stream's end, the runner's
/// prompt evaluation time in seconds).
fn ask(port: u16, prompt: &str, media: &[Value]) -> (f64, f64) {
    let body =
        json!({"Prompt": prompt, "Media": media, "Options": {"num_predict": 1, "temperature": 0}});
    let start = Instant::now();
    let resp = ureq::post(&format!("http://127.0.0.1:{port}/v1/completions"))
        .send_string(&body.to_string())
        .unwrap();
    let last: Value = BufReader::new(resp.into_reader())
        .lines()
        .map_while(|l| l.ok())
        .filter_map(|l| serde_json::from_str(&l).ok())
        .last()
        .unwrap_or(Value::Null);
    let client = start.elapsed().as_secs_f64();
    assert_eq!(last["Done"], true, "no final chunk: {last}");
    let eval = last["PromptEvalDuration"].as_f64().unwrap_or(f64::NAN) / 1e9;
    (client, eval)
}

/// A process's resident peak (Linux `VmHWM`), in bytes.
fn peak_rss(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}
