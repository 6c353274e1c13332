//! The runner's memory plan, made at start against the real binary: the context and the
//! prefix-cache budget follow the memory it is given, a context that cannot be held is refused
//! before any request, and `/v1/status` and `/metrics` show the plan.

mod common;

use common::serve::Serve;
use common::{binary, fixture, free_port, Runner};
use serde_json::{json, Value};

const MODEL: &str = "gemma4_e2b_like";
/// The fixture's `max_position_embeddings`.
const MAX_CONTEXT: u64 = 512;

fn status(r: &Runner) -> Value {
    let body = ureq::get(&r.url("/v1/status"))
        .call()
        .unwrap()
        .into_string()
        .unwrap();
    serde_json::from_str(&body).unwrap()
}

/// A runner that must not start: its exit code and its stderr.
fn refused(args: &[&str]) -> (Option<i32>, String) {
    let out = binary()
        .args(["runner", "--model"])
        .arg(fixture(MODEL))
        .args(["--port", &free_port().to_string()])
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).trim().to_string(),
    )
}

#[test]
fn the_context_and_the_prefix_budget_follow_the_memory_given() {
    // What the weights take: a generous limit less what the runner says is left of it.
    let big: u64 = 1 << 30;
    let r = Runner::start(
        MODEL,
        &["--memory-limit", &big.to_string(), "--parallel", "1"],
    );
    let s = status(&r);
    let available = s["MemoryAvailable"].as_u64().unwrap();
    let weights = big - available;
    assert!(weights > 1 << 20 && weights < 64 << 20, "{s}");
    assert_eq!(s["ContextLength"], MAX_CONTEXT, "{s}");
    // A quarter of what is left once 10% is kept back and the live caches are counted.
    let budget = s["CacheBudget"].as_u64().unwrap();
    assert!(
        budget < available * 9 / 40 && budget > available * 9 / 40 - (1 << 20),
        "{s}"
    );
    let metrics = ureq::get(&r.url("/metrics"))
        .call()
        .unwrap()
        .into_string()
        .unwrap();
    assert!(
        metrics.contains(&format!("mlx_runner_prefix_cache_budget_bytes {budget}")),
        "{metrics}"
    );
    drop(r);

    // 200 KB past the weights cannot hold the full context: refused at start, naming the
    // longest that fits.
    let limit = (weights + 200_000).to_string();
    let base = ["--memory-limit", limit.as_str(), "--parallel", "1"];
    let (code, err) = refused(&[&base[..], &["--ctx-size", "512"]].concat());
    assert_eq!(code, Some(1), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.starts_with(
            "error: a context of 512 tokens needs 256.0 KiB of KV cache for 1 sequence"
        ),
        "{err}"
    );
    let fits: u64 = err
        .split("use --ctx-size ")
        .nth(1)
        .and_then(|t| t.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{err}"));
    assert!(fits > 0 && fits < MAX_CONTEXT, "{err}");

    // The context it names is exact: it starts, one more does not.
    let r = Runner::start(
        MODEL,
        &[&base[..], &["--ctx-size", &fits.to_string()]].concat(),
    );
    assert_eq!(status(&r)["ContextLength"], fits);
    drop(r);
    let (code, err) = refused(&[&base[..], &["--ctx-size", &(fits + 1).to_string()]].concat());
    assert_eq!(code, Some(1), "{err}");

    // With no context asked for, the model's maximum is cut to what fits in half the memory,
    // with a warning, and a prompt past it is refused as any too-long prompt is.
    let r = Runner::start(MODEL, &base);
    let cut = status(&r)["ContextLength"].as_u64().unwrap();
    assert!(cut > 0 && cut <= fits, "{cut} vs {fits}");
    let long = "word ".repeat(cut as usize + 8);
    let (code, body) = r.post_raw(
        "/v1/completions",
        &json!({"Prompt": long, "Options": {"num_predict": 1}}).to_string(),
    );
    assert_eq!(code, 400, "{body}");
    let (_, err) = r.terminate();
    assert!(
        err.contains(&format!(
            "context cut from the model's {MAX_CONTEXT} tokens to {cut}"
        )),
        "{err}"
    );

    // A budget asked for is the budget; a limit below the weights is refused.
    let r = Runner::start(MODEL, &[&base[..], &["--cache-budget", "12345"]].concat());
    assert_eq!(status(&r)["CacheBudget"], 12345);
    drop(r);
    let (code, err) = refused(&["--memory-limit", "1000"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("the weights alone take"), "{err}");
}

/// With no limit given, the plan starts from what the machine has available.
#[test]
fn without_a_limit_the_plan_reads_the_machine() {
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap();
    let field = |name: &str| -> u64 {
        let line = meminfo.lines().find(|l| l.starts_with(name)).unwrap();
        line.split_whitespace()
            .nth(1)
            .unwrap()
            .parse::<u64>()
            .unwrap()
            * 1024
    };
    let r = Runner::start(MODEL, &[]);
    let s = status(&r);
    let available = s["MemoryAvailable"].as_u64().unwrap();
    assert!(available > 0 && available <= field("MemTotal:"), "{s}");
    // Other tests' processes come and go; within a GiB of what the kernel says now.
    let now = field("MemAvailable:");
    assert!(available.abs_diff(now) < 1 << 30, "{s} vs {now}");
    assert!(s["CacheBudget"].as_u64().unwrap() > 0, "{s}");
    assert_eq!(s["ContextLength"], MAX_CONTEXT, "{s}");
}

/// The models `/api/ps` lists, by name, with their sizes.
fn loaded(s: &Serve) -> Vec<(String, u64)> {
    let ps = s.get("/api/ps");
    let mut out: Vec<(String, u64)> = ps["models"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            let name = m["name"].as_str().unwrap();
            (
                name.split(':').next().unwrap().to_string(),
                m["size"].as_u64().unwrap(),
            )
        })
        .collect();
    out.sort();
    out
}

fn generate(s: &Serve, model: &str) {
    let (code, v) = s.post(
        "/api/generate",
        &json!({"model": model, "prompt": "hello", "stream": false,
                "options": {"num_predict": 2}}),
    );
    assert_eq!(code, 200, "{v}");
}

/// `serve --memory-limit`: models are placed within it, the least recently used idle one
/// unloaded when the next would not fit, though the count allows both; each runner plans
/// within its share.
#[test]
fn serve_places_models_within_its_memory_limit() {
    let s = Serve::start(&[("MLX_RUNNER_MEMORY_LIMIT", "1GiB")]);
    generate(&s, "gem");
    generate(&s, "glm");
    let both = loaded(&s);
    assert_eq!(
        both.iter().map(|m| m.0.as_str()).collect::<Vec<_>>(),
        ["gem", "glm"]
    );
    let (gem, glm) = (both[0].1, both[1].1);
    // Each runner was given its share: the first the whole limit, the second what the first
    // may grow to (its memory once loaded and its prefix-cache budget) leaves of it.
    let (first, second) = (runner_of(&s, "gem"), runner_of(&s, "glm"));
    assert_eq!(first.share, Some(1 << 30));
    let budget = first.status["CacheBudget"].as_u64().unwrap();
    let share = second.share.expect("the second runner has a share");
    assert!(
        share <= (1 << 30) - budget && share + budget + 2 * gem.max(glm) >= 1 << 30,
        "share {share}, the first runner's budget {budget}"
    );
    let glm_on_disk = s.get("/api/tags")["models"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["name"].as_str().unwrap().starts_with("glm"))
        .unwrap()["size"]
        .as_u64()
        .unwrap();
    drop(s);

    // A limit that holds either model but not both: glm (placed by twice its bytes on disk,
    // never having run here) does not fit beside gem, so gem goes first.
    let limit = gem + 2 * glm_on_disk - (256 << 10);
    assert!(
        limit > glm + (2 << 20),
        "the fixtures no longer fit this test: {gem} {glm} {glm_on_disk}"
    );
    let s = Serve::start(&[("MLX_RUNNER_MEMORY_LIMIT", &limit.to_string())]);
    generate(&s, "gem");
    generate(&s, "glm");
    assert_eq!(
        loaded(&s).iter().map(|m| m.0.as_str()).collect::<Vec<_>>(),
        ["glm"]
    );
    assert_eq!(s.runners().len(), 1);
    eprintln!("gem {gem} B, glm {glm} B ({glm_on_disk} on disk), limit {limit} B: one at a time");
}

/// A runner serve started: its `--memory-limit` share, if it was given one, and its status.
struct Started {
    share: Option<u64>,
    status: Value,
}

fn runner_of(s: &Serve, model: &str) -> Started {
    for pid in s.runners() {
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap();
        let args: Vec<String> = cmdline
            .split(|&b| b == 0)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        let value = |flag: &str| Some(args[args.iter().position(|a| a == flag)? + 1].clone());
        if !value("--model").is_some_and(|m| m.starts_with(model)) {
            continue;
        }
        let port = value("--port").unwrap();
        let body = ureq::get(&format!("http://127.0.0.1:{port}/v1/status"))
            .call()
            .unwrap()
            .into_string()
            .unwrap();
        return Started {
            share: value("--memory-limit").map(|v| v.parse().unwrap()),
            status: serde_json::from_str(&body).unwrap(),
        };
    }
    panic!("no runner for {model}");
}

/// Without `--memory-limit` serve still counts what a loaded runner may grow to: the next
/// runner is started with a share, the machine's available memory less the first's prefix-cache
/// budget it has not filled, so that the two caches are not both planned on the same memory
/// (each runner planned a quarter of what the machine had, and several filling their caches
/// overcommitted it).
#[test]
fn without_a_limit_serve_counts_what_loaded_runners_may_grow_to() {
    let s = Serve::start(&[]);
    generate(&s, "gem");
    generate(&s, "glm");
    let (first, second) = (runner_of(&s, "gem"), runner_of(&s, "glm"));
    assert_eq!(
        first.share, None,
        "the first runner plans against the machine"
    );
    let share = second.share.expect("the second runner has a share");
    let available = first.status["MemoryAvailable"].as_u64().unwrap();
    let budget = first.status["CacheBudget"].as_u64().unwrap();
    // The machine's available memory moves with other tests' processes: within a GiB.
    assert!(
        share + budget <= available + (1 << 30),
        "share {share}, the first runner's budget {budget} of {available} available"
    );
    assert!(
        second.status["CacheBudget"].as_u64().unwrap() < share,
        "{}",
        second.status
    );
}

/// A float model holds its weights once. On the CPU a tied head is kept transposed (the layout
/// the head multiplies fastest) and that copy replaces the stored table: before, both were
/// evaluated at load and kept, and float models held twice their weights. The fixture's table
/// is widened to 32,768 rows (8 MiB, most of the checkpoint) so that a second copy shows.
#[test]
fn a_float_model_holds_its_weights_once() {
    let dir = common::fixture_without_weights(MODEL);
    let mut tensors = mlx::io::load_safetensors(fixture(MODEL).join("model.safetensors"))
        .unwrap()
        .arrays;
    let vocab = 32768;
    let table = mlx::random::normal(&[vocab, 64], mlx::Dtype::F32, 0.0, 0.02, None).unwrap();
    tensors.insert("model.embed_tokens.weight".into(), table);
    let named: Vec<(&str, &mlx::Array)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let file = dir.path().join("model.safetensors");
    mlx::io::save_safetensors(&file, &named).unwrap();
    let config = dir.path().join("config.json");
    let mut c: Value = serde_json::from_str(&std::fs::read_to_string(&config).unwrap()).unwrap();
    c["vocab_size"] = json!(vocab);
    std::fs::write(&config, c.to_string()).unwrap();

    let r = Runner::start_with(dir.path().as_os_str(), &[], &[]);
    let held = status(&r)["Memory"].as_u64().unwrap();
    let stored = std::fs::metadata(&file).unwrap().len();
    // The weights moved into huge pages sit in one region rounded up to 2 MiB, plus 2 MiB to
    // align it.
    assert!(
        held <= stored + (4 << 20),
        "holds {held} bytes for a checkpoint of {stored}"
    );
    assert!(
        held >= stored / 2,
        "holds {held} bytes for a checkpoint of {stored}"
    );
}
