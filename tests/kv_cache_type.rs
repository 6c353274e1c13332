//! `--kv-cache-type` through the real binary, for every cache kind (gemma4's sliding window,
//! full and KV-shared layers with the assistant drafter; GLM's MLA latents with its MTP layer):
//! a cache of float16 or bfloat16 halves what a cached token costs and q8 / q4 cut it further,
//! drafting gives exactly the undrafted output over it (rejected drafts rewind it exactly), the
//! prefix cache restores it exactly, and its logprobs stay near a float32 cache's (the drift is
//! reported). The fixtures' rows are narrow: gemma4's full-attention heads (32 wide) quantize
//! in groups of 32; its sliding heads (16) and GLM's latent rows (40) fit no MLX group and are
//! stored as float16 (the cache crate's tests cover quantized latents and windows).

mod common;
use common::turn::{ask_with, same};
use common::*;

/// A prompt past the fixtures' sliding window (8), so that rings wrap.
const PROMPT: &str =
    "The lantern by the river glowed copper while the meadow slept under a violet \
                      sky, and the harbor bells rang twice for the travellers";

fn models() -> Vec<(&'static str, Vec<String>)> {
    let assistant = fixture("gemma4_assistant").to_str().unwrap().to_string();
    vec![
        ("gemma4_e2b_like", vec!["--draft".into(), assistant]),
        ("glm4_moe_lite", vec![]),
    ]
}

fn start(model: &str, extra: &[String], more: &[&str]) -> Runner {
    let mut args: Vec<&str> = extra.iter().map(String::as_str).collect();
    args.extend_from_slice(more);
    Runner::start(model, &args)
}

/// The bytes of KV cache the memory plan counts for one sequence at 512 tokens, from its log.
fn kv_bytes(model: &str, extra: &[String], kind: &str) -> f64 {
    let r = start(
        model,
        extra,
        &[
            "--kv-cache-type",
            kind,
            "--parallel",
            "1",
            "--ctx-size",
            "512",
        ],
    );
    let (_, err) = r.terminate();
    let line = err
        .lines()
        .find(|l| l.contains("memory plan"))
        .unwrap_or_else(|| panic!("no memory plan logged: {err}"));
    // `kv_cache=512.0 KiB prefix_cache_budget=...`
    let v = &line[line.find("kv_cache=").unwrap() + "kv_cache=".len()..];
    let mut words = v.split_whitespace();
    let (n, unit) = (words.next().unwrap(), words.next().unwrap());
    let scale = match unit {
        "B" => 1.0,
        "KiB" => 1024.0,
        "MiB" => 1048576.0,
        u => panic!("unit {u}"),
    };
    n.trim().parse::<f64>().unwrap() * scale
}

#[test]
fn half_precision_caches_halve_a_tokens_bytes() {
    for (model, extra) in models() {
        let f32 = kv_bytes(model, &extra, "f32");
        for kind in ["f16", "bf16"] {
            let half = kv_bytes(model, &extra, kind);
            assert!(
                (half * 2.0 - f32).abs() <= f32 * 0.01,
                "{model} {kind}: {half} bytes against float32's {f32}"
            );
        }
    }
}

#[test]
fn quantized_caches_cost_less_than_half_precision_ones() {
    for (model, extra) in models() {
        let f16 = kv_bytes(model, &extra, "f16");
        let q8 = kv_bytes(model, &extra, "q8");
        let q4 = kv_bytes(model, &extra, "q4");
        eprintln!("{model}: bytes of KV cache at 512 tokens: f16 {f16}, q8 {q8}, q4 {q4}");
        if model.starts_with("gemma4") {
            assert!(
                q8 < f16 * 0.9 && q4 < q8,
                "{model}: f16 {f16}, q8 {q8}, q4 {q4}"
            );
        } else {
            // Latent rows of 40 values fit no group: stored as float16.
            assert_eq!(q8, f16, "{model}");
            assert_eq!(q4, f16, "{model}");
        }
    }
}

#[test]
fn drafting_and_the_prefix_cache_are_exact_over_every_cache_type() {
    for (model, extra) in models() {
        let reference = start(model, &extra, &["--kv-cache-type", "f32"]);
        let want = ask_with(&reference, PROMPT, 24, true);
        drop(reference);
        for kind in ["f16", "bf16", "q8", "q4"] {
            let what = format!("{model} {kind}");
            // Without drafting (logprobs on), then drafting (logprobs off), then the same
            // prompt again from the prefix cache.
            let undrafted = start(
                model,
                &extra,
                &["--kv-cache-type", kind, "--draft-depth", "0"],
            );
            let plain = ask_with(&undrafted, PROMPT, 24, false);
            drop(undrafted);
            let r = start(model, &extra, &["--kv-cache-type", kind]);
            let drafted = ask_with(&r, PROMPT, 24, false);
            assert_eq!(
                drafted.text, plain.text,
                "{what}: drafting changed the output"
            );
            assert!(drafted.draft_tokens > 0, "{what}: nothing was drafted");
            assert_eq!(plain.draft_tokens, 0, "{what}");
            let cold = ask_with(&r, &format!("{PROMPT} again"), 24, true);
            let warm = ask_with(&r, &format!("{PROMPT} again"), 24, true);
            assert!(warm.cached > 0, "{what}: no prefix-cache hit");
            same(
                &warm,
                &cold,
                &format!("{what}: restored from the prefix cache"),
            );
            // Near float32's: the first token's logprob (the same context for both), reported
            // with how many tokens agree before the first that differs.
            let got = ask_with(&r, PROMPT, 24, true);
            let drift = (got.logprobs[0] - want.logprobs[0]).abs();
            let agree = got
                .text
                .chars()
                .zip(want.text.chars())
                .take_while(|(a, b)| a == b)
                .count();
            eprintln!(
                "{what}: first-token logprob drift against a float32 cache {drift:.2e}; \
                 {agree} of {} characters agree",
                want.text.chars().count()
            );
            // 4 bits over groups of 32 (the fixtures' narrow heads) move a tiny random model's
            // sharp logits by tenths (q8 by hundredths); a misread cache moves them by units.
            let bound = if kind == "q4" { 0.6 } else { 0.05 };
            assert!(
                drift < bound,
                "{what}: logprob drift {drift} from float32's"
            );
        }
    }
}

#[test]
fn an_unknown_cache_type_is_refused_in_one_line() {
    let out = binary()
        .args(["runner", "--model"])
        .arg(fixture("gemma4_e2b_like"))
        .args(["--port", &free_port().to_string(), "--kv-cache-type", "q3"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("unknown KV cache type \"q3\" (expected auto, f32, f16, bf16, q8 or q4)"),
        "{err}"
    );
}
