//! A model split over ranks (MLX's ring backend over loopback), run through the real binary
//! as a user runs it: rank 0 given a hostfile starts the other ranks itself.

mod common;
use common::cluster::{hostfile, local, none_left, processes, ring_port, signal};

use std::io::Read;
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The runs take ring ports; one at a time keeps them from racing for the same ones.
static RUNS: Mutex<()> = Mutex::new(());

fn mlx_runner() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_mlx-runner"));
    c.env_remove("LD_LIBRARY_PATH");
    c
}

fn fixture(name: &str) -> String {
    format!(
        "{}/tests/fixtures/models/{name}",
        env!("CARGO_MANIFEST_DIR")
    )
}

fn generate(model: &str, extra: &[&str], hosts: Option<&Path>) -> Command {
    generate_from(model, "The quick brown fox", extra, hosts)
}

fn generate_from(model: &str, prompt: &str, extra: &[&str], hosts: Option<&Path>) -> Command {
    let mut c = mlx_runner();
    c.args(["generate", "--model", &fixture(model), "--prompt", prompt]);
    c.args(extra);
    match hosts {
        // A split model drafts with nothing (GLM's own MTP layer included); one process does
        // the same, for the same numbers.
        None => {
            c.arg("--no-draft");
        }
        Some(h) => {
            let ranks =
                serde_json::from_slice::<Vec<serde_json::Value>>(&std::fs::read(h).unwrap())
                    .unwrap()
                    .len();
            c.arg("--hostfile").arg(h);
            c.args(["--ring-port", &ring_port(ranks as u16).to_string()]);
        }
    }
    c
}

/// The chunks `generate --json` printed, without the final one (its timings differ).
fn chunks(out: &Output) -> Vec<String> {
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<String> = text
        .lines()
        .filter(|l| !l.contains("\"Done\":true"))
        .map(String::from)
        .collect();
    assert!(!lines.is_empty(), "{text}");
    lines
}

/// That a run ended well: success, and its last line the final chunk. An unseeded sampled run
/// may draw the end of text first and print nothing else.
fn ended(out: &Output) {
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let last = text.lines().last().unwrap_or_default();
    assert!(last.contains("\"Done\":true"), "no final chunk:\n{text}");
}

/// Text models among the fixtures: every architecture and quantization.
const FIXTURES: &[&str] = &[
    "gemma4_31b_like",
    "gemma4_26b_a4b_like",
    "gemma4_26b_a4b_like_q4",
    "gemma4_26b_a4b_like_mixed",
    "gemma4_26b_a4b_like_mxfp4",
    "gemma4_26b_a4b_like_mxfp8",
    "gemma4_26b_a4b_like_q8_fp_router",
    "gemma4_e2b_like",
    "gemma4_vision_like",
    "gemma4_audio_like",
    "glm4_moe_lite",
    "glm4_moe_lite_q3",
    "glm4_moe_lite_q4",
    "glm4_moe_lite_fp8",
    "glm4_moe_lite_grouped",
    "glm4_moe_lite_nvfp4",
    "glm4_moe_lite_nvfp4_ct",
    "glm4_moe_lite_nvfp4_modelopt",
];

/// Split by layers, every rank runs each layer exactly as one process does and hands the
/// hidden states on unchanged: tokens and logprobs are the same bits as one process's.
#[test]
fn pipeline_output_is_one_process_output_on_every_fixture() {
    let _one = RUNS.lock().unwrap_or_else(|e| e.into_inner());
    let args = ["-n", "24", "--json", "--top-logprobs", "3"];
    for model in FIXTURES {
        let alone = chunks(&generate(model, &args, None).output().unwrap());
        for ranks in [2, 3] {
            let (_d, hosts) = local(ranks);
            let out = generate(model, &args, Some(&hosts)).output().unwrap();
            let kv_shared = ["gemma4_e2b_like", "gemma4_vision_like", "gemma4_audio_like"];
            if kv_shared.contains(model) && ranks == 3 {
                // Their KV-shared layers read layer 1's cache: one cut only.
                let err = String::from_utf8_lossy(&out.stderr);
                assert!(!out.status.success());
                assert_eq!(err.lines().count(), 1, "{err}");
                assert!(
                    err.contains("cannot split 6 layers over 3 ranks")
                        && err.contains("KV-shared layers read layer 1's cache"),
                    "{err}"
                );
                continue;
            }
            assert_eq!(chunks(&out), alone, "{model} over {ranks} ranks");
        }
    }
}

