//! The real binary, spawned the way a user or parent process runs it.

use std::process::Command;

fn mlx_runner() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_mlx-runner"));
    // The binary must find libmlx through its rpath alone (docs/BUILD.md §3).
    c.env_remove("LD_LIBRARY_PATH");
    c
}

/// Runs the binary with `args`, which must succeed: its (stdout, stderr).
fn run_ok(args: &[&str]) -> (String, String) {
    let out = mlx_runner().args(args).output().unwrap();
    let (text, err) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    assert!(out.status.success(), "{text}\n{err}");
    (text, err)
}

#[test]
fn info_reports_mlx_device_and_blas() {
    let (text, _) = run_ok(&["info"]);
    assert!(text.contains("mlx        0.32.4"), "{text}");
    assert!(text.contains("device     cpu"), "{text}");
    assert!(text.lines().any(|l| l.starts_with("sgemm ")), "{text}");
    assert!(text.contains("self-check ok"), "{text}");
}

#[test]
fn unknown_subcommand_is_a_clear_error() {
    let out = mlx_runner().arg("frobnicate").output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("unrecognized subcommand 'frobnicate'"),
        "{err}"
    );
}

fn fixture(name: &str) -> String {
    format!(
        "{}/tests/fixtures/models/{name}",
        env!("CARGO_MANIFEST_DIR")
    )
}

#[test]
fn generate_prints_text_and_stats() {
    let (_, err) = run_ok(&[
        "generate",
        "--model",
        &fixture("gemma4_e2b_like"),
        "--prompt",
        "Hello world",
        "-n",
        "8",
    ]);
    assert!(
        err.contains("prompt: ") && err.contains(" tokens, ") && err.contains("generated:"),
        "{err}"
    );
}

#[test]
fn generate_json_streams_protocol_chunks() {
    let (text, _) = run_ok(&[
        "generate",
        "--model",
        &fixture("glm4_moe_lite"),
        "--prompt",
        "Hello",
        "-n",
        "4",
        "--json",
        "--top-logprobs",
        "2",
    ]);
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let last = lines.last().unwrap();
    assert_eq!(last["Done"], true);
    assert!(
        last["DoneReason"].is_u64()
            && last["EvalCount"].is_u64()
            && last["PromptEvalDuration"].is_u64()
    );
    for l in &lines[..lines.len() - 1] {
        assert_eq!(l["Done"], false);
        let lp = &l["Logprobs"][0];
        assert!(lp["logprob"].as_f64().unwrap() <= 0.0);
        assert_eq!(lp["top_logprobs"].as_array().unwrap().len(), 2);
    }
}

/// A speculative round that ends the sequence (the end of text among its accepted tokens)
/// leaves its tokens and the end queued: generate hands them all out, ending on the final
/// chunk. It used to stop at the round and print neither (seeds 6 and 7 here did).
#[test]
fn generate_hands_out_what_a_finishing_round_queued() {
    for seed in 1..=12 {
        let (text, _) = run_ok(&[
            "generate",
            "--model",
            &fixture("glm4_moe_lite"),
            "--prompt",
            "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3",
            "-n",
            "32",
            "--json",
            "--draft",
            &fixture("glm4_moe_lite"),
            "--draft-depth",
            "3",
            "--temperature",
            "0.9",
            "--seed",
            &seed.to_string(),
        ]);
        let last: serde_json::Value =
            serde_json::from_str(text.lines().last().unwrap_or("{}")).unwrap();
        assert_eq!(last["Done"], true, "seed {seed}: no final chunk:\n{text}");
        assert!(last["EvalCount"].is_u64(), "seed {seed}: {last}");
    }
}

#[test]
fn generate_with_a_broken_model_fails_with_one_line() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("config.json"), r#"{"model_type": "llama"}"#).unwrap();
    let out = mlx_runner()
        .args([
            "generate",
            "--model",
            dir.path().to_str().unwrap(),
            "--prompt",
            "x",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.contains("unknown architecture \"llama\""), "{err}");
    let out = mlx_runner()
        .args(["generate", "--model", "/no/such/dir", "--prompt", "x"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("/no/such/dir"));
    let out = mlx_runner()
        .args([
            "generate",
            "--model",
            &fixture("glm4_moe_lite"),
            "--prompt",
            "x",
            "--top-logprobs=25",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("TopLogprobs must be in [0, 20]"));
    // JSON has no NaN or infinity: a non-finite flag is refused, not read as "absent".
    let out = mlx_runner()
        .args([
            "generate",
            "--model",
            &fixture("glm4_moe_lite"),
            "--prompt",
            "x",
            "--temperature=nan",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--temperature must be a finite number"),
        "{err}"
    );
}

/// Settings that cannot work are refused at start, and settings past what is sensible are
/// capped with a warning, rather than each request failing or crawling.
#[test]
fn unusable_settings_are_refused_or_capped_at_start() {
    for cmd in ["runner", "generate"] {
        let mut c = mlx_runner();
        c.args([
            cmd,
            "--model",
            &fixture("gemma4_31b_like"),
            "--ctx-size",
            "0",
        ]);
        if cmd == "runner" {
            c.args(["--port", "1"]);
        } else {
            c.args(["--prompt", "x"]);
        }
        let out = c.output().unwrap();
        assert_eq!(out.status.code(), Some(1), "{cmd}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(err.trim(), "error: --ctx-size must be at least 1", "{cmd}");
    }
    let t = std::time::Instant::now();
    let out = mlx_runner()
        .args([
            "generate",
            "--model",
            &fixture("gemma4_31b_like"),
            "--draft",
            &fixture("gemma4_31b_like"),
            "--draft-depth",
            "1000",
            "--prompt",
            "Hello",
            "-n",
            "24",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("warning: --draft-depth 1000 is deeper than 16: using 16"),
        "{err}"
    );
    // Generous: a depth of 1000 took minutes; a capped one takes well under a second here.
    assert!(t.elapsed() < std::time::Duration::from_secs(60));
}

/// With `--port 0` the system chooses the port; the runner logs the one it bound.
#[test]
fn port_zero_reports_the_bound_port() {
    use std::io::{BufRead, BufReader};
    let mut child = mlx_runner()
        .args([
            "runner",
            "--model",
            &fixture("gemma4_31b_like"),
            "--port",
            "0",
        ])
        .stderr(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let err = BufReader::new(child.stderr.take().unwrap());
    let mut port = None;
    for line in err.lines() {
        let line = line.unwrap();
        if line.contains("runner ready") {
            let addr = line
                .split_whitespace()
                .find_map(|w| w.strip_prefix("addr="))
                .expect("the ready line names the address");
            port = addr.rsplit(':').next().and_then(|p| p.parse::<u16>().ok());
            break;
        }
    }
    let port = port.expect("a port");
    assert_ne!(port, 0);
    let s = ureq::get(&format!("http://127.0.0.1:{port}/v1/status"))
        .call()
        .unwrap();
    assert_eq!(s.status(), 200);
    let _ = child.kill();
    let _ = child.wait();
}

/// An error's cause is printed once.
#[test]
fn an_error_names_its_cause_once() {
    let dir = tempfile::tempdir().unwrap();
    let out = mlx_runner()
        .args(["create", "x", "-f", "/no/such/Modelfile"])
        .env("MLX_RUNNER_MODELS", dir.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        err.trim(),
        "error: /no/such/Modelfile: No such file or directory (os error 2)"
    );
}
