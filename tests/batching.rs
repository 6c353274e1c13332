//! Continuous batching through the real binary: concurrent requests decode together in one
//! forward pass per step (`--parallel N` rows), and every request gets what it gets alone —
//! the same greedy tokens, logprobs within 1e-4, the same tokens for a seeded sampling
//! request — whatever else shares its batch, for every fixture model, with prompts of mixed
//! lengths (past the sliding window) arriving at different times and prefilled in chunks that
//! share forward passes with other rows' decode steps.

mod common;
use common::*;
use serde_json::{json, Value};
use std::sync::Arc;

/// Prompts of different lengths (some longer than the fixtures' window of 8 tokens).
const PROMPTS: [&str; 8] = [
    "Hi",
    "The quick brown fox jumps over the lazy dog.",
    "One two three four five six seven eight nine ten eleven twelve",
    "a",
    "Hello, world! How are you today, my friend?",
    "Numbers: 1 2 3 4 5",
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor.",
    "zz",
];

fn request(i: usize, logprobs: bool) -> Value {
    // Most rows greedy with logprobs (one fused sampling pass), two rows sampling with their
    // own seeds (the per-slot path), lengths that end at different steps. Logprobs turn
    // drafting off for a request, so drafting runs ask for none.
    let sampled = i % 4 == 3;
    json!({
        "Prompt": PROMPTS[i % PROMPTS.len()],
        "Options": {
            "num_predict": 12 + 3 * (i % 5),
            "temperature": if sampled { 0.9 } else { 0.0 },
            "seed": 1000 + i,
            "top_k": if sampled { 40 } else { 0 },
        },
        "Logprobs": logprobs && !sampled,
        "TopLogprobs": if sampled || !logprobs { 0 } else { 2 },
    })
}

/// `(le, count)` of each bucket of a histogram in the `/metrics` text.
fn histogram(metrics: &str, name: &str) -> Vec<(String, u64)> {
    metrics
        .lines()
        .filter_map(|l| l.strip_prefix(&format!("{name}_bucket{{le=\"")))
        .map(|rest| {
            let (le, n) = rest.split_once("\"} ").unwrap();
            (le.to_string(), n.trim().parse().unwrap())
        })
        .collect()
}

/// Runs the eight requests alone, then concurrently (all at once and staggered), and checks
/// each concurrent result against its solo one; returns the batched runner's `/metrics`.
fn alone_and_together(model: &str, extra: &[&str], logprobs: bool) -> String {
    let n = 8;
    let solo = Runner::start(model, &[&["--parallel", "1"], extra].concat());
    let alone: Vec<(String, Vec<f64>)> = (0..n)
        .map(|i| outcome(&solo.complete(&request(i, logprobs))))
        .collect();
    drop(solo);
    // Small prefill chunks: prompts take several steps, sharing forward passes with other
    // rows' chunks (at most 5 prompt tokens per pass), decode steps and verify blocks.
    let batched = Arc::new(Runner::start(
        model,
        &[&["--parallel", "8", "--prefill-chunk", "5"], extra].concat(),
    ));
    for stagger in [0u64, 15] {
        let handles: Vec<_> = (0..n)
            .map(|i| {
                let r = Arc::clone(&batched);
                std::thread::spawn(move || {
                    std::thread::sleep(std::time::Duration::from_millis(stagger * i as u64));
                    outcome(&r.complete(&request(i, logprobs)))
                })
            })
            .collect();
        for (i, h) in handles.into_iter().enumerate() {
            let (text, lps) = h.join().unwrap();
            assert_eq!(text, alone[i].0, "{model} request {i} (stagger {stagger})");
            assert_eq!(lps.len(), alone[i].1.len(), "{model} request {i}");
            for (a, b) in lps.iter().zip(&alone[i].1) {
                assert!((a - b).abs() < 1e-4, "{model} request {i}: {a} vs {b}");
            }
        }
    }
    let metrics = ureq::get(&batched.url("/metrics"))
        .call()
        .unwrap()
        .into_string()
        .unwrap();
    // They did share forward passes.
    let rows = histogram(&metrics, "mlx_runner_batch_rows");
    let one = rows.iter().find(|(le, _)| le == "1").unwrap().1;
    let all = rows.iter().find(|(le, _)| le == "+Inf").unwrap().1;
    assert!(
        all > one,
        "{model}: no forward pass had two rows\n{metrics}"
    );
    metrics
}

