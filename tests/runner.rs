//! The runner process over real HTTP on loopback, spawned the way a parent spawns it.

mod common;
use common::*;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read, Write};
use std::time::{Duration, Instant};

const TEXT_PROMPT: &str = "The quick brown fox jumps over the lazy dog.";

fn greedy(n: i64) -> Value {
    json!({"num_predict": n, "temperature": 0, "repeat_penalty": 1.0})
}

/// The reference's greedy continuation of TEXT_PROMPT, with its logprobs (tests/fixtures).
struct Reference {
    ids: Vec<u32>,
    logprobs: Vec<f32>,
    /// The 3 best logprobs at each step.
    top: Vec<Vec<f32>>,
}

fn reference(name: &str) -> Reference {
    let g = golden(name);
    let ids: Vec<u32> = g["text.greedy_continuation"]
        .to_vec::<i32>()
        .unwrap()
        .into_iter()
        .map(|t| t as u32)
        .collect();
    let top: Vec<Vec<f32>> = g["text.top_logprobs"]
        .to_vec::<f32>()
        .unwrap()
        .chunks(3)
        .map(|c| c.to_vec())
        .collect();
    assert_eq!(top.len(), ids.len());
    Reference {
        ids,
        logprobs: g["text.logprobs"].to_vec::<f32>().unwrap(),
        top,
    }
}

fn matches_reference(name: &str) {
    let r = Runner::start(name, &[]);
    let Reference {
        ids,
        logprobs: lps,
        top: top_lps,
    } = reference(name);
    let tok = models::Tokenizer::load(&fixture(name)).unwrap();
    let eos = tok.eos_ids().contains(ids.last().unwrap());
    let emitted = if eos { &ids[..ids.len() - 1] } else { &ids[..] };
    let lines = r.complete(
        &json!({"Prompt": TEXT_PROMPT, "Options": greedy(ids.len() as i64), "Logprobs": true, "TopLogprobs": 3}),
    );
    let whole = tok.decode(emitted).unwrap();
    if !whole.contains('\u{FFFD}') {
        assert_eq!(text_of(&lines), whole, "{name}: greedy text");
    }
    // Otherwise the random model emitted invalid UTF-8: byte-fallback decoding of the whole run
    // replaces every byte of it, while the stream (correctly) keeps the valid bytes it already
    // emitted. The tokens themselves are checked through their logprobs below.
    let done = done_of(&lines);
    assert_eq!(done["DoneReason"], if eos { 0 } else { 1 });
    // EOS is not counted, as in ollama's runner.
    assert_eq!(done["EvalCount"], emitted.len());
    // Logprobs come one entry per emitted token, aligned with the reference's log-softmax.
    let entries: Vec<&Value> = lines
        .iter()
        .filter_map(|l| l["Logprobs"].as_array())
        .flatten()
        .collect();
    assert_eq!(
        entries.len(),
        emitted.len(),
        "{name}: one logprob entry per token"
    );
    for (i, e) in entries.iter().enumerate() {
        assert_eq!(e["token"], tok.token_text(emitted[i]));
        let got = e["logprob"].as_f64().unwrap();
        assert!(
            (got - f64::from(lps[i])).abs() < 1e-4,
            "{name} token {i}: {got} vs {}",
            lps[i]
        );
        let top = e["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        for (j, t) in top.iter().enumerate() {
            assert!((t["logprob"].as_f64().unwrap() - f64::from(top_lps[i][j])).abs() < 1e-4);
        }
    }
}

#[test]
fn gemma4_greedy_and_logprobs_match_transformers() {
    matches_reference("gemma4_e2b_like");
}

#[test]
fn glm_greedy_and_logprobs_match_transformers() {
    matches_reference("glm4_moe_lite");
}