/// Split by layers into micro-batches (every pass of 2 tokens or more cut into one per rank:
/// the prompt's pass inside its one row), the tokens are one process's and the logprobs within
/// 1e-4 of its: a row's second piece reads the keys its first piece cached instead of computing
/// them in the same pass.
#[test]
fn micro_batches_give_one_process_output() {
    let _one = RUNS.lock().unwrap_or_else(|e| e.into_inner());
    let args = ["-n", "12", "--json", "--top-logprobs", "3"];
    let prompt = "Once upon a time, in a land far away, there lived";
    for (model, ranks) in [
        ("glm4_moe_lite", 2),
        ("gemma4_31b_like", 3),
        ("gemma4_e2b_like", 2),
    ] {
        let alone = chunks(&generate_from(model, prompt, &args, None).output().unwrap());
        let (_d, hosts) = local(ranks);
        let micro = [&args[..], &["--micro-batch-tokens", "2"]].concat();
        let split = chunks(
            &generate_from(model, prompt, &micro, Some(&hosts))
                .output()
                .unwrap(),
        );
        let what = format!("{model} over {ranks} ranks in micro-batches");
        chunks_alike(&split, &alone, &what);
    }
}

/// `generate --json` chunks alike: the same tokens, logprobs within 1e-4.
fn chunks_alike(got: &[String], want: &[String], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        let a: serde_json::Value = serde_json::from_str(a).unwrap();
        let b: serde_json::Value = serde_json::from_str(b).unwrap();
        alike(&a, &b, 1e-4, &format!("{what}: chunk {i}"));
    }
}

/// `a` and `b` alike, numbers within `tol` (logprobs; token ids differ by whole numbers).
fn alike(a: &serde_json::Value, b: &serde_json::Value, tol: f64, at: &str) {
    use serde_json::Value as V;
    match (a, b) {
        (V::Number(x), V::Number(y)) => {
            let (x, y) = (x.as_f64().unwrap(), y.as_f64().unwrap());
            assert!((x - y).abs() <= tol, "{at}: {x} vs {y}");
        }
        (V::Array(x), V::Array(y)) => {
            assert_eq!(x.len(), y.len(), "{at}");
            for (i, (x, y)) in x.iter().zip(y).enumerate() {
                alike(x, y, tol, &format!("{at}[{i}]"));
            }
        }
        (V::Object(x), V::Object(y)) => {
            assert_eq!(
                x.keys().collect::<Vec<_>>(),
                y.keys().collect::<Vec<_>>(),
                "{at}"
            );
            for (k, x) in x {
                alike(x, &y[k], tol, &format!("{at}.{k}"));
            }
        }
        _ => assert_eq!(a, b, "{at}"),
    }
}

/// Split by tensors, every rank holds its share of each layer's heads and hidden units and
/// the ranks sum the output projections' partial products: the same maths summed in another
/// order, so the tokens are one process's and the logprobs within 1e-4 of its.
#[test]
fn tensor_output_is_one_process_output_on_every_fixture() {
    let _one = RUNS.lock().unwrap_or_else(|e| e.into_inner());
    let args = ["-n", "24", "--json", "--top-logprobs", "3"];
    for model in FIXTURES {
        let alone = chunks(&generate(model, &args, None).output().unwrap());
        for ranks in [2, 3] {
            let (_d, hosts) = local(ranks);
            let tensor = [&args[..], &["--parallel-mode", "tensor"]].concat();
            let out = generate(model, &tensor, Some(&hosts)).output().unwrap();
            let split = chunks(&out);
            chunks_alike(&split, &alone, &format!("{model} over {ranks} ranks"));
        }
    }
}