fn counter(metrics: &str, name: &str) -> u64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .map_or(0, |v| v.trim().parse().unwrap())
}

#[test]
fn batched_requests_get_what_they_get_alone() {
    for (model, extra) in [
        ("gemma4_e2b_like", &[][..]),
        ("gemma4_26b_a4b_like", &[][..]),
        ("gemma4_31b_like", &[][..]),
        ("glm4_moe_lite", &["--draft-depth", "0"][..]),
    ] {
        let metrics = alone_and_together(model, extra, true);
        // No forward pass carried more than one chunk of prompt tokens (5) besides one token
        // per decoding row (at most 8): decoding rows never wait behind more.
        let tokens = histogram(&metrics, "mlx_runner_batch_tokens");
        let within = tokens.iter().find(|(le, _)| le == "16").unwrap().1;
        let total = tokens.iter().find(|(le, _)| le == "+Inf").unwrap().1;
        assert_eq!(
            within, total,
            "{model}: a forward pass took more than 13 tokens\n{metrics}"
        );
    }
}

/// Drafting inside the batch: each row drafts at its own depth (the gemma4 assistant, GLM's
/// MTP layer, a separate model), the verify blocks go through the target packed with the
/// other rows' work, and each row accepts and rewinds on its own: greedy rows give exactly
/// their solo tokens, seeded sampling rows (their own depth controllers) theirs.
#[test]
fn drafting_rows_batch_and_stay_exact() {
    let assistant = fixture("gemma4_assistant");
    let separate = fixture("gemma4_31b_like");
    for (model, extra) in [
        (
            "gemma4_e2b_like",
            vec!["--draft", assistant.to_str().unwrap()],
        ),
        ("glm4_moe_lite", vec![]),
        (
            "gemma4_26b_a4b_like",
            vec!["--draft", separate.to_str().unwrap()],
        ),
    ] {
        let metrics = alone_and_together(model, &extra, false);
        assert!(
            counter(&metrics, "mlx_runner_draft_tokens_total") > 0,
            "{model}: nothing was drafted\n{metrics}"
        );
    }
}

/// Two drafting sequences stay in step: a round hands out every token it produced in the same
/// engine turn, so the next rounds of both verify in one forward pass. (Had each token taken a
/// turn of its own, the sequences would drift apart and take turns at the target.) The target
/// drafting for itself accepts every draft, so each round leaves tokens to hand out.
#[test]
fn drafting_sequences_share_their_verify_passes() {
    let model = fixture("gemma4_31b_like");
    let runner = Arc::new(Runner::start(
        "gemma4_31b_like",
        &[
            "--parallel",
            "2",
            "--draft",
            model.to_str().unwrap(),
            "--draft-depth",
            "3",
            "--cache-budget",
            "0",
        ],
    ));
    let handles: Vec<_> = ["one two three", "four five six"]
        .into_iter()
        .map(|prompt| {
            let r = Arc::clone(&runner);
            std::thread::spawn(move || {
                let lines = r.complete(&json!({
                    "Prompt": prompt,
                    "Options": {"num_predict": 40, "temperature": 0.0},
                }));
                lines.last().unwrap()["EvalCount"].as_u64().unwrap()
            })
        })
        .collect();
    for h in handles {
        assert_eq!(h.join().unwrap(), 40);
    }
    let metrics = ureq::get(&runner.url("/metrics"))
        .call()
        .unwrap()
        .into_string()
        .unwrap();
    assert_eq!(
        counter(&metrics, "mlx_runner_draft_accepted_total"),
        counter(&metrics, "mlx_runner_draft_tokens_total"),
        "{metrics}"
    );
    let rows = histogram(&metrics, "mlx_runner_batch_rows");
    let one = rows.iter().find(|(le, _)| le == "1").unwrap().1;
    let two = rows.iter().find(|(le, _)| le == "2").unwrap().1 - one;
    // Each sequence needs about ten rounds of four tokens; apart, that is twenty one-row
    // passes; together, ten of two (and a pass or two alone around the prefill).
    assert!(
        two >= 8 && one <= 4,
        "{one} passes of one row, {two} of two\n{metrics}"
    );
}
