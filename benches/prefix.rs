//! The prefix cache: `cargo bench --bench prefix`.
//!
//! (1) Time to first token for a ~2,000-token prompt cold, against the same prompt extended by
//! 16 tokens after a hit, on the gemma4-shaped benchmark model (target/bench-model, written by
//! `cargo bench --bench generate`), reported from the runner's own PromptEvalDuration.
//! (2) Memory the cache holds over 100 random multi-turn conversations, against its budget.
//! (3) Time to first token for the same ~2,000-token prompt after the runner is killed and
//! started again: cold (an empty disk tier), against resumed from the disk tier's blocks;
//! five rounds, medians.

mod common;
use common::{root, runner};

use serde_json::{json, Value};
use std::io::{BufRead, BufReader};

/// The final chunk of a greedy completion.
fn complete(port: u16, prompt: &str, n: usize) -> Value {
    let body = json!({"Prompt": prompt, "Options": {"num_predict": n, "temperature": 0}});
    let resp = ureq::post(&format!("http://127.0.0.1:{port}/v1/completions"))
        .send_string(&body.to_string())
        .unwrap();
    let mut last = Value::Null;
    let mut text = String::new();
    for line in BufReader::new(resp.into_reader()).lines() {
        last = serde_json::from_str(&line.unwrap()).unwrap();
        text.push_str(last["Content"].as_str().unwrap_or(""));
    }
    last["Text"] = Value::String(text);
    last
}

fn metric(port: u16, name: &str) -> f64 {
    let m = ureq::get(&format!("http://127.0.0.1:{port}/metrics"))
        .call()
        .unwrap()
        .into_string()
        .unwrap();
    m.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or(f64::NAN)
}

fn main() {
    let model = root().join("target/bench-model");
    if !model.join("model.safetensors").exists() {
        eprintln!("run `cargo bench --bench generate` first (it writes target/bench-model)");
        return;
    }
    // (1) A ~2,000-token prompt (the fixture tokenizer spends ~0.45 tokens per character).
    let (_s, port) = runner(&model, &[]);
    let words = [
        "alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet",
    ];
    let mut prompt = String::new();
    let mut i = 0;
    loop {
        prompt.push_str(words[i % words.len()]);
        prompt.push(' ');
        i += 1;
        if i % 50 == 0 {
            let n: Vec<u32> = serde_json::from_str(
                &ureq::post(&format!("http://127.0.0.1:{port}/v1/tokenize"))
                    .send_string(&prompt)
                    .unwrap()
                    .into_string()
                    .unwrap(),
            )
            .unwrap();
            if n.len() >= 2000 {
                break;
            }
        }
    }
    let cold = complete(port, &prompt, 1);
    let extended =
        format!("{prompt}and sixteen more tokens to extend this prompt a little further");
    let hit = complete(port, &extended, 1);
    let (ct, ht) = (
        cold["PromptEvalDuration"].as_f64().unwrap() / 1e6,
        hit["PromptEvalDuration"].as_f64().unwrap() / 1e6,
    );
    println!("## Time to first token, ~120M gemma4-shaped model\n");
    println!("| | prompt tokens | cached | TTFT |");
    println!("|---|---|---|---|");
    println!(
        "| cold | {} | {} | {ct:.0} ms |",
        cold["PromptEvalCount"], cold["CachedTokens"]
    );
    println!(
        "| extended, after a hit | {} | {} | {ht:.0} ms |",
        hit["PromptEvalCount"], hit["CachedTokens"]
    );
    println!("\nhit / cold: {:.3}", ht / ct);
    drop(_s);
    restart(&model, &prompt);

    // (2) 100 random conversations, three turns each, under a 16 MiB budget.
    let budget = 16u64 << 20;
    let (_s, port) = runner(&model, &["--cache-budget", &budget.to_string()]);
    let mut rng = 0x2545_F491_4F6C_DD1Du64;
    let mut next = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let (mut peak, mut hits) = (0.0f64, 0);
    for c in 0..100 {
        let mut p = format!("Conversation {c}: ");
        for _ in 0..(5 + next() % 20) {
            p.push_str(words[(next() % 10) as usize]);
            p.push(' ');
        }
        for turn in 0..3 {
            let d = complete(port, &p, 4);
            if d["CachedTokens"].as_u64().unwrap_or(0) > 0 {
                hits += 1;
            }
            p = format!("{p}{} turn {turn} ", d["Text"].as_str().unwrap_or(""));
        }
        peak = peak.max(metric(port, "mlx_runner_prefix_cache_bytes"));
    }
    println!(
        "\n## 100 random conversations (3 turns each), budget {:.1} MiB\n",
        budget as f64 / 1048576.0
    );
    println!(
        "peak cache memory {:.2} MiB ({:.0}% of the budget); {hits} of 300 requests hit (first turns share \"Conversation\")",
        peak / 1048576.0,
        peak / budget as f64 * 100.0
    );
}

/// (3): the disk tier across a restart.
fn restart(model: &std::path::Path, prompt: &str) {
    let (mut cold, mut resumed, mut cached, mut held) = (Vec::new(), Vec::new(), 0, 0u64);
    let (mut cold_wall, mut resumed_wall) = (Vec::new(), Vec::new());
    for _ in 0..5 {
        let dir = tempfile::tempdir().unwrap();
        let args = ["--cache-dir", dir.path().to_str().unwrap()];
        let (s, port) = runner(model, &args);
        let t = std::time::Instant::now();
        let c = complete(port, prompt, 1);
        cold_wall.push(t.elapsed().as_secs_f64() * 1e3);
        // The blocks are written after the answer; wait for the writer to finish.
        let mut last = -1.0;
        loop {
            std::thread::sleep(std::time::Duration::from_millis(200));
            let w = metric(port, "mlx_runner_prefix_disk_written_total");
            if w == last && w > 0.0 {
                break;
            }
            last = w;
        }
        held = metric(port, "mlx_runner_prefix_disk_bytes") as u64;
        drop(s);
        let (_s, port) = runner(model, &args);
        let t = std::time::Instant::now();
        let r = complete(port, prompt, 1);
        resumed_wall.push(t.elapsed().as_secs_f64() * 1e3);
        assert_eq!(
            r["Text"], c["Text"],
            "a resumed runner answers as a cold one"
        );
        cached = r["CachedTokens"].as_u64().unwrap();
        cold.push(c["PromptEvalDuration"].as_f64().unwrap() / 1e6);
        resumed.push(r["PromptEvalDuration"].as_f64().unwrap() / 1e6);
    }
    let (c, r) = (common::median(cold), common::median(resumed));
    let (cw, rw) = (common::median(cold_wall), common::median(resumed_wall));
    println!("\n## Time to first token across a restart (disk tier), medians of 5\n");
    println!("| | cached | PromptEvalDuration | request to first token (client) |");
    println!("|---|---|---|---|");
    println!("| cold runner, empty disk tier | 0 | {c:.0} ms | {cw:.0} ms |");
    println!("| restarted runner, same prompt | {cached} | {r:.0} ms | {rw:.0} ms |");
    println!(
        "\nresumed / cold: {:.3} (client: {:.3}, reading and checking the blocks included); \
         the disk tier held {:.1} MiB of blocks",
        r / c,
        rw / cw,
        held as f64 / 1048576.0
    );
}
