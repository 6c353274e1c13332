//! `create`, `list`, `show`, `rm` and `runner --model NAME` through the real binary: stored
//! models serve what their directories serve, drafts stay exact whatever their quantization,
//! and a `create` killed at any moment leaves a consistent store.

mod common;
use common::*;
use serde_json::json;
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::time::Instant;

/// A model store and a working folder for Modelfiles, both temporary.
struct Env {
    dir: tempfile::TempDir,
}

impl Env {
    fn new() -> Env {
        Env {
            dir: tempfile::tempdir().unwrap(),
        }
    }

    fn models(&self) -> PathBuf {
        self.dir.path().join("models")
    }

    fn store(&self) -> store::Store {
        store::Store::open(self.models())
    }

    fn modelfile(&self, file: &str, text: &str) -> PathBuf {
        let p = self.dir.path().join(file);
        std::fs::write(&p, text).unwrap();
        p
    }

    fn cmd(&self, args: &[&OsStr]) -> std::process::Command {
        let mut c = binary();
        c.env("MLX_RUNNER_MODELS", self.models()).args(args);
        c
    }

    fn run(&self, args: &[&str]) -> Output {
        let args: Vec<&OsStr> = args.iter().map(OsStr::new).collect();
        self.cmd(&args).output().unwrap()
    }

