//! The prefix cache's disk tier through the real binary: a runner killed and started again
//! resumes a prompt it saw from its block files, with exactly a cold runner's output (greedy
//! text, logprobs within 1e-4), for every cache kind (gemma4's sliding window and KV-shared
//! layers, GLM's MLA latents with its MTP drafter's caches); corrupt files are skipped with a
//! warning; the directory stays within its budget.

mod common;
use common::turn::{ask_with, metric, same, Turn};
use common::*;
use serde_json::Value;
use std::path::Path;
use std::time::{Duration, Instant};

const BLOCK: usize = 16;

fn ask(r: &Runner, prompt: &str, logprobs: bool) -> Turn {
    ask_with(r, prompt, 8, logprobs)
}

fn files(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut v: Vec<_> = std::fs::read_dir(dir)
        .map(|d| d.map(|e| e.unwrap().path()).collect())
        .unwrap_or_default();
    v.retain(|p| p.file_name().is_some_and(|n| n != ".lock"));
    v.sort();
    v
}

fn bytes(dir: &Path) -> u64 {
    files(dir)
        .iter()
        .filter_map(|p| std::fs::metadata(p).ok())
        .map(|m| m.len())
        .sum()
}

/// Waits until the writer has nothing queued: the runner's written and dropped blocks stop
/// changing and the directory holds no temporary file.
fn settled(r: &Runner, dir: &Path) {
    let start = Instant::now();
    let mut last = (-1.0, -1.0, usize::MAX);
    let mut same_for = 0;
    while start.elapsed() < Duration::from_secs(20) {
        let now = (
            metric(r, "mlx_runner_prefix_disk_written_total"),
            metric(r, "mlx_runner_prefix_disk_dropped_total"),
            files(dir).len(),
        );
        let temp = files(dir)
            .iter()
            .any(|p| p.extension().is_some_and(|e| e == "tmp"));
        same_for = if now == last && !temp {
            same_for + 1
        } else {
            0
        };
        if same_for >= 3 {
            return;
        }
        last = now;
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("the disk tier did not settle");
}

fn kill(mut r: Runner) {
    r.child.kill().unwrap();
    r.child.wait().unwrap();
}

/// A prompt of a few hundred tokens, different for each `salt`.
fn prompt(salt: usize) -> String {
    prompt_of(salt, 90)
}

fn prompt_of(salt: usize, n: usize) -> String {
    let words = [
        "river", "stone", "lantern", "copper", "meadow", "harbor", "violet", "thunder", "maple",
        "orbit", "saffron", "glacier",
    ];
    (0..n)
        .map(|i| words[(i * 7 + salt * 5 + i / 3) % words.len()])
        .collect::<Vec<_>>()
        .join(" ")
}

/// Cold output, a first runner that writes blocks and is killed, a second that resumes.
fn resumes(model: &str, extra: &[&str]) {
    resumes_in_blocks_of(BLOCK, model, extra)
}

fn resumes_in_blocks_of(block: usize, model: &str, extra: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let interval = block.to_string();
    let mut args = vec!["--cache-interval", &interval, "--parallel", "1"];
    args.extend_from_slice(extra);
    let with_disk = [&args[..], &["--cache-dir", d]].concat();
    let p = prompt(0);

    // The reference: a model directory has no disk tier unless given one.
    let cold = Runner::start(model, &args);
    let status: Value = serde_json::from_str(
        &ureq::get(&cold.url("/v1/status"))
            .call()
            .unwrap()
            .into_string()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(status["CacheDiskBudget"], 0, "{status}");
    let want = ask(&cold, &p, true);
    let want_drafted = ask(&Runner::start(model, &args), &p, false);
    drop(cold);

    let first = Runner::start(model, &with_disk);
    let got = ask(&first, &p, true);
    assert_eq!(got.cached, 0);
    same(&got, &want, "first runner");
    // And once more without logprobs.
    same(
        &ask(&first, &p, false),
        &want_drafted,
        "first runner, drafting",
    );
    settled(&first, dir.path());
    let written = files(dir.path()).len();
    assert!(written >= 2, "{written} block files");
    kill(first);

    let second = Runner::start(model, &with_disk);
    let got = ask(&second, &p, true);
    let whole = (got.prompt_tokens as usize - 1) / block * block;
    // GLM's MTP drafter starts one position before what was stored (that position's MTP row
    // paired it with the stored sequence's next token).
    let margin = usize::from(model == "glm4_moe_lite");
    assert!(
        got.cached as usize == whole - margin && whole > 0,
        "{model}: resumed {} of {} prompt tokens (whole blocks: {whole})",
        got.cached,
        got.prompt_tokens
    );
    same(&got, &want, "restarted runner");
    assert_eq!(metric(&second, "mlx_runner_prefix_disk_hits_total"), 1.0);
    assert_eq!(
        metric(&second, "mlx_runner_prefix_disk_tokens_total"),
        whole as f64
    );
    // The memory tier has it now; a drafting request of the same prompt resumes from disk.
    let drafted = ask(&second, &p, false);
    same(&drafted, &want_drafted, "restarted runner, drafting");
    assert!(drafted.cached > 0);
    // A longer conversation resumes from the blocks of the shorter one and goes on alike.
    let longer = format!("{p}{} and then", got.text);
    let cold = Runner::start(model, &args);
    let want_longer = ask(&cold, &longer, true);
    drop(cold);
    let got_longer = ask(&second, &longer, true);
    assert!(got_longer.cached >= got.cached);
    same(&got_longer, &want_longer, "longer conversation");
    let (status, err) = second.terminate();
    assert!(status.success(), "{err}");
    assert!(!err.contains("skipped"), "{err}");
}

#[test]
fn a_restarted_gemma4_runner_resumes_from_disk_exactly() {
    let assistant = fixture("gemma4_assistant");
    resumes("gemma4_e2b_like", &["--draft", assistant.to_str().unwrap()]);
}

/// Blocks shorter than a sliding window (8 positions here, and its slack): a window is rebuilt
/// from the runs of several blocks, each holding only its own positions.
#[test]
fn a_window_longer_than_a_block_is_rebuilt_from_several_blocks() {
    resumes_in_blocks_of(3, "gemma4_31b_like", &[]);
}

#[test]
fn a_restarted_glm_runner_resumes_from_disk_exactly() {
    resumes("glm4_moe_lite", &[]);
}

#[test]
fn corrupt_block_files_are_skipped_with_a_warning() {
    let model = "gemma4_e2b_like";
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let args = [
        "--cache-interval",
        "16",
        "--parallel",
        "1",
        "--cache-dir",
        d,
    ];
    let p = prompt(1);
    let first = Runner::start(model, &args);
    let want = ask(&first, &p, true);
    settled(&first, dir.path());
    kill(first);
    // Every block damaged a different way: a flipped data byte, a cut, another block's bytes.
    let blocks = files(dir.path());
    assert!(blocks.len() >= 3, "{blocks:?}");
    for (i, f) in blocks.iter().enumerate() {
        let mut b = std::fs::read(f).unwrap();
        match i % 3 {
            0 => {
                let at = b.len() - 5;
                b[at] ^= 1;
            }
            1 => b.truncate(b.len() / 2),
            _ => b = std::fs::read(&blocks[0]).unwrap(),
        }
        std::fs::write(f, b).unwrap();
    }
    let second = Runner::start(model, &args);
    let got = ask(&second, &p, true);
    assert_eq!(got.cached, 0, "nothing damaged is loaded");
    same(&got, &want, "after damaged blocks");
    assert!(metric(&second, "mlx_runner_prefix_disk_skipped_total") >= 1.0);
    let (_, err) = second.terminate();
    assert!(
        err.contains("prefix cache file") && err.contains("skipped"),
        "{err}"
    );
}

#[test]
fn the_disk_tier_stays_within_its_budget() {
    let model = "glm4_moe_lite";
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    // One block's size, from a first runner.
    let probe = tempfile::tempdir().unwrap();
    let r = Runner::start(
        model,
        &[
            "--cache-interval",
            "16",
            "--cache-dir",
            probe.path().to_str().unwrap(),
        ],
    );
    ask(
        &r,
        "one two three four five six seven eight nine ten eleven twelve",
        false,
    );
    settled(&r, probe.path());
    let one = files(probe.path())
        .iter()
        .map(|p| std::fs::metadata(p).unwrap().len())
        .max()
        .unwrap();
    drop(r);

    let budget = one * 7 + one / 2;
    let b = budget.to_string();
    let r = Runner::start(
        model,
        &[
            "--cache-interval",
            "16",
            "--cache-dir",
            d,
            "--cache-disk-budget",
            &b,
        ],
    );
    for salt in 0..5 {
        ask(&r, &prompt_of(salt + 10, 25), false);
        for _ in 0..20 {
            assert!(bytes(dir.path()) <= budget, "prompt {salt}");
            std::thread::sleep(Duration::from_millis(10));
        }
        settled(&r, dir.path());
        assert!(bytes(dir.path()) <= budget, "prompt {salt}");
    }
    assert!(metric(&r, "mlx_runner_prefix_disk_evicted_total") > 0.0);
    assert_eq!(
        metric(&r, "mlx_runner_prefix_disk_budget_bytes"),
        budget as f64
    );
    // The last prompt's start is on disk (a sequence longer than the budget keeps its first
    // blocks): a new runner resumes it.
    kill(r);
    let r = Runner::start(
        model,
        &[
            "--cache-interval",
            "16",
            "--cache-dir",
            d,
            "--cache-disk-budget",
            &b,
        ],
    );
    assert!(ask(&r, &prompt_of(14, 25), false).cached > 0);
}

/// A drafted answer's blocks reach the disk too (snapshots of a round that crossed a block end,
/// or of a target its drafter trails, are rewound to the block end): the directory holds blocks
/// past the prompt, into the answer. The drafter is the target itself, so that its drafts are
/// accepted and rounds do cross block ends. (A next turn's text cannot show it on these random
/// models: their answers do not survive detokenizing and tokenizing again.)
#[test]
fn a_drafted_answer_reaches_the_disk() {
    let model = "gemma4_e2b_like";
    let drafter = fixture(model);
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let args = [
        "--cache-interval",
        "16",
        "--parallel",
        "1",
        "--draft",
        drafter.to_str().unwrap(),
        "--draft-depth",
        "3",
        "--cache-dir",
        d,
    ];
    let p = prompt_of(3, 40);
    let r = Runner::start(model, &args);
    let turn = ask_with(&r, &p, 48, false);
    assert!(
        turn.draft_tokens >= 24,
        "the answer was drafted: {}",
        turn.draft_tokens
    );
    settled(&r, dir.path());
    let blocks = files(dir.path()).len();
    // The caches hold the prompt and all but the last generated token.
    let held = turn.prompt_tokens as usize + 47;
    assert_eq!(blocks, held / BLOCK, "{blocks} blocks for {held} positions");
}