/// Drafting over ranks: every rank drafts for itself at a fixed depth (prompt lookup, or a draft
/// model each loads whole), verifies against the same logits and accepts alike: greedy output
/// is one process's without drafting, split by layers and by tensors, and a seeded sampled run
/// ends on every rank together.
#[test]
fn ranks_draft_alike_at_a_fixed_depth() {
    let _one = RUNS.lock().unwrap_or_else(|e| e.into_inner());
    let prompt = "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3";
    let plain = ["-n", "32", "--json"];
    for (model, draft) in [
        ("gemma4_31b_like", "ngram".to_string()),
        ("glm4_moe_lite", fixture("glm4_moe_lite")),
    ] {
        let alone = chunks(&generate_from(model, prompt, &plain, None).output().unwrap());
        let text = |c: &[String]| -> String {
            c.iter()
                .map(|l| {
                    let v: serde_json::Value = serde_json::from_str(l).unwrap();
                    v["Content"].as_str().unwrap_or_default().to_string()
                })
                .collect()
        };
        for mode in ["pipeline", "tensor"] {
            let (_d, hosts) = local(2);
            let drafted = [
                &plain[..],
                &[
                    "--draft",
                    &draft,
                    "--draft-depth",
                    "3",
                    "--parallel-mode",
                    mode,
                ],
            ]
            .concat();
            let out = generate_from(model, prompt, &drafted, Some(&hosts))
                .output()
                .unwrap();
            assert_eq!(text(&chunks(&out)), text(&alone), "{model} by {mode}");
            let stdout = String::from_utf8_lossy(&out.stdout);
            let done: serde_json::Value =
                serde_json::from_str(stdout.lines().last().unwrap_or_default()).unwrap();
            assert!(
                done["DraftTokens"].as_u64().is_some_and(|n| n > 0),
                "{model} by {mode}: {done}"
            );
            let sampled = [
                &drafted[..],
                &["--temperature", "0.9", "--rank-timeout", "20"],
            ]
            .concat();
            ended(
                &generate_from(model, prompt, &sampled, Some(&hosts))
                    .output()
                    .unwrap(),
            );
        }
    }
}

/// Every rank samples from the same logits with the same seed: a seeded run is one process's
/// run, and an unseeded one (rank 0 picks the seed) ends on every rank together.
#[test]
fn ranks_sample_together() {
    let _one = RUNS.lock().unwrap_or_else(|e| e.into_inner());
    let seeded = ["-n", "40", "--json", "--temperature", "1.0", "--seed", "7"];
    let alone = chunks(&generate("glm4_moe_lite", &seeded, None).output().unwrap());
    let (_d, hosts) = local(2);
    let split = generate("glm4_moe_lite", &seeded, Some(&hosts))
        .output()
        .unwrap();
    assert_eq!(chunks(&split), alone);
    let unseeded = [
        "-n",
        "40",
        "--json",
        "--temperature",
        "1.0",
        "--rank-timeout",
        "20",
    ];
    let out = generate("gemma4_31b_like", &unseeded, Some(&hosts))
        .output()
        .unwrap();
    ended(&out);
    // Split by tensors, each rank's hidden states may differ from another's in the last bits
    // (each sums in its own order); the logits every rank samples from are one gathered
    // array, so they stay in step all the same.
    let (_d, hosts) = local(3);
    let tensor = [&unseeded[..], &["--parallel-mode", "tensor"]].concat();
    for model in ["gemma4_26b_a4b_like", "glm4_moe_lite"] {
        ended(&generate(model, &tensor, Some(&hosts)).output().unwrap());
    }
}

/// Rank 1 on an address nobody answers: one line within the join timeout, naming how to start
/// a rank on another host.
#[test]
fn a_rank_that_never_joins_is_one_line_within_the_timeout() {
    let _one = RUNS.lock().unwrap_or_else(|e| e.into_inner());
    let (_d, hosts) = hostfile(&["127.0.0.1", "203.0.113.1"]);
    let started = Instant::now();
    let out = generate("gemma4_31b_like", &["--join-timeout", "2"], Some(&hosts))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(started.elapsed() < Duration::from_secs(20));
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains("rank 0: the ring of 2 ranks did not form within 2 s")
            && err.contains("1 (203.0.113.1)")
            && err.contains("mlx-runner worker --hostfile"),
        "{err}"
    );
}