    fn ok(&self, args: &[&str]) -> String {
        let out = self.run(args);
        assert!(
            out.status.success(),
            "{args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }

    /// Runs a command that must fail with exit code 1 and one `error:` line; returns the line.
    fn fails(&self, args: &[&str]) -> String {
        let out = self.run(args);
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
        let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
        assert_eq!(lines.len(), 1, "{args:?}: expected one line, got {err}");
        assert!(lines[0].starts_with("error: "), "{err}");
        lines[0].to_string()
    }

    fn runner(&self, model: &str, extra: &[&str]) -> Runner {
        Runner::start_with(
            OsStr::new(model),
            extra,
            &[("MLX_RUNNER_MODELS", self.models().as_os_str())],
        )
    }
}

fn greedy(prompt: &str, n: i64) -> serde_json::Value {
    json!({"Prompt": prompt, "Options": {"num_predict": n, "temperature": 0, "repeat_penalty": 1.0}})
}

const PROMPTS: [&str; 2] = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world!",
];

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap().flatten() {
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

#[test]
fn stored_models_serve_what_their_directories_serve() {
    let env = Env::new();
    let mf = env.modelfile(
        "Modelfile",
        &format!("FROM {}\n", fixture("gemma4_31b_like").display()),
    );
    let out = env.ok(&["create", "g31", "-f", mf.to_str().unwrap()]);
    assert!(out.contains("created g31:latest"), "{out}");
    let stored = env.runner("g31", &[]);
    let dir = Runner::start("gemma4_31b_like", &[]);
    for p in PROMPTS {
        let (a, b) = (
            stored.complete(&greedy(p, 24)),
            dir.complete(&greedy(p, 24)),
        );
        assert_eq!(text_of(&a), text_of(&b), "{p}");
        assert_eq!(done_of(&a)["EvalCount"], done_of(&b)["EvalCount"]);
    }
    let list = env.ok(&["list"]);
    assert!(
        list.lines().nth(1).unwrap().starts_with("g31:latest"),
        "{list}"
    );
}

#[test]
fn quantized_drafts_keep_greedy_output_exact() {
    // The target's own 8-bit twin as a separate draft (mostly accepted, sometimes not), and the
    // gemma4 assistant at 4 bits: drafting must never change greedy output.
    let env = Env::new();
    let twin = env.dir.path().join("twin");
    copy_dir(&fixture("gemma4_26b_a4b_like"), &twin);
    let mf = env.modelfile(
        "Modelfile",
        &format!(
            "FROM {}\nDRAFT ./twin\n",
            fixture("gemma4_26b_a4b_like").display()
        ),
    );
    let out = env.ok(&[
        "create",
        "moe",
        "-f",
        mf.to_str().unwrap(),
        "--draft-quantize",
        "int8",
    ]);
    assert!(out.contains("draft  Gemma4ForCausalLM int8"), "{out}");
    let mf2 = env.modelfile(
        "Modelfile2",
        &format!(
            "FROM {}\nDRAFT {}\n",
            fixture("gemma4_e2b_like").display(),
            fixture("gemma4_assistant").display()
        ),
    );
    env.ok(&[
        "create",
        "e2b",
        "-f",
        mf2.to_str().unwrap(),
        "--quantize-draft",
        "q4",
    ]);
    let show = env.ok(&["show", "moe"]);
    assert!(
        show.contains("  Draft\n    architecture    Gemma4ForCausalLM"),
        "{show}"
    );
    assert!(
        show.contains("quantization    int8 (affine; 47 of 126 tensors)"),
        "{show}"
    );

    // GLM quantized to 4 bits, drafting with its own (quantized) MTP layer.
    let mf3 = env.modelfile(
        "Modelfile3",
        &format!("FROM {}\n", fixture("glm4_moe_lite").display()),
    );
    env.ok(&["create", "glm", "-f", mf3.to_str().unwrap(), "-q", "q4"]);

    for (name, dir) in [
        ("moe", Some("gemma4_26b_a4b_like")),
        ("e2b", Some("gemma4_e2b_like")),
        ("glm", None),
    ] {
        let spec = env.runner(name, &["--draft-depth", "3"]);
        let plain = dir.map(|d| Runner::start(d, &["--draft-depth", "0"]));
        let no_draft = env.runner(name, &["--no-draft"]);
        let mut accepted = 0;
        for p in PROMPTS {
            let (a, c) = (
                spec.complete(&greedy(p, 32)),
                no_draft.complete(&greedy(p, 32)),
            );
            assert_eq!(text_of(&a), text_of(&c), "{name}: drafting changed {p:?}");
            if let Some(plain) = &plain {
                let b = plain.complete(&greedy(p, 32));
                assert_eq!(text_of(&c), text_of(&b), "{name}: the stored model differs");
            }
            assert!(
                done_of(&a)["DraftTokens"].as_u64().unwrap() > 0,
                "{name}: no drafts"
            );
            assert_eq!(done_of(&c)["DraftTokens"], 0, "{name}: --no-draft drafted");
            accepted += done_of(&a)["DraftAccepted"].as_u64().unwrap();
        }
        if name == "moe" {
            assert!(accepted > 0, "the 8-bit twin never agreed with its target");
        }
    }
}

#[test]
fn runner_draft_flag_overrides_the_stored_draft() {
    let env = Env::new();
    let mf = env.modelfile(
        "Modelfile",
        &format!(
            "FROM {}\nDRAFT {}\n",
            fixture("gemma4_e2b_like").display(),
            fixture("gemma4_assistant").display()
        ),
    );
    env.ok(&["create", "e2b", "-f", mf.to_str().unwrap()]);
    let dense = fixture("gemma4_assistant_dense");
    let r = env.runner(
        "e2b",
        &["--draft", dense.to_str().unwrap(), "--draft-depth", "2"],
    );
    let plain = Runner::start("gemma4_e2b_like", &["--draft-depth", "0"]);
    let (a, b) = (
        r.complete(&greedy(PROMPTS[0], 16)),
        plain.complete(&greedy(PROMPTS[0], 16)),
    );
    assert_eq!(text_of(&a), text_of(&b));
    assert!(done_of(&a)["DraftTokens"].as_u64().unwrap() > 0);
    let (_, err) = r.terminate();
    assert!(err.contains("speculative decoding on"), "{err}");
}

#[test]
fn command_line_errors_are_one_clear_line() {
    let env = Env::new();
    let e2b = fixture("gemma4_e2b_like");
    let bad = env.modelfile("Bad", "FROM x\nFORM y\n");
    let same = env.modelfile(
        "Same",
        &format!("FROM {}\nDRAFT {}/\n", e2b.display(), e2b.display()),
    );
    let plain = env.modelfile("Plain", &format!("FROM {}\n", e2b.display()));
    let glm_assistant = env.modelfile(
        "GlmAssistant",
        &format!(
            "FROM {}\nDRAFT {}\n",
            fixture("glm4_moe_lite").display(),
            fixture("gemma4_assistant").display()
        ),
    );
    let s = |p: &PathBuf| p.to_str().unwrap().to_string();
    let cases: Vec<(Vec<String>, &str)> = vec![
        (
            vec!["create".into(), "m".into(), "-f".into(), s(&bad)],
            "line 2: unknown command \"FORM\"",
        ),
        (
            vec!["create".into(), "m".into(), "-f".into(), s(&same)],
            "DRAFT is the same model as FROM",
        ),
        (
            vec![
                "create".into(),
                "m".into(),
                "-f".into(),
                s(&plain),
                "--quantize-draft".into(),
                "q4".into(),
            ],
            "--quantize-draft needs a DRAFT line",
        ),
        (
            vec!["create".into(), "m".into(), "-f".into(), s(&glm_assistant)],
            "a gemma4_assistant drafts for gemma4 targets",
        ),
        (
            vec![
                "create".into(),
                "m".into(),
                "-f".into(),
                "/no/Modelfile".into(),
            ],
            "/no/Modelfile: No such file",
        ),
        (
            vec!["create".into(), "a/b/c/d".into(), "-f".into(), s(&plain)],
            "invalid model name",
        ),
        (
            vec!["show".into(), "nosuch".into()],
            "model nosuch:latest not found",
        ),
        (
            vec!["rm".into(), "nosuch".into()],
            "model nosuch:latest not found",
        ),
        (
            vec![
                "generate".into(),
                "--model".into(),
                "nosuch".into(),
                "--prompt".into(),
                "x".into(),
            ],
            "model \"nosuch\" not found: no such directory, and no model nosuch:latest",
        ),
    ];
    for (args, want) in cases {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let line = env.fails(&args);
        assert!(line.contains(want), "{args:?}: {line}");
    }
    // clap rejects an unknown quantization before anything runs (exit code 2).
    let out = env.run(&["create", "m", "-f", &s(&plain), "--quantize", "q3"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown quantization \"q3\""));
    assert!(env.store().list().unwrap().is_empty());

    // A damaged blob stops the runner at load with the reason, not a wrong answer.
    env.ok(&["create", "m", "-f", &s(&plain)]);
    let r = env.store().resolve(&"m".parse().unwrap()).unwrap();
    let blob = r.target.tensors.last().unwrap();
    let mut bytes = std::fs::read(blob).unwrap();
    let n = bytes.len();
    bytes[n - 2] ^= 1;
    std::fs::write(blob, bytes).unwrap();
    let line = env.fails(&["generate", "--model", "m", "--prompt", "x", "-n", "2"]);
    assert!(line.contains("does not match its digest"), "{line}");
    let out = env
        .cmd(&[
            OsStr::new("runner"),
            OsStr::new("--model"),
            OsStr::new("m"),
            OsStr::new("--port"),
            OsStr::new(&free_port().to_string()),
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("does not match its digest"), "{err}");
}

/// A tiny deterministic generator, so a failing kill point can be replayed from its seed.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> f64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[test]
fn killed_creates_leave_a_consistent_store() {
    let env = Env::new();
    let twin = env.dir.path().join("twin");
    copy_dir(&fixture("gemma4_26b_a4b_like"), &twin);
    let keep = env.modelfile(
        "Keep",
        &format!("FROM {}\n", fixture("glm4_moe_lite").display()),
    );
    env.ok(&["create", "keep", "-f", keep.to_str().unwrap()]);
    let mf = env.modelfile(
        "Modelfile",
        &format!(
            "FROM {}\nDRAFT ./twin\n",
            fixture("gemma4_26b_a4b_like").display()
        ),
    );
    let args = |q: &'static str| -> Vec<&OsStr> {
        vec![
            OsStr::new("create"),
            OsStr::new("m"),
            OsStr::new("-f"),
            mf.as_os_str(),
            OsStr::new("--quantize"),
            OsStr::new(q),
            OsStr::new("--quantize-draft"),
            OsStr::new("q8"),
        ]
    };
    let t0 = Instant::now();
    let out = env.cmd(&args("q4")).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let full = t0.elapsed();

    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;
    eprintln!("kill schedule seed {seed}, a full create takes {full:?}");
    let mut rng = Lcg(seed);
    let st = env.store();
    for round in 0..12 {
        // Alternate between two different results, so a kill can land mid-replacement.
        let q = if round % 2 == 0 { "q8" } else { "q4" };
        let mut child = env
            .cmd(&args(q))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let at = full.mul_f64(1.2 * rng.next());
        std::thread::sleep(at);
        let _ = child.kill();
        let _ = child.wait();
        let problems = st.check().unwrap();
        assert!(
            problems.is_empty(),
            "round {round}, killed at {at:?}: {problems:?}"
        );
        for name in ["keep", "m"] {
            let r = st.resolve(&name.parse().unwrap()).unwrap();
            models::load_files(&r.target, models::DtypeChoice::Auto)
                .unwrap_or_else(|e| panic!("round {round}: {name}: {e}"));
        }
    }
    // A clean run afterwards succeeds and leaves no stray files behind.
    let out = env.cmd(&args("q4")).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(st.check().unwrap().is_empty());
    let used: std::collections::BTreeSet<PathBuf> = st
        .list()
        .unwrap()
        .iter()
        .flat_map(|l| {
            let r = st.resolve(&l.name).unwrap();
            r.manifest
                .all_layers()
                .map(|layer| st.blob_path(&layer.digest).unwrap())
                .collect::<Vec<_>>()
        })
        .collect();
    let on_disk: std::collections::BTreeSet<PathBuf> =
        std::fs::read_dir(env.models().join("blobs"))
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .collect();
    assert_eq!(on_disk, used, "stray blobs or temporary files");
}

/// The parent merges a model's PARAMETERs into each request before sending it (as ollama's
/// does), so on the protocol a missing option is Go's zero value, never a stored default; the
/// user-facing `generate` applies them under its own flags.
#[test]
fn stored_parameters_apply_to_generate_not_to_protocol_requests() {
    let env = Env::new();
    let mf = env.modelfile(
        "Modelfile",
        &format!(
            "FROM {}\nPARAMETER num_ctx 64\nPARAMETER num_predict 5\nPARAMETER temperature 0.9\nPARAMETER seed 3\n",
            fixture("gemma4_31b_like").display()
        ),
    );
    env.ok(&["create", "p", "-f", mf.to_str().unwrap()]);
    let r = env.runner("p", &[]);
    let status: serde_json::Value = serde_json::from_str(
        &ureq::get(&r.url("/v1/status"))
            .call()
            .unwrap()
            .into_string()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(status["ContextLength"], 64, "num_ctx sets the context");
    // No options: greedy (temperature absent = 0) until EOS or the context, not the stored
    // temperature and num_predict.
    let bare = r.complete(&json!({"Prompt": PROMPTS[0]}));
    let explicit = r.complete(&greedy(PROMPTS[0], 0));
    assert_eq!(
        text_of(&bare),
        text_of(&explicit),
        "missing temperature is greedy"
    );
    let d = done_of(&bare);
    assert_ne!(d["EvalCount"], 5, "the stored num_predict was applied: {d}");
    // `generate` applies the stored PARAMETERs: 5 tokens at temperature 0.9 with seed 3...
    let models = env.models();
    let run = |extra: &[&str]| {
        let mut args = vec!["generate", "--model", "p", "--prompt", PROMPTS[0], "--json"];
        args.extend_from_slice(extra);
        let out = binary()
            .args(&args)
            .env("MLX_RUNNER_MODELS", &models)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let lines: Vec<serde_json::Value> = String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        lines
    };
    let stored = run(&[]);
    assert_eq!(done_of(&stored)["EvalCount"], 5);
    let same = r.complete(&json!({"Prompt": PROMPTS[0], "Options": {"num_predict": 5, "temperature": 0.9, "seed": 3}}));
    assert_eq!(
        text_of(&stored),
        text_of(&same),
        "stored parameters = the same options sent"
    );
    // ... and its flags win over them.
    let flagged = run(&["-n", "7", "--temperature", "0"]);
    assert_eq!(done_of(&flagged)["EvalCount"], 7);
    let greedy7 = r.complete(&greedy(PROMPTS[0], 7));
    assert_eq!(text_of(&flagged), text_of(&greedy7));
    // --ctx-size wins over the stored num_ctx.
    let r2 = env.runner("p", &["--ctx-size", "48"]);
    let status: serde_json::Value = serde_json::from_str(
        &ureq::get(&r2.url("/v1/status"))
            .call()
            .unwrap()
            .into_string()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(status["ContextLength"], 48);
}

/// What a killed `create` leaves behind is cleaned when any store command starts (unless a
/// writer is at work), and `list` says so.
#[test]
fn partial_files_of_a_killed_create_are_swept_by_the_next_command() {
    let env = Env::new();
    let mf = env.modelfile(
        "Modelfile",
        &format!("FROM {}\n", fixture("glm4_moe_lite").display()),
    );
    env.ok(&["create", "m", "-f", mf.to_str().unwrap()]);
    let partial = env.models().join("blobs/.partial-4242-0");
    std::fs::write(&partial, vec![0u8; 1 << 20]).unwrap();
    // A writer at work: its files are kept.
    let lock = std::fs::File::options()
        .write(true)
        .open(env.models().join(".lock"))
        .unwrap();
    lock.lock().unwrap();
    let out = env.run(&["list"]);
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("a create is in progress"));
    assert!(partial.exists());
    lock.unlock().unwrap();
    // No writer: swept, and said.
    let out = env.run(&["list"]);
    assert!(out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("removed 1 partial file(s) (1.0 MB)"), "{err}");
    assert!(!partial.exists());
    assert!(String::from_utf8_lossy(&out.stdout).contains("m:latest"));
    // Any other store command sweeps too.
    std::fs::write(&partial, b"x").unwrap();
    env.ok(&["show", "m"]);
    assert!(!partial.exists(), "show swept");
}

/// Every blob is checked against its digest, the parameters included.
#[test]
fn an_altered_params_blob_is_refused() {
    let env = Env::new();
    let mf = env.modelfile(
        "Modelfile",
        &format!(
            "FROM {}\nPARAMETER temperature 0.5\n",
            fixture("glm4_moe_lite").display()
        ),
    );
    env.ok(&["create", "p", "-f", mf.to_str().unwrap()]);
    let st = env.store();
    let r = st.resolve(&"p".parse().unwrap()).unwrap();
    let params = r
        .manifest
        .layers
        .iter()
        .find(|l| l.media_type.ends_with(".params"))
        .expect("a params layer");
    std::fs::write(
        st.blob_path(&params.digest).unwrap(),
        r#"{"temperature":1.5}"#,
    )
    .unwrap();
    let e = env.fails(&["show", "p"]);
    assert!(e.contains("does not match its digest"), "{e}");
    let e = env.fails(&["generate", "--model", "p", "--prompt", "x", "-n", "1"]);
    assert!(e.contains("does not match its digest"), "{e}");
}

/// A store written by the version before `create` wrote ollama's format (committed, see
/// tests/fixtures/stores/README.md) keeps working: listed, shown, served as mlx-lm's own
/// conversion of the same model serves, with its parameters, and usable as a FROM (its blobs
/// reused) and as a DRAFT (rewritten in ollama's layout under `draft.`).
#[test]
fn a_store_written_by_the_earlier_version_still_works() {
    let env = Env::new();
    let models = env.models();
    for sub in ["blobs", "manifests/registry.ollama.ai/library/glm-q4"] {
        copy_dir(&fixture("../stores/v1").join(sub), &models.join(sub));
    }
    let list = env.ok(&["list"]);
    assert!(list.contains("glm-q4:latest"), "{list}");
    let show = env.ok(&["show", "glm-q4"]);
    assert!(show.contains("Glm4MoeLiteForCausalLM"), "{show}");
    assert!(show.contains("the model's own MTP layer"), "{show}");
    assert!(show.contains("PARAMETER temperature 0.5"), "{show}");

    let stored = env.runner("glm-q4", &["--no-draft"]);
    let mlx_lm = Runner::start("glm4_moe_lite_q4", &["--no-draft"]);
    for p in PROMPTS {
        let (a, b) = (
            stored.complete(&greedy(p, 16)),
            mlx_lm.complete(&greedy(p, 16)),
        );
        assert_eq!(text_of(&a), text_of(&b), "{p}");
    }
    drop(stored);

    // FROM it: the target's blobs are its own.
    let before = env.store().resolve(&"glm-q4".parse().unwrap()).unwrap();
    let mf = env.modelfile("Modelfile", "FROM glm-q4\nPARAMETER top_k 7\n");
    env.ok(&["create", "glm-q4b", "-f", mf.to_str().unwrap()]);
    let after = env.store().resolve(&"glm-q4b".parse().unwrap()).unwrap();
    let tensors = |r: &store::Resolved| -> Vec<String> {
        r.manifest
            .layers
            .iter()
            .filter(|l| l.media_type == "application/vnd.ollama.image.tensor")
            .map(|l| l.digest.clone())
            .collect()
    };
    assert_eq!(tensors(&before), tensors(&after));
    assert_eq!(after.parameters["temperature"], json!(0.5));
    assert_eq!(after.parameters["top_k"], json!(7));
    let derived = env.runner("glm-q4b", &["--no-draft"]);
    let a = derived.complete(&greedy(PROMPTS[0], 16));
    assert_eq!(
        text_of(&a),
        text_of(&mlx_lm.complete(&greedy(PROMPTS[0], 16)))
    );
    drop(derived);

    // As the DRAFT of the float model: its tensors rewritten under `draft.`, it drafts, and
    // greedy output is the target's.
    let mf = env.modelfile(
        "Modelfile2",
        &format!(
            "FROM {}\nDRAFT glm-q4\n",
            fixture("glm4_moe_lite").display()
        ),
    );
    env.ok(&["create", "glm-spec", "-f", mf.to_str().unwrap()]);
    let spec = env.store().resolve(&"glm-spec".parse().unwrap()).unwrap();
    assert!(spec
        .manifest
        .layers
        .iter()
        .any(|l| l.name.as_deref() == Some("draft.model.layers.1.mlp.switch_mlp.up_proj.weight")));
    let drafting = env.runner("glm-spec", &["--draft-depth", "3"]);
    let plain = Runner::start("glm4_moe_lite", &["--no-draft"]);
    for p in PROMPTS {
        let (a, b) = (
            drafting.complete(&greedy(p, 16)),
            plain.complete(&greedy(p, 16)),
        );
        assert_eq!(text_of(&a), text_of(&b), "{p}");
    }
}
