//! The HTTP runner over a model split between ranks (MLX's ring backend over loopback): rank 0
//! serves and samples, the ranks it starts replay its forward passes.

mod common;
use common::cluster::{local, none_left, processes, ring_port, signal};
use common::serve::Serve;
use common::turn::{ask_with, metric, same, Turn};
use common::{outcome, wait_timeout, Runner};

use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

fn split_runner(model: &str, ranks: usize, hosts: &Path, extra: &[&str]) -> Runner {
    let port = ring_port(ranks as u16).to_string();
    let mut args = vec![
        "--hostfile",
        hosts.to_str().unwrap(),
        "--ring-port",
        port.as_str(),
    ];
    args.extend(extra);
    Runner::start(model, &args)
}

/// Each request's text and logprobs, one request at a time.
fn one_by_one(r: &Runner, requests: &[Value]) -> Vec<(String, Vec<f64>)> {
    requests.iter().map(|b| outcome(&r.complete(b))).collect()
}

/// Each request's text and logprobs, all sent at once (batched by the runner).
fn all_at_once(r: &Arc<Runner>, requests: &[Value]) -> Vec<(String, Vec<f64>)> {
    let handles: Vec<_> = requests
        .iter()
        .cloned()
        .map(|b| {
            let r = Arc::clone(r);
            std::thread::spawn(move || outcome(&r.complete(&b)))
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// The same text and logprobs within 1e-4.
fn close(got: &(String, Vec<f64>), want: &(String, Vec<f64>), what: &str) {
    assert_eq!(got.0, want.0, "{what}");
    assert_eq!(got.1.len(), want.1.len(), "{what}");
    for (a, b) in got.1.iter().zip(&want.1) {
        assert!((a - b).abs() < 1e-4, "{what}: {a} vs {b}");
    }
}

fn request(prompt: &str) -> Value {
    json!({
        "Prompt": prompt,
        "Options": {"num_predict": 16, "temperature": 0},
        "Logprobs": true,
        "TopLogprobs": 2,
    })
}

/// A request's text and logprobs.
type Answer = (String, Vec<f64>);

/// Three requests, greedy with logprobs.
fn three_requests() -> Vec<Value> {
    [
        "The quick brown fox",
        "Once upon a time, in a land far away",
        "1, 2, 3, 4,",
    ]
    .iter()
    .map(|p| request(p))
    .collect()
}

/// One process's answers to `requests` one at a time (with `same`), and `model` split over
/// `ranks` with `same` and `split` (its hostfile's folder goes with it).
fn beside_one_process(
    model: &str,
    ranks: usize,
    same: &[&str],
    split: &[&str],
    requests: &[Value],
) -> (Vec<Answer>, Arc<Runner>, tempfile::TempDir) {
    let solo = Runner::start(model, &[same, &["--parallel", "1"]].concat());
    let alone = one_by_one(&solo, requests);
    drop(solo);
    let (d, hosts) = local(ranks);
    let runner = split_runner(model, ranks, &hosts, &[same, split].concat());
    (alone, Arc::new(runner), d)
}

/// One at a time, a split model answers with the same bits as one process; several at once
/// (batched into packed passes the other ranks replay, sequences starting and ending between
/// them), the same text and logprobs within 1e-4.
#[test]
fn a_split_model_serves_what_one_process_serves() {
    let requests = three_requests();
    for (model, ranks) in [
        ("glm4_moe_lite", 2),
        ("gemma4_31b_like", 3),
        ("gemma4_e2b_like", 2),
        ("gemma4_26b_a4b_like_q4", 2),
    ] {
        // Both keep a prefix cache: they restore alike (a restored prefix changes how the
        // prompt is chunked, and so the last bits).
        let same = ["--prefill-chunk", "8", "--no-draft"];
        let (alone, split, _d) =
            beside_one_process(model, ranks, &same, &["--parallel", "4"], &requests);
        for (i, b) in requests.iter().enumerate() {
            assert_eq!(
                outcome(&split.complete(b)),
                alone[i],
                "{model}: request {i}"
            );
        }
        for (i, got) in all_at_once(&split, &requests).iter().enumerate() {
            close(got, &alone[i], &format!("{model}: request {i} together"));
        }
        let split = Arc::try_unwrap(split).ok().unwrap();
        let (status, err) = split.terminate();
        assert!(status.success(), "{err}");
        assert!(err.contains("split model"), "{err}");
    }
}

/// In micro-batches (every pass of 2 tokens or more cut into one per rank), rank 0 computes
/// the next micro-batch before taking the previous one's final hidden states back: one request
/// at a time (its prompt's chunks cut inside the row) and several at once (their rows shared
/// out among the micro-batches, a decode step's included), the same text and logprobs within
/// 1e-4 as one process; an image's tokens stay in one micro-batch.
#[test]
fn micro_batches_serve_what_one_process_serves() {
    let requests = three_requests();
    for (model, ranks) in [("glm4_moe_lite", 2), ("gemma4_31b_like", 3)] {
        let same = ["--prefill-chunk", "8", "--no-draft", "--cache-budget", "0"];
        let micro = ["--parallel", "4", "--micro-batch-tokens", "2"];
        let (alone, split, _d) = beside_one_process(model, ranks, &same, &micro, &requests);
        for (i, b) in requests.iter().enumerate() {
            let what = format!("{model}: request {i} in micro-batches");
            close(&outcome(&split.complete(b)), &alone[i], &what);
        }
        for (i, got) in all_at_once(&split, &requests).iter().enumerate() {
            let what = format!("{model}: request {i} together in micro-batches");
            close(got, &alone[i], &what);
        }
    }
    use base64::Engine;
    let model = "gemma4_vision_like";
    let image = std::fs::read(common::fixture(model).join("images").join("wide.png")).unwrap();
    let body = json!({
        "Prompt": "Describe [img-0] now.",
        "Media": [{"data": base64::engine::general_purpose::STANDARD.encode(image), "id": 0}],
        "Options": {"num_predict": 8, "temperature": 0, "repeat_penalty": 1.0},
        "Logprobs": true,
    });
    let solo = Runner::start(model, &["--no-draft", "--cache-budget", "0"]);
    let want = outcome(&solo.complete(&body));
    drop(solo);
    let (_d, hosts) = local(2);
    let micro = [
        "--no-draft",
        "--cache-budget",
        "0",
        "--micro-batch-tokens",
        "2",
    ];
    let split = split_runner(model, 2, &hosts, &micro);
    close(
        &outcome(&split.complete(&body)),
        &want,
        "an image in micro-batches",
    );
}

/// A rank killed mid-stream: the stream ends with an in-stream error, rank 0 exits non-zero
/// (its parent starts it again) and no rank is left running. Rank 0 is held still while the
/// rank dies, so the kill lands mid-stream however fast the model is.
#[test]
fn a_lost_rank_ends_the_stream_with_an_error_and_the_runner_non_zero() {
    for mode in ["pipeline", "tensor"] {
        lose_a_rank(mode);
    }
}

fn lose_a_rank(mode: &str) {
    let (_d, hosts) = local(2);
    let mut split = split_runner(
        "gemma4_31b_like",
        2,
        &hosts,
        &["--no-draft", "--parallel-mode", mode],
    );
    let workers = processes(&hosts, " worker ");
    assert_eq!(workers.len(), 1, "{workers:?}");
    let body = json!({"Prompt": "hello", "Options": {"num_predict": 400, "temperature": 0}});
    let resp = ureq::post(&split.url("/v1/completions"))
        .send_string(&body.to_string())
        .unwrap();
    let mut lines = BufReader::new(resp.into_reader()).lines();
    let first = lines.next().unwrap().unwrap();
    assert!(first.contains("Content"), "{first}");
    let rank0 = split.child.id();
    signal(rank0, libc::SIGSTOP);
    signal(workers[0], libc::SIGKILL);
    std::thread::sleep(Duration::from_millis(100));
    signal(rank0, libc::SIGCONT);
    let rest: Vec<String> = lines.map_while(Result::ok).collect();
    let last = rest.last().cloned().unwrap_or_default();
    assert!(
        last.contains("\"Error\"") && last.contains("ranks failed"),
        "{last}"
    );
    let status = wait_timeout(&mut split.child, Duration::from_secs(20))
        .expect("rank 0 still running after losing a rank");
    assert!(!status.success());
    assert!(processes(&hosts, " worker ").is_empty());
}

/// `serve --hostfile`: the runners it starts split their models over the ranks, answer as one
/// process does, and `/api/ps` says over how many.
#[test]
fn serve_splits_its_models_over_the_hostfile_ranks() {
    let (_d, hosts) = local(2);
    let body = json!({
        "model": "gem",
        "prompt": "The quick brown fox",
        "raw": true,
        "stream": false,
        "options": {"num_predict": 12, "temperature": 0},
    });
    let plain = Serve::start(&[]);
    let (code, alone) = plain.post("/api/generate", &body);
    assert_eq!(code, 200, "{alone}");
    drop(plain);
    for mode in ["pipeline", "tensor"] {
        let split = Serve::start(&[
            ("MLX_RUNNER_HOSTFILE", hosts.to_str().unwrap()),
            ("MLX_RUNNER_PARALLEL_MODE", mode),
        ]);
        let (code, answer) = split.post("/api/generate", &body);
        assert_eq!(code, 200, "{answer}");
        assert_eq!(answer["response"], alone["response"], "{mode}");
        let ps = split.get("/api/ps");
        assert_eq!(ps["models"][0]["ranks"], 2, "{ps}");
        assert_eq!(processes(&hosts, " worker ").len(), 1);
        // Rank 0 (the runner serve started) names the mode; its workers follow its command.
        let runners = processes(&hosts, " runner ");
        assert_eq!(runners.len(), 1, "{runners:?}");
        let cmdline = std::fs::read(format!("/proc/{}/cmdline", runners[0])).unwrap();
        let args: Vec<&[u8]> = cmdline.split(|&b| b == 0).collect();
        let at = args.iter().position(|a| *a == b"--parallel-mode");
        assert_eq!(at.map(|i| args[i + 1]), Some(mode.as_bytes()), "{mode}");
        drop(split);
        none_left(&hosts);
    }
    let out = common::binary()
        .arg("serve")
        .env("MLX_RUNNER_HOSTFILE", &hosts)
        .env("MLX_RUNNER_PARALLEL_MODE", "sideways")
        .env(
            "MLX_RUNNER_HOST",
            format!("127.0.0.1:{}", common::free_port()),
        )
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("MLX_RUNNER_PARALLEL_MODE must be pipeline or tensor"),
        "{err}"
    );
}

/// Drafting on a split model: rank 0's drafter (GLM's MTP layer, prompt lookup) proposes, the
/// verify blocks go through the split target, and the other ranks rewind where rank 0 rejected
/// drafts: greedy output is the output without drafting, alone and batched. A grammar holds
/// there too (rank 0 masks and samples).
#[test]
fn a_split_model_drafts_and_keeps_to_a_grammar() {
    let prompt = "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3";
    let body = json!({
        "Prompt": prompt,
        "Options": {"num_predict": 48, "temperature": 0},
    });
    for (model, draft) in [
        ("glm4_moe_lite", &[][..]),
        ("gemma4_31b_like", &["--draft", "ngram"][..]),
    ] {
        let solo = Runner::start(model, &["--no-draft", "--cache-budget", "0"]);
        let want = common::text_of(&solo.complete(&body));
        drop(solo);
        let (_d, hosts) = local(2);
        let split = Arc::new(split_runner(
            model,
            2,
            &hosts,
            &[draft, &["--parallel", "2"]].concat(),
        ));
        let lines = split.complete(&body);
        assert_eq!(common::text_of(&lines), want, "{model}");
        let done = common::done_of(&lines);
        assert!(done["DraftTokens"].as_u64().unwrap() > 0, "{model}: {done}");
        let handles: Vec<_> = (0..2)
            .map(|_| {
                let (r, b) = (Arc::clone(&split), body.clone());
                std::thread::spawn(move || common::text_of(&r.complete(&b)))
            })
            .collect();
        for h in handles {
            assert_eq!(h.join().unwrap(), want, "{model} batched");
        }
    }
    let (_d, hosts) = local(2);
    let split = split_runner("glm4_moe_lite", 2, &hosts, &[]);
    keeps_to_a_grammar(&split);
}

/// A model split by tensors serves what one process serves (the same text, logprobs within
/// 1e-4: the ranks sum the output projections in another order), one request at a time and
/// several batched, with drafting on (GLM's MTP layer on rank 0, prompt lookup) and the
/// logprobs coming from the verify passes; a grammar holds.
#[test]
fn a_model_split_by_tensors_batches_drafts_and_keeps_to_a_grammar() {
    let prompts = [
        "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3",
        "Once upon a time, in a land far away",
        "The quick brown fox",
    ];
    let requests: Vec<Value> = prompts.iter().map(|p| request(p)).collect();
    for (model, ranks, draft) in [
        ("glm4_moe_lite", 2, &[][..]),
        ("gemma4_31b_like", 3, &["--draft", "ngram"][..]),
        ("gemma4_26b_a4b_like_q4", 2, &["--draft", "ngram"][..]),
    ] {
        let solo = Runner::start(model, &["--no-draft", "--cache-budget", "0"]);
        let alone = one_by_one(&solo, &requests);
        drop(solo);
        let (_d, hosts) = local(ranks);
        let split = Arc::new(split_runner(
            model,
            ranks,
            &hosts,
            &[draft, &["--parallel", "4", "--parallel-mode", "tensor"]].concat(),
        ));
        let lines = split.complete(&requests[0]);
        let done = common::done_of(&lines);
        assert!(done["DraftTokens"].as_u64().unwrap() > 0, "{model}: {done}");
        close(&outcome(&lines), &alone[0], &format!("{model}: request 0"));
        for (i, b) in requests.iter().enumerate().skip(1) {
            close(
                &outcome(&split.complete(b)),
                &alone[i],
                &format!("{model}: request {i}"),
            );
        }
        for (i, got) in all_at_once(&split, &requests).iter().enumerate() {
            close(got, &alone[i], &format!("{model}: request {i} together"));
        }
    }
    let (_d, hosts) = local(3);
    let split = split_runner("glm4_moe_lite", 3, &hosts, &["--parallel-mode", "tensor"]);
    keeps_to_a_grammar(&split);
}

/// Images and audio on a split model: rank 0 runs the towers and sends the soft tokens with
/// the pass that places them; the ranks that embed (every rank split by tensors; every stage of
/// a model with per-layer inputs) splice them in. The answer is one process's, by layers and by
/// tensors.
#[test]
fn a_split_model_sees_images_and_hears_audio() {
    use base64::Engine;
    let media = |model: &str, items: &[(&str, i64)]| -> Value {
        items
            .iter()
            .map(|&(name, id)| {
                let dir = if name.ends_with(".png") && model == "gemma4_vision_like" {
                    "images"
                } else {
                    "audio"
                };
                let bytes = std::fs::read(common::fixture(model).join(dir).join(name)).unwrap();
                json!({"data": base64::engine::general_purpose::STANDARD.encode(bytes), "id": id})
            })
            .collect()
    };
    for (model, prompt, items) in [
        (
            "gemma4_vision_like",
            "Describe [img-0] and [img-1] now.",
            &[("wide.png", 0), ("small.png", 1)][..],
        ),
        (
            "gemma4_audio_like",
            "Hear [img-0] and see [img-1] now.",
            &[("speechlike.wav", 0), ("wide.png", 1)][..],
        ),
    ] {
        let body = json!({
            "Prompt": prompt,
            "Media": media(model, items),
            "Options": {"num_predict": 12, "temperature": 0, "repeat_penalty": 1.0},
            "Logprobs": true,
        });
        let solo = Runner::start(model, &["--no-draft", "--cache-budget", "0"]);
        let want = outcome(&solo.complete(&body));
        drop(solo);
        for mode in ["pipeline", "tensor"] {
            let (_d, hosts) = local(2);
            let split = split_runner(model, 2, &hosts, &["--no-draft", "--parallel-mode", mode]);
            close(
                &outcome(&split.complete(&body)),
                &want,
                &format!("{model} by {mode}"),
            );
        }
    }
}

/// A sampled answer constrained by a JSON schema (rank 0 masks and samples) is that JSON.
fn keeps_to_a_grammar(split: &Runner) {
    let schema = json!({
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["n"],
    });
    let lines = split.complete(&json!({
        "Prompt": "A number:",
        "Format": schema,
        "Options": {"num_predict": 32, "temperature": 0.8, "seed": 3},
    }));
    let text = common::text_of(&lines);
    let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text}: {e}"));
    assert!(v["n"].as_u64().is_some_and(|n| n <= 99), "{text}");
}

/// The gemma4 assistant on a split model, its layers split with the target's: by tensors each
/// rank holds its share of every layer (its query heads read that rank's heads of the store
/// layers' caches); by layers the stage holding a store layer runs the assistant's layers that
/// read it. Rank 0 runs the rest and leads each draft pass. Greedy answers are one process's
/// with the same drafter, one request at a time and several batched, the logprobs (from the
/// verify passes) within 1e-4. Seeded sampling answers are one process's too, and the split
/// drafts and accepts as many tokens as one process: a draft's acceptance and the tokens
/// sampled after a rejection depend on the draft and its probability, so this holds only where
/// the split assistant drafts what the whole one does. A split its heads do not allow is a
/// one-line refusal at start, no rank left running.
#[test]
fn the_assistant_drafts_on_a_split_model() {
    let assistant = common::fixture("gemma4_assistant");
    let draft = ["--draft", assistant.to_str().unwrap(), "--draft-depth", "3"];
    let prompts = [
        "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3",
        "Once upon a time, in a land far away",
        "The quick brown fox",
    ];
    let greedy: Vec<Value> = prompts.iter().map(|p| request(p)).collect();
    let sampled: Vec<Value> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            json!({
                "Prompt": p,
                "Options": {"num_predict": 24, "temperature": 1.0, "seed": 11 + i},
            })
        })
        .collect();
    let texts = |r: &Runner| -> Vec<String> {
        sampled
            .iter()
            .map(|b| common::text_of(&r.complete(b)))
            .collect()
    };
    let counts = |r: &Runner| {
        (
            metric(r, "mlx_runner_draft_tokens_total"),
            metric(r, "mlx_runner_draft_accepted_total"),
        )
    };
    let solo = Runner::start(
        "gemma4_e2b_like",
        &[&draft[..], &["--cache-budget", "0"]].concat(),
    );
    let alone = one_by_one(&solo, &greedy);
    let alone_sampled = texts(&solo);
    let solo_counts = counts(&solo);
    drop(solo);
    assert!(solo_counts.1 > 0.0, "one process accepted no draft");
    // By layers, the KV-shared layers stay with the layers whose caches they read: E2B-like
    // splits in two only after its first layer, and rank 1 runs every assistant layer.
    for (ranks, mode) in [(2, "tensor"), (2, "pipeline")] {
        let what = format!("{ranks} ranks by {mode}");
        let (_d, hosts) = local(ranks);
        let split = Arc::new(split_runner(
            "gemma4_e2b_like",
            ranks,
            &hosts,
            &[
                &draft[..],
                &[
                    "--parallel",
                    "4",
                    "--parallel-mode",
                    mode,
                    "--cache-budget",
                    "0",
                ],
            ]
            .concat(),
        ));
        for (i, b) in greedy.iter().enumerate() {
            let lines = split.complete(b);
            let done = common::done_of(&lines);
            assert!(done["DraftTokens"].as_u64().unwrap() > 0, "{what}: {done}");
            close(&outcome(&lines), &alone[i], &format!("{what}: request {i}"));
        }
        assert_eq!(texts(&split), alone_sampled, "{what}: seeded sampling");
        assert_eq!(counts(&split), solo_counts, "{what}: (drafted, accepted)");
        for (i, got) in all_at_once(&split, &greedy).iter().enumerate() {
            close(got, &alone[i], &format!("{what}: request {i} together"));
        }
        drop(split);
        none_left(&hosts);
    }

    // The assistant's two query heads read one K/V head: three ranks by tensors cannot share
    // them, which the ranks find loading their shares.
    let (_d, hosts) = local(3);
    let out = common::binary()
        .args(["runner", "--model"])
        .arg(common::fixture("gemma4_e2b_like"))
        .args(draft)
        .args(["--port", &common::free_port().to_string()])
        .args(["--ring-port", &ring_port(3).to_string(), "--hostfile"])
        .arg(&hosts)
        .args(["--parallel-mode", "tensor"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    let last = err.lines().last().unwrap_or_default();
    assert!(
        last.starts_with("error: loading the drafter: rank 0: ")
            && last.contains("cannot split 2 query heads"),
        "{err}"
    );
    none_left(&hosts);
}

/// Two conversations (each turn's prompt extends its last prompt and answer), taking turns
/// in `order` (0: the first, 1: the second): what each turn answered.
fn conversations(r: &Runner, order: &[usize], logprobs: bool) -> Vec<Turn> {
    let mut prompts = [
        String::from("You are a helpful assistant. Tell me a story about a fox."),
        String::from("Conversation B: a completely different topic, numbers 1 2 3 4 5 6"),
    ];
    let mut out = Vec::new();
    for (turn, &c) in order.iter().enumerate() {
        let p = &mut prompts[c];
        let t = ask_with(r, p, 8, logprobs);
        *p = format!("{p}{} Please go on, turn {turn}.", t.text);
        out.push(t);
    }
    out
}

/// The prefix cache on a split model runs in lockstep: every rank restores where rank 0 does,
/// so turns restore as much as one process with the same cache restores and answer the same
/// (by layers with sliding-window layers on some stages only, by tensors with MLA's latent
/// cache and GLM's drafter, by tensors with KV-shared layers); with a budget that evicts,
/// every rank evicts what rank 0 evicts (no restore is refused) and answers stay exact.
#[test]
fn a_split_model_reuses_its_prefix_cache() {
    let order = [0, 0, 1, 1, 0, 1, 0];
    for (model, ranks, mode, logprobs) in [
        ("gemma4_31b_like", 3, "pipeline", true),
        ("glm4_moe_lite", 2, "tensor", false),
        ("gemma4_e2b_like", 2, "tensor", true),
    ] {
        let same_flags = ["--prefill-chunk", "8", "--parallel", "1"];
        let solo = Runner::start(model, &same_flags);
        let alone = conversations(&solo, &order, logprobs);
        drop(solo);
        let (_d, hosts) = local(ranks);
        let mode_flags = ["--parallel-mode", mode];
        let split = split_runner(
            model,
            ranks,
            &hosts,
            &[&same_flags[..], &mode_flags].concat(),
        );
        let got = conversations(&split, &order, logprobs);
        for (i, (g, a)) in got.iter().zip(&alone).enumerate() {
            let what = format!("{model} over {ranks} by {mode}: turn {i}");
            same(g, a, &what);
            assert_eq!(g.cached, a.cached, "{what}: tokens restored");
        }
        let hits = got.iter().filter(|t| t.cached > 0).count();
        assert!(hits >= 5, "{model}: {hits} turns restored");
        let held = metric(&split, "mlx_runner_prefix_cache_bytes");
        let (status, err) = split.terminate();
        assert!(status.success(), "{err}");
        assert!(!err.contains("could not restore"), "{model}: {err}");
        assert!(!err.contains("out of step"), "{model}: {err}");

        // Room for about one conversation: each pushes the other out, and rank 0's evictions
        // are every rank's.
        let budget = (held * 0.6) as u64;
        let split = split_runner(
            model,
            ranks,
            &hosts,
            &[
                &same_flags[..],
                &mode_flags,
                &["--cache-budget", &budget.to_string()],
            ]
            .concat(),
        );
        let tight = conversations(&split, &order, logprobs);
        for (i, (g, a)) in tight.iter().zip(&alone).enumerate() {
            same(g, a, &format!("{model} within {budget} bytes: turn {i}"));
        }
        let restored = |turns: &[Turn]| turns.iter().map(|t| t.cached).sum::<u64>();
        let (kept, all) = (restored(&tight), restored(&got));
        assert!(
            (1..all).contains(&kept),
            "{model}: {kept} of {all} tokens restored"
        );
        assert!(metric(&split, "mlx_runner_prefix_cache_bytes") <= budget as f64);
        let (status, err) = split.terminate();
        assert!(status.success(), "{err}");
        assert!(
            !err.contains("could not restore"),
            "{model} within {budget}: {err}"
        );
        assert!(
            !err.contains("out of step"),
            "{model} within {budget}: {err}"
        );
    }
}

/// Block files in the disk tier's directory once every rank's writer is done: the count has
/// stopped changing and no temporary file is left.
fn settled_blocks(dir: &Path) -> usize {
    let count = || {
        let names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n != ".lock")
            .collect();
        let temp = names.iter().any(|n| !n.ends_with(".block"));
        (names.len(), temp)
    };
    let start = std::time::Instant::now();
    let (mut last, mut same_for) = (usize::MAX, 0);
    while start.elapsed() < Duration::from_secs(20) {
        let (n, temp) = count();
        same_for = if n == last && !temp { same_for + 1 } else { 0 };
        if same_for >= 5 {
            return n;
        }
        last = n;
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("the disk tier did not settle");
}

/// The prefix cache's disk tier on a split model: every rank writes the blocks of its own
/// caches (its share of the heads, or its layers; rank 0's with the drafter's caches), and
/// the same split started again resumes a prompt it saw on every rank, answering as one
/// process does (by tensors with sliding-window layers, by layers over three stages, by
/// tensors with MLA's latent cache and GLM's drafter).
#[test]
fn a_split_model_resumes_from_its_disk_tier() {
    const BLOCK: usize = 16;
    let words = [
        "river", "stone", "lantern", "copper", "meadow", "harbor", "violet",
    ];
    let prompt = (0..70)
        .map(|i| words[(i * 3 + i / 4) % words.len()])
        .collect::<Vec<_>>()
        .join(" ");
    for (model, ranks, mode) in [
        ("gemma4_31b_like", 2, "tensor"),
        ("gemma4_31b_like", 3, "pipeline"),
        ("glm4_moe_lite", 2, "tensor"),
    ] {
        let what = format!("{model} over {ranks} by {mode}");
        let interval = BLOCK.to_string();
        let flags = ["--cache-interval", interval.as_str(), "--parallel", "1"];
        let solo = Runner::start(model, &flags);
        let want = ask_with(&solo, &prompt, 8, true);
        drop(solo);

        let (_h, hosts) = local(ranks);
        let dir = tempfile::tempdir().unwrap();
        let disk = [
            "--parallel-mode",
            mode,
            "--cache-dir",
            dir.path().to_str().unwrap(),
        ];
        let args = [&flags[..], &disk].concat();
        let first = split_runner(model, ranks, &hosts, &args);
        let got = ask_with(&first, &prompt, 8, true);
        same(&got, &want, &format!("{what}: first run"));
        settled_blocks(dir.path());
        let written = metric(&first, "mlx_runner_prefix_disk_written_total") as usize;
        assert!(written >= 2, "{what}: rank 0 wrote {written} blocks");
        // The other ranks write theirs when the next call reaches them: here, the stop.
        let (status, err) = first.terminate();
        assert!(status.success(), "{what}: {err}");
        none_left(&hosts);
        // Each rank wrote as many blocks as rank 0, under names of its own.
        let blocks = settled_blocks(dir.path());
        assert_eq!(blocks, ranks * written, "{what}: block files");

        let second = split_runner(model, ranks, &hosts, &args);
        let got = ask_with(&second, &prompt, 8, true);
        let whole = (got.prompt_tokens as usize - 1) / BLOCK * BLOCK;
        // GLM's MTP drafter starts one position before what was stored.
        let margin = usize::from(model == "glm4_moe_lite");
        assert_eq!(
            got.cached as usize,
            whole - margin,
            "{what}: resumed of {} prompt tokens",
            got.prompt_tokens
        );
        same(&got, &want, &format!("{what}: started again"));
        assert_eq!(metric(&second, "mlx_runner_prefix_disk_hits_total"), 1.0);
        let (status, err) = second.terminate();
        assert!(status.success(), "{what}: {err}");
        assert!(!err.contains("could not restore"), "{what}: {err}");
        none_left(&hosts);
    }
}