#[test]
fn bad_cluster_arguments_are_clear_errors() {
    let (_d, hosts) = hostfile(&[]);
    refused(
        generate("gemma4_31b_like", &[], Some(&hosts)),
        "names no ranks",
    );
    let (_d, hosts) = local(2);
    refused(
        generate("gemma4_31b_like", &["--draft", "ngram"], Some(&hosts)),
        "--draft over ranks needs a fixed --draft-depth",
    );
    // Every rank of `generate` runs the whole loop; the split assistant needs rank 0 leading.
    let assistant = fixture("gemma4_assistant");
    let split_assistant = [
        "--draft",
        &assistant,
        "--draft-depth",
        "2",
        "--parallel-mode",
        "tensor",
    ];
    refused(
        generate("gemma4_e2b_like", &split_assistant, Some(&hosts)),
        "not in `generate`",
    );
    let mut worker = mlx_runner();
    worker
        .args(["worker", "--rank", "0", "--hostfile"])
        .arg(&hosts);
    refused(worker, "--rank 0 is the process");
}

/// `cmd` fails, saying `why`.
fn refused(mut cmd: Command, why: &str) {
    let out = cmd.output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains(why), "{err}");
}

/// The processes whose command line names `hostfile`: the run's ranks.
fn ranks_of(hostfile: &Path) -> Vec<u32> {
    processes(hostfile, "")
}