#[test]
fn http_output_equals_generate_cli() {
    let model = "gemma4_26b_a4b_like";
    let out = binary()
        .args(["generate", "--model"])
        .arg(fixture(model))
        .args(["--prompt", "Hello, world!", "-n", "12", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let cli: Vec<Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let r = Runner::start(model, &[]);
    let http = r.complete(&json!({"Prompt": "Hello, world!", "Options": greedy(12)}));
    assert_eq!(text_of(&http), text_of(&cli));
    assert_eq!(done_of(&http)["EvalCount"], done_of(&cli)["EvalCount"]);
    assert_eq!(done_of(&http)["DoneReason"], done_of(&cli)["DoneReason"]);
}

#[test]
fn status_tokenize_detokenize_metrics() {
    let r = Runner::start("gemma4_31b_like", &["--ctx-size", "256"]);
    let s = ureq::get(&r.url("/v1/status"))
        .call()
        .unwrap()
        .into_string()
        .unwrap()
        .parse::<Value>()
        .unwrap();
    assert_eq!(s["Status"], 0);
    assert_eq!(s["Progress"], 100);
    assert_eq!(s["ContextLength"], 256);
    assert!(s["Memory"].as_u64().unwrap() > 0);
    let h = ureq::get(&r.url("/health"))
        .call()
        .unwrap()
        .into_string()
        .unwrap()
        .parse::<Value>()
        .unwrap();
    assert_eq!(h["Status"], 0);

    let tok = models::Tokenizer::load(&fixture("gemma4_31b_like")).unwrap();
    let (code, ids) = r.post_raw("/v1/tokenize", "Hello world");
    assert_eq!(code, 200);
    let want: Vec<Value> = tok
        .encode("Hello world")
        .unwrap()
        .into_iter()
        .map(Value::from)
        .collect();
    assert_eq!(
        ids,
        Value::Array(want.clone()),
        "special tokens as the tokenizer config says"
    );
    let (code, text) = r.post_raw(
        "/v1/detokenize",
        &Value::Array(want[1..].to_vec()).to_string(),
    );
    assert_eq!(code, 200);
    assert_eq!(text["Content"], "Hello world");
    let (code, e) = r.post_raw("/v1/detokenize", "[1, 999999]");
    assert_eq!(code, 400);
    assert!(e["error"]
        .as_str()
        .unwrap()
        .contains("outside the vocabulary"));
    let (code, _) = r.post_raw("/v1/detokenize", "\"not a list\"");
    assert_eq!(code, 400);

    r.complete(&json!({"Prompt": "Hi", "Options": greedy(3)}));
    let m = ureq::get(&r.url("/metrics"))
        .call()
        .unwrap()
        .into_string()
        .unwrap();
    for name in [
        "mlx_runner_requests_total 1",
        "mlx_runner_prompt_tokens_total",
        "mlx_runner_generated_tokens_total",
        "mlx_runner_cached_tokens_total",
        "mlx_runner_draft_accepted_total",
        "mlx_runner_time_to_first_token_seconds_bucket",
        "mlx_runner_memory_bytes",
    ] {
        assert!(m.contains(name), "metrics lack {name}:\n{m}");
    }
}

#[test]
fn stop_strings_split_across_tokens_are_never_emitted() {
    let r = Runner::start("glm4_moe_lite", &[]);
    let full = text_of(&r.complete(&json!({"Prompt": TEXT_PROMPT, "Options": greedy(14)})));
    let chars: Vec<char> = full.chars().collect();
    assert!(chars.len() >= 6, "{full:?}");
    // A stop string that spans several tokens: a few characters from the middle.
    let stop: String = chars[2..5].iter().collect();
    let mut opts = greedy(14);
    opts["stop"] = json!(["no such text", stop]);
    let lines = r.complete(&json!({"Prompt": TEXT_PROMPT, "Options": opts}));
    let text = text_of(&lines);
    assert!(!text.contains(&stop));
    assert_eq!(text, full[..full.find(&stop).unwrap()]);
    assert_eq!(done_of(&lines)["DoneReason"], 0);
}

#[test]
fn num_predict_and_context_limits() {
    let r = Runner::start("gemma4_31b_like", &["--ctx-size", "40"]);
    let lines = r.complete(&json!({"Prompt": "Hello", "Options": {"num_predict": 3, "temperature": 0, "repeat_penalty": 1.0}}));
    let d = done_of(&lines);
    assert!(d["EvalCount"].as_u64().unwrap() <= 3);
    if d["EvalCount"] == 3 {
        assert_eq!(d["DoneReason"], 1);
    }
    // No num_predict: generation stops at the context (40 positions) with DoneReason 1
    // (unless the model says EOS first).
    let lines = r.complete(
        &json!({"Prompt": "Hello", "Options": {"temperature": 0, "repeat_penalty": 1.0}}),
    );
    let d = done_of(&lines);
    let prompt = d["PromptEvalCount"].as_u64().unwrap();
    assert!(prompt + d["EvalCount"].as_u64().unwrap() <= 40);
    if d["DoneReason"] == 1 {
        assert_eq!(prompt + d["EvalCount"].as_u64().unwrap(), 40);
    }
    // num_ctx narrows the context per request.
    let lines = r.complete(&json!({"Prompt": "Hello", "Options": {"temperature": 0, "num_ctx": 12, "repeat_penalty": 1.0}}));
    let d = done_of(&lines);
    assert!(d["PromptEvalCount"].as_u64().unwrap() + d["EvalCount"].as_u64().unwrap() <= 12);
    // A prompt that does not fit: 400.
    let long = "word ".repeat(100);
    let (code, e) = r.post_raw("/v1/completions", &json!({"Prompt": long}).to_string());
    assert_eq!(code, 400);
    assert!(e.as_str().unwrap().contains("prompt is too long"), "{e}");
    let (code, _) = r.post_raw(
        "/v1/completions",
        &json!({"Prompt": "Hello world", "Options": {"num_ctx": 3}}).to_string(),
    );
    assert_eq!(code, 400);
}

#[test]
fn malformed_requests_get_clear_400s_and_the_runner_stays_healthy() {
    let r = Runner::start("gemma4_31b_like", &[]);
    let cases: Vec<(String, u16, &str)> = vec![
        ("not json".into(), 400, "invalid request"),
        ("{\"Prompt\": 5}".into(), 400, "invalid type"),
        (
            "[]".into(),
            400,
            "the request must be a JSON object, got an array",
        ),
        (
            "[\"Hello\"]".into(),
            400,
            "the request must be a JSON object, got an array",
        ),
        ("{}".into(), 400, "prompt is empty"),
        (json!({"Prompt": ""}).to_string(), 400, "prompt is empty"),
        (
            json!({"Prompt": "x", "Options": [1]}).to_string(),
            400,
            "Options must be a JSON object, got an array",
        ),
        (
            json!({"Prompt": "x", "Options": {"temperature": "hot"}}).to_string(),
            400,
            "invalid type",
        ),
        (
            json!({"Prompt": "x", "Options": {"top_k": 1.5}}).to_string(),
            400,
            "invalid type",
        ),
        (
            json!({"Prompt": "x", "TopLogprobs": 21}).to_string(),
            400,
            "TopLogprobs must be in [0, 20]",
        ),
        (
            json!({"Prompt": "x", "Options": {"stop": "not a list"}}).to_string(),
            400,
            "invalid type",
        ),
        (
            json!({"Prompt": "x", "Options": {"temperature": 1e39}}).to_string(),
            400,
            "temperature must be a finite number",
        ),
        (
            "{\"Prompt\": \"x\", \"Options\": {\"temperature\": NaN}}".into(),
            400,
            "invalid request",
        ),
        (
            json!({"Prompt": "[img-0] what is this?", "Media": [{"data": "AAAA", "id": 0}]})
                .to_string(),
            400,
            "does not support images",
        ),
    ];
    for (body, code, needle) in cases {
        let (got, e) = r.post_raw("/v1/completions", &body);
        assert_eq!(got, code, "{body}: {e}");
        // The protocol's errors are plain text, as ollama's runner writes them.
        let msg = e
            .as_str()
            .unwrap_or_else(|| panic!("{body}: the error is not plain text: {e}"));
        assert!(msg.contains(needle), "{body}: {msg}");
    }
    // Values ollama accepts are normalised, not refused: top_k -1 and top_p 1.5 turn those
    // filters off, min_p -0.5 too, repeat_last_n -5 means the whole context, num_ctx 0 the
    // runner's.
    for options in [
        json!({"top_k": -1}),
        json!({"top_p": 1.5}),
        json!({"min_p": -0.5}),
        json!({"repeat_last_n": -5, "repeat_penalty": 1.2}),
        json!({"num_ctx": 0}),
        json!({"temperature": null, "seed": null}),
    ] {
        let mut o = options.clone();
        o["num_predict"] = json!(2);
        let lines = r.complete(&json!({"Prompt": "Hi", "Options": o}));
        assert_eq!(done_of(&lines)["Done"], true, "{options}");
    }
    // Unknown option keys are ignored.
    let lines = r.complete(
        &json!({"Prompt": "Hi", "Options": {"num_predict": 2, "mirostat": 2, "temperature": 0}}),
    );
    assert_eq!(done_of(&lines)["Done"], true);
    // Oversized bodies: 413 as soon as the headers announce one, without reading it.
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: {}\r\n\r\n{{\"Prompt\": \"",
        33 << 20
    );
    let answer = raw_http(r.port, head.as_bytes(), Duration::from_secs(5)).expect("answered");
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert!(
        answer.contains("request body is larger than 33554432 bytes"),
        "{answer}"
    );
    // Unknown endpoint.
    let (code, _) = r.post_raw("/v1/nope", "{}");
    assert_eq!(code, 404);
    // Still serving.
    let lines = r.complete(&json!({"Prompt": "Hi", "Options": greedy(2)}));
    assert_eq!(done_of(&lines)["Done"], true);
    let m = ureq::get(&r.url("/metrics"))
        .call()
        .unwrap()
        .into_string()
        .unwrap();
    assert!(!m.contains("mlx_runner_bad_requests_total 0"));
}

#[test]
fn cancelled_stream_is_followed_by_a_correct_request() {
    let r = Runner::start("glm4_moe_lite", &[]);
    let want = r.complete(&json!({"Prompt": TEXT_PROMPT, "Options": greedy(10)}));
    // Start a long generation, read one line, hang up.
    let mut s = std::net::TcpStream::connect(("127.0.0.1", r.port)).unwrap();
    let body = json!({"Prompt": "Once upon a time", "Options": {"num_predict": 100000, "temperature": 0.8}}).to_string();
    write!(s, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}", body.len()).unwrap();
    let mut reader = BufReader::new(s.try_clone().unwrap());
    let mut line = String::new();
    while !line.contains("\"Content\"") {
        line.clear();
        reader.read_line(&mut line).unwrap();
    }
    drop(reader);
    s.shutdown(std::net::Shutdown::Both).unwrap();
    drop(s);
    // The runner cancels within a step and serves the next request normally.
    let start = Instant::now();
    let got = r.complete(&json!({"Prompt": TEXT_PROMPT, "Options": greedy(10)}));
    assert_eq!(text_of(&got), text_of(&want));
    assert!(start.elapsed() < Duration::from_secs(30));
    let m = ureq::get(&r.url("/metrics"))
        .call()
        .unwrap()
        .into_string()
        .unwrap();
    assert!(m.contains("mlx_runner_requests_cancelled_total 1"), "{m}");
}

#[test]
fn eight_concurrent_clients_each_get_their_own_output() {
    let r = Runner::start("gemma4_31b_like", &["--parallel", "4"]);
    let prompts: Vec<String> = (0..8)
        .map(|i| {
            format!(
                "Request number {i}: tell me about {}",
                ["cats", "dogs", "MLX", "Rust"][i % 4]
            )
        })
        .collect();
    let body = |i: usize| json!({"Prompt": prompts[i], "Options": {"num_predict": 8, "temperature": 0.9, "seed": i, "top_k": 20}});
    // Alone, one after another.
    let alone: Vec<String> = (0..8).map(|i| text_of(&r.complete(&body(i)))).collect();
    // All at once.
    let url = r.url("/v1/completions");
    let handles: Vec<_> = (0..8)
        .map(|i| {
            let (url, b) = (url.clone(), body(i).to_string());
            std::thread::spawn(move || {
                let resp = ureq::post(&url).send_string(&b).unwrap();
                let mut s = String::new();
                resp.into_reader().read_to_string(&mut s).unwrap();
                s.lines()
                    .map(|l| serde_json::from_str::<Value>(l).unwrap())
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    for (i, h) in handles.into_iter().enumerate() {
        let lines = h.join().unwrap();
        assert_eq!(done_of(&lines)["Done"], true);
        assert_eq!(
            text_of(&lines),
            alone[i],
            "client {i} got another client's text"
        );
    }
}

#[test]
fn sigterm_ends_streams_and_exits_zero() {
    let r = Runner::start("gemma4_31b_like", &[]);
    // Three long greedy streams whose first 400 tokens hold no EOS (checked with generate).
    // The runner is told to stop once each has streamed its first line: a fixed wait could
    // outlast a stream, which ends at the fixture's 512-token context in a few hundred ms.
    let (started, streaming) = std::sync::mpsc::channel();
    let streams: Vec<_> = ["Once", "Twice", "Thrice"]
        .into_iter()
        .map(|p| {
            let url = r.url("/v1/completions");
            let started = started.clone();
            std::thread::spawn(move || {
                let b = json!({"Prompt": p, "Options": {"num_predict": 100000, "temperature": 0}})
                    .to_string();
                let resp = ureq::post(&url).send_string(&b).unwrap();
                let mut body = BufReader::new(resp.into_reader());
                let mut s = String::new();
                let _ = body.read_line(&mut s);
                let _ = started.send(());
                let _ = body.read_to_string(&mut s);
                s
            })
        })
        .collect();
    for _ in 0..3 {
        streaming
            .recv_timeout(Duration::from_secs(30))
            .expect("a stream did not start");
    }
    let start = Instant::now();
    let (status, _) = r.terminate();
    assert!(status.success(), "{status:?}");
    assert!(start.elapsed() < Duration::from_secs(6));
    // Each stream ends with an in-stream error, so that a parent reports the interruption as
    // a failure, not as a success with a truncated answer.
    for s in streams {
        let text = s.join().unwrap();
        let last: Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
        assert_eq!(last["Error"]["StatusCode"], 500, "{last}");
        let msg = last["Error"]["error"].as_str().unwrap();
        assert!(msg.contains("shutting down"), "{msg}");
    }
}

#[test]
fn model_that_fails_to_load_exits_with_one_line() {
    let dir = fixture_without_weights("gemma4_31b_like");
    std::fs::write(
        dir.path().join("model.safetensors"),
        b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\": 1}",
    )
    .unwrap();
    let out = binary()
        .args(["runner", "--model"])
        .arg(dir.path())
        .args(["--port", &free_port().to_string()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.contains("model.safetensors"), "{err}");
}

#[test]
fn port_in_use_exits_with_one_line() {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let out = binary()
        .args(["runner", "--model"])
        .arg(fixture("gemma4_31b_like"))
        .args(["--port", &port.to_string()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.contains("cannot listen on 127.0.0.1"), "{err}");
}

#[test]
fn runner_exits_when_its_parent_dies() {
    // A shell parent starts the runner and exits after a moment; the orphaned runner must go.
    let port = free_port();
    let script = format!(
        "{} runner --mlx-engine --model {} --port {port} 2>/dev/null & echo $!; sleep 2",
        env!("CARGO_BIN_EXE_mlx-runner"),
        fixture("glm4_moe_lite").display()
    );
    let out = std::process::Command::new("sh")
        .args(["-c", &script])
        .output()
        .unwrap();
    let pid: i32 = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
    let start = Instant::now();
    // SAFETY: signal 0 only checks whether the process exists.
    while unsafe { libc::kill(pid, 0) } == 0 {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "runner {pid} outlived its parent"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn drafting_runners_give_the_plain_output_and_report_it() {
    for (model, extra) in [
        ("glm4_moe_lite", vec![]),
        (
            "gemma4_e2b_like",
            vec![
                "--draft".to_string(),
                fixture("gemma4_assistant").display().to_string(),
            ],
        ),
    ] {
        let mut args: Vec<&str> = extra.iter().map(String::as_str).collect();
        args.extend(["--draft-depth", "3"]);
        let spec = Runner::start(model, &args);
        let plain = Runner::start(model, &["--draft-depth", "0"]);
        for prompt in [TEXT_PROMPT, "Hello, world!"] {
            let body = json!({"Prompt": prompt, "Options": greedy(30)});
            let (a, b) = (spec.complete(&body), plain.complete(&body));
            assert_eq!(
                text_of(&a),
                text_of(&b),
                "{model}: drafting changed the output"
            );
            assert!(
                done_of(&a)["DraftTokens"].as_u64().unwrap() > 0,
                "{model}: nothing drafted"
            );
            assert_eq!(done_of(&b)["DraftTokens"], 0);
            // Logprobs requests decode plainly, with the same numbers.
            let body = json!({"Prompt": prompt, "Options": greedy(8), "TopLogprobs": 2});
            let (a, b) = (spec.complete(&body), plain.complete(&body));
            assert_eq!(text_of(&a), text_of(&b));
            let lps = |lines: &[Value]| -> Vec<f64> {
                lines
                    .iter()
                    .filter_map(|l| l["Logprobs"].as_array())
                    .flatten()
                    .flat_map(|e| {
                        std::iter::once(e["logprob"].as_f64().unwrap()).chain(
                            e["top_logprobs"]
                                .as_array()
                                .unwrap()
                                .iter()
                                .map(|t| t["logprob"].as_f64().unwrap()),
                        )
                    })
                    .collect()
            };
            let (x, y) = (lps(&a), lps(&b));
            assert_eq!(x.len(), y.len());
            assert!(
                x.iter().zip(&y).all(|(u, v)| (u - v).abs() < 1e-4),
                "{x:?} vs {y:?}"
            );
        }
        let m = ureq::get(&spec.url("/metrics"))
            .call()
            .unwrap()
            .into_string()
            .unwrap();
        assert!(
            m.contains("mlx_runner_draft_position_total{position=\"1\",outcome=\"drafted\"}"),
            "{m}"
        );
        assert!(!m.contains("mlx_runner_draft_tokens_total 0\n"), "{model}");
    }
}