/// Starts a long split run and waits for its first token; returns rank 0 and the other
/// ranks' pids.
fn started_run(hosts: &Path, extra: &[&str]) -> (Reaped, Vec<u32>) {
    let mut args = vec!["-n", "480"];
    args.extend(extra);
    let mut rank0 = Reaped(
        generate("gemma4_31b_like", &args, Some(hosts))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let mut first = [0u8; 1];
    rank0
        .0
        .stdout
        .as_mut()
        .unwrap()
        .read_exact(&mut first)
        .unwrap();
    let others: Vec<u32> = ranks_of(hosts)
        .into_iter()
        .filter(|&p| p != rank0.0.id())
        .collect();
    assert_eq!(others.len(), 1, "{others:?}");
    (rank0, others)
}

/// A rank 0 that a failing test does not leave running.
struct Reaped(Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn wait_within(child: &mut Child, limit: Duration) -> (std::process::ExitStatus, String) {
    let started = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let mut err = String::new();
            child
                .stderr
                .take()
                .unwrap()
                .read_to_string(&mut err)
                .unwrap();
            return (status, err);
        }
        assert!(started.elapsed() < limit, "still running after {limit:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A rank killed mid-stream: rank 0's next collective fails, and it exits non-zero saying
/// which rank died. Rank 0 is held still meanwhile, so the kill lands mid-stream however fast
/// the run is.
#[test]
fn a_rank_killed_mid_stream_ends_the_run_with_an_error() {
    let _one = RUNS.lock().unwrap_or_else(|e| e.into_inner());
    let (_d, hosts) = local(2);
    let (mut rank0, others) = started_run(&hosts, &[]);
    signal(rank0.0.id(), libc::SIGSTOP);
    signal(others[0], libc::SIGKILL);
    std::thread::sleep(Duration::from_millis(100));
    signal(rank0.0.id(), libc::SIGCONT);
    let (status, err) = wait_within(&mut rank0.0, Duration::from_secs(20));
    assert!(!status.success(), "{err}");
    let last = err.lines().last().unwrap_or_default();
    assert!(
        last.contains("rank 1 exited with signal: 9") && last.contains("connection to a peer"),
        "{err}"
    );
    none_left(&hosts);
}

/// A rank that stops answering (stopped, not dead: its sockets stay open) ends the run within
/// --rank-timeout, and takes no rank with it left running.
#[test]
fn a_stalled_rank_ends_the_run_within_the_rank_timeout() {
    let _one = RUNS.lock().unwrap_or_else(|e| e.into_inner());
    let (_d, hosts) = local(2);
    let (mut rank0, others) = started_run(&hosts, &["--rank-timeout", "2"]);
    signal(others[0], libc::SIGSTOP);
    let (status, err) = wait_within(&mut rank0.0, Duration::from_secs(30));
    assert!(!status.success(), "{err}");
    assert!(
        err.contains("rank 0: generating: no answer from the other ranks within 2 s"),
        "{err}"
    );
    none_left(&hosts);
}

/// Rank 0 killed: the ranks it started die with it.
#[test]
fn ranks_die_with_rank_0() {
    let _one = RUNS.lock().unwrap_or_else(|e| e.into_inner());
    let (_d, hosts) = local(3);
    let mut args = vec!["-n", "480"];
    args.push("--json");
    let mut rank0 = generate("gemma4_31b_like", &args, Some(&hosts))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut first = [0u8; 1];
    rank0
        .stdout
        .as_mut()
        .unwrap()
        .read_exact(&mut first)
        .unwrap();
    signal(rank0.id(), libc::SIGKILL);
    rank0.wait().unwrap();
    none_left(&hosts);
}

/// This machine's address on its outbound interface (no packet is sent), if it has one.
fn own_address() -> Option<String> {
    let s = std::net::UdpSocket::bind("0.0.0.0:0").ok()?;
    s.connect("203.0.113.1:9").ok()?;
    let ip = s.local_addr().ok()?.ip();
    (!ip.is_loopback() && !ip.is_unspecified()).then(|| ip.to_string())
}

/// Rank 0 run with `args` from one directory and rank 1 started by hand from another, each
/// holding `links` (a name and the fixtures it names here and there): rank 1 sits on this
/// machine's own non-loopback address, so rank 0 leaves it to be started as on another host.
/// Rank 0's last line of stderr, once it has failed as it must, and the line count; `None`
/// where this machine has no such address. Rank 1 must end quietly with a failure.
fn with_another_copy(args: &[&str], links: &[(&str, &str, &str)]) -> Option<(String, usize)> {
    let Some(ip) = own_address() else {
        eprintln!("skipped: this machine has no address besides loopback");
        return None;
    };
    let _one = RUNS.lock().unwrap_or_else(|e| e.into_inner());
    let (d, hosts) = hostfile(&["127.0.0.1", &ip]);
    let (here, there) = (d.path().join("here"), d.path().join("there"));
    for (i, dir) in [&here, &there].into_iter().enumerate() {
        std::fs::create_dir(dir).unwrap();
        for &(name, mine, theirs) in links {
            let target = fixture([mine, theirs][i]);
            std::os::unix::fs::symlink(target, dir.join(name)).unwrap();
        }
    }
    let port = ring_port(2).to_string();
    let mut rank0 = mlx_runner()
        .current_dir(&here)
        .args(args)
        .args(["--ring-port", &port, "--join-timeout", "20", "--hostfile"])
        .arg(&hosts)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let worker = mlx_runner()
        .current_dir(&there)
        .args(["worker", "--rank", "1", "--ring-port", &port, "--hostfile"])
        .arg(&hosts)
        .output()
        .unwrap();
    let (status, err) = wait_within(&mut rank0, Duration::from_secs(30));
    assert!(!status.success(), "{err}");
    assert!(!worker.status.success());
    assert!(
        worker.stderr.is_empty(),
        "{}",
        String::from_utf8_lossy(&worker.stderr)
    );
    let last = err.lines().last().unwrap_or_default().to_string();
    Some((last, err.lines().count()))
}

/// A rank whose copy of the model differs: rank 0 names it, no one loads, every rank ends.
#[test]
fn a_rank_with_another_model_is_named_before_loading() {
    let args = ["generate", "--model", "m", "--prompt", "hi"];
    let links = [("m", "gemma4_31b_like", "gemma4_26b_a4b_like")];
    if let Some((last, lines)) = with_another_copy(&args, &links) {
        assert_eq!(lines, 1, "{last}");
        assert_eq!(
            last, "error: checking the model: rank 1: its copy of m differs from rank 0's",
            "{last}"
        );
    }
}

/// A rank whose copy of the gemma4 assistant differs, where the ranks load parts of it (a
/// runner split by tensors): rank 0 names it in one line at start, and no one serves.
#[test]
fn a_rank_with_another_draft_is_named_at_start() {
    let args = [
        "runner",
        "--model",
        "m",
        "--draft",
        "d",
        "--parallel-mode",
        "tensor",
        "--port",
        "0",
    ];
    let links = [
        ("m", "gemma4_e2b_like", "gemma4_e2b_like"),
        ("d", "gemma4_assistant", "gemma4_assistant_dense"),
    ];
    if let Some((last, _)) = with_another_copy(&args, &links) {
        assert_eq!(
            last,
            "error: loading the drafter: rank 1: its copy of the draft d differs from rank 0's",
            "{last}"
        );
    }
}
