//! The runner driven exactly as ollama's Go parent drives it, so that what the parent sees is
//! what is tested: `x/mlxrunner/client.go` (spawn, readiness, `Completion`, `Close`),
//! `api/types.go` (`Options` with `omitempty` on every field, `DefaultOptions`, `StatusError`),
//! `llm/server.go` (`MediaData`) and `server/routes.go` (options merged over the defaults
//! before the request is sent). Each Go behaviour the client below imitates names the code it
//! follows.

mod common;
use common::{binary, fixture, free_port, golden, wait_timeout};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

const TEXT_PROMPT: &str = "The quick brown fox jumps over the lazy dog.";

fn is_zero_i(v: &i64) -> bool {
    *v == 0
}

fn is_zero_f(v: &f32) -> bool {
    *v == 0.0
}

/// `api.Options` (with its embedded `Runner`) as Go's `json.Marshal` writes it: every field is
/// `omitempty`, so a zero number, `false` or an empty list is not sent at all.
#[derive(Debug, Clone, Serialize)]
struct GoOptions {
    #[serde(skip_serializing_if = "is_zero_i")]
    num_ctx: i64,
    #[serde(skip_serializing_if = "is_zero_i")]
    num_batch: i64,
    #[serde(skip_serializing_if = "is_zero_i")]
    num_gpu: i64,
    #[serde(skip_serializing_if = "Option::is_none")]
    main_gpu: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    use_mmap: Option<bool>,
    #[serde(skip_serializing_if = "is_zero_i")]
    num_thread: i64,
    #[serde(skip_serializing_if = "is_zero_i")]
    draft_num_predict: i64,
    #[serde(skip_serializing_if = "is_zero_i")]
    num_keep: i64,
    #[serde(skip_serializing_if = "is_zero_i")]
    seed: i64,
    #[serde(skip_serializing_if = "is_zero_i")]
    num_predict: i64,
    #[serde(skip_serializing_if = "is_zero_i")]
    top_k: i64,
    #[serde(skip_serializing_if = "is_zero_f")]
    top_p: f32,
    #[serde(skip_serializing_if = "is_zero_f")]
    min_p: f32,
    #[serde(skip_serializing_if = "is_zero_f")]
    typical_p: f32,
    #[serde(skip_serializing_if = "is_zero_i")]
    repeat_last_n: i64,
    #[serde(skip_serializing_if = "is_zero_f")]
    temperature: f32,
    #[serde(skip_serializing_if = "is_zero_f")]
    repeat_penalty: f32,
    #[serde(skip_serializing_if = "is_zero_f")]
    presence_penalty: f32,
    #[serde(skip_serializing_if = "is_zero_f")]
    frequency_penalty: f32,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    stop: Vec<String>,
}

impl GoOptions {
    /// `api.DefaultOptions()`, with `num_ctx` at envconfig's default context length (4096):
    /// what `server/routes.go` starts from before it merges a model's PARAMETERs and the
    /// request's own options over it.
    fn defaults() -> GoOptions {
        GoOptions {
            num_ctx: 4096,
            num_batch: 512,
            num_gpu: -1,
            main_gpu: None,
            use_mmap: None,
            num_thread: 0,
            draft_num_predict: 4,
            num_keep: 4,
            seed: -1,
            num_predict: -1,
            top_k: 40,
            top_p: 0.9,
            min_p: 0.0,
            typical_p: 1.0,
            repeat_last_n: 64,
            temperature: 0.8,
            repeat_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            stop: Vec::new(),
        }
    }

    /// A user's `"temperature": 0`: merged over the defaults, it is a zero, so it is not sent.
    fn greedy(num_predict: i64) -> GoOptions {
        GoOptions {
            temperature: 0.0,
            num_predict,
            ..GoOptions::defaults()
        }
    }
}

/// `llm.MediaData`: `Data []byte` is written as base64, `Kind` has no tag.
#[derive(Debug, Clone, Serialize)]
struct GoMedia {
    data: String,
    id: i64,
    #[serde(rename = "Kind")]
    kind: i64,
}

/// `x/mlxrunner.CompletionRequest`: no tags, so Go's field names; a nil `Media` slice is
/// written as `null`.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "PascalCase")]
struct GoCompletionRequest {
    prompt: String,
    media: Option<Vec<GoMedia>>,
    options: GoOptions,
    logprobs: bool,
    top_logprobs: i64,
}

impl GoCompletionRequest {
    fn new(prompt: &str, options: GoOptions) -> GoCompletionRequest {
        GoCompletionRequest {
            prompt: prompt.into(),
            media: None,
            options,
            logprobs: false,
            top_logprobs: 0,
        }
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
struct GoTokenLogprob {
    token: String,
    logprob: f64,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
struct GoLogprob {
    token: String,
    logprob: f64,
    top_logprobs: Vec<GoTokenLogprob>,
}

/// `api.StatusError`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
struct GoStatusError {
    #[serde(rename = "StatusCode")]
    status_code: i64,
    #[serde(rename = "Status")]
    status: String,
    error: String,
}

/// `x/mlxrunner.CompletionResponse` as `json.Unmarshal` fills it: missing keys keep their zero
/// value, unknown keys (our additions) are ignored, and a value of another type fails the line.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, rename_all = "PascalCase")]
struct GoCompletionResponse {
    content: String,
    done: bool,
    done_reason: i64,
    prompt_eval_count: i64,
    prompt_eval_duration: i64,
    eval_count: i64,
    eval_duration: i64,
    logprobs: Option<Vec<GoLogprob>>,
    error: Option<GoStatusError>,
}

/// What `Client.Completion` returns instead of a finished stream.
#[derive(Debug)]
enum GoError {
    /// A non-200 answer: `api.StatusError{StatusCode, ErrorMessage: TrimSpace(body)}`; the
    /// parent shows `ErrorMessage` to the user as it is.
    Status { code: u16, message: String },
    /// An `Error` in the stream.
    Stream(GoStatusError),
    #[allow(dead_code)] // shown through Debug when a test fails
    Transport(String),
}

/// The parent's side of one runner (`x/mlxrunner.Client`).
struct GoParent {
    child: Child,
    port: u16,
    status: StatusResponse,
}

/// `statusResponse` in client.go.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "PascalCase")]
struct StatusResponse {
    status: i64,
    progress: i64,
    context_length: i64,
    memory: u64,
}

impl GoParent {
    /// `Client.Load`: a free port from `localhost:0`, then `<exe> runner --mlx-engine --model
    /// <name> --port <p>` with the parent's environment and `LD_LIBRARY_PATH` prefixed by its
    /// library folders; then `WaitUntilRunning`: `GET /v1/status` every 100 ms until it answers
    /// 200 with a status body.
    fn load(model: &Path, extra: &[&str]) -> GoParent {
        let port = free_port();
        let child = binary()
            .args(["runner", "--mlx-engine", "--model"])
            .arg(model)
            .args(["--port", &port.to_string()])
            .args(extra)
            .env("LD_LIBRARY_PATH", "/usr/lib/ollama:/usr/lib/ollama/mlx_cpu")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut p = GoParent {
            child,
            port,
            status: StatusResponse::default(),
        };
        let start = Instant::now();
        loop {
            if let Some(s) = p.ping() {
                p.status = s;
                return p;
            }
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "runner did not start"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    /// `Client.Ping`: a 200 whose body decodes as `statusResponse`.
    fn ping(&self) -> Option<StatusResponse> {
        let r = ureq::get(&self.url("/v1/status")).call().ok()?;
        if r.status() != 200 {
            return None;
        }
        serde_json::from_str(&r.into_string().ok()?).ok()
    }

    /// `Client.Completion`: POST the request to `/completion`; a non-200 becomes a
    /// `StatusError` with the trimmed body; then one JSON object per line (a line that does
    /// not decode is skipped), an `Error` ends it with that error, `Done` ends it.
    fn completion(&self, req: &GoCompletionRequest) -> Result<Vec<GoCompletionResponse>, GoError> {
        self.completion_with(req, |_| {})
    }

    fn completion_with(
        &self,
        req: &GoCompletionRequest,
        mut each: impl FnMut(&GoCompletionResponse),
    ) -> Result<Vec<GoCompletionResponse>, GoError> {
        let body = serde_json::to_string(req).unwrap();
        let resp = match ureq::post(&self.url("/completion"))
            .set("Content-Type", "application/json")
            .send_string(&body)
        {
            Ok(r) => r,
            Err(ureq::Error::Status(code, r)) => {
                let text = r.into_string().unwrap_or_default();
                return Err(GoError::Status {
                    code,
                    message: text.trim().to_string(),
                });
            }
            Err(e) => return Err(GoError::Transport(e.to_string())),
        };
        assert_eq!(
            resp.header("content-type"),
            Some("application/jsonl"),
            "the stream's content type is the one ollama's runner sends"
        );
        let mut out = Vec::new();
        for line in BufReader::new(resp.into_reader()).lines() {
            let line = line.map_err(|e| GoError::Transport(e.to_string()))?;
            let Ok(raw) = serde_json::from_str::<GoCompletionResponse>(&line) else {
                continue;
            };
            if let Some(e) = raw.error {
                return Err(GoError::Stream(e));
            }
            each(&raw);
            let done = raw.done;
            out.push(raw);
            if done {
                return Ok(out);
            }
        }
        Ok(out)
    }

    /// `Client.Close`: SIGINT, then kill after 5 s. Returns whether it exited by itself.
    fn close(mut self) -> bool {
        // SAFETY: kill with a valid pid and signal has no memory-safety preconditions.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGINT) };
        wait_timeout(&mut self.child, Duration::from_secs(5)).is_some()
    }
}

impl Drop for GoParent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn text(chunks: &[GoCompletionResponse]) -> String {
    chunks.iter().map(|c| c.content.as_str()).collect()
}

fn last(chunks: &[GoCompletionResponse]) -> &GoCompletionResponse {
    let l = chunks.last().expect("an empty stream");
    assert!(l.done, "the stream ended without Done: {l:?}");
    l
}

fn golden_ids(name: &str) -> Vec<u32> {
    golden(name)["text.greedy_continuation"]
        .to_vec::<i32>()
        .unwrap()
        .into_iter()
        .map(|t| t as u32)
        .collect()
}

/// A request with `temperature: 0` reaches the runner with no temperature key at all; it must be
/// greedy, token for token the continuation transformers computed (the fixture's golden
/// reference), and with EOS not counted in `EvalCount`.
fn greedy_when_temperature_is_omitted(name: &str, extra: &[&str]) {
    let p = GoParent::load(&fixture(name), extra);
    let ids = golden_ids(name);
    let tok = models::Tokenizer::load(&fixture(name)).unwrap();
    let eos = tok.eos_ids().contains(ids.last().unwrap());
    let emitted = if eos { &ids[..ids.len() - 1] } else { &ids[..] };
    let mut req = GoCompletionRequest::new(TEXT_PROMPT, GoOptions::greedy(ids.len() as i64));
    let sent = serde_json::to_value(&req).unwrap();
    assert!(sent["Options"].get("temperature").is_none(), "{sent}");
    assert_eq!(sent["Media"], Value::Null);
    let plain = p.completion(&req).unwrap();
    req.logprobs = true;
    req.top_logprobs = 2;
    let with_logprobs = p.completion(&req).unwrap();
    // The tokens, through their logprob entries (text may hold invalid UTF-8 from a random
    // model, which detokenisation of the whole run would render differently).
    let entries: Vec<&GoLogprob> = with_logprobs
        .iter()
        .filter_map(|c| c.logprobs.as_ref())
        .flatten()
        .collect();
    let got: Vec<String> = entries.iter().map(|e| e.token.clone()).collect();
    let want: Vec<String> = emitted.iter().map(|&i| tok.token_text(i)).collect();
    assert_eq!(got, want, "{name}: greedy continuation");
    assert!(entries.iter().all(|e| e.top_logprobs.len() == 2));
    assert_eq!(
        text(&plain),
        text(&with_logprobs),
        "{name}: drafting or not"
    );
    for chunks in [&plain, &with_logprobs] {
        let d = last(chunks);
        assert_eq!(
            d.eval_count,
            emitted.len() as i64,
            "{name}: EOS is not counted"
        );
        assert_eq!(d.done_reason, if eos { 0 } else { 1 });
        assert!(d.prompt_eval_count > 0 && d.prompt_eval_duration > 0 && d.eval_duration > 0);
    }
    // Logprobs only when asked (TopLogprobs alone asks for nothing), and never in a chunk
    // without text.
    assert!(plain.iter().all(|c| c.logprobs.is_none()));
    req.logprobs = false;
    let top_only = p.completion(&req).unwrap();
    assert!(top_only.iter().all(|c| c.logprobs.is_none()));
    for c in &with_logprobs {
        if c.logprobs.is_some() {
            assert!(
                !c.content.is_empty(),
                "logprobs apart from their text: {c:?}"
            );
        }
    }
    assert!(p.close(), "the runner exits on SIGINT");
}

#[test]
fn gemma4_temperature_omitted_is_greedy() {
    greedy_when_temperature_is_omitted("gemma4_e2b_like", &[]);
}

#[test]
fn glm_temperature_omitted_is_greedy_and_eos_is_not_counted() {
    // GLM drafts with its MTP layer (except for the logprob request), and its reference
    // continuation ends with EOS.
    let ids = golden_ids("glm4_moe_lite");
    let tok = models::Tokenizer::load(&fixture("glm4_moe_lite")).unwrap();
    assert!(tok.eos_ids().contains(ids.last().unwrap()));
    greedy_when_temperature_is_omitted("glm4_moe_lite", &[]);
}

/// Seed 0 is not sent (omitempty) and means seeded: the same request gives the same output
/// every time, with a drafter loaded, whatever ran in between (other requests train the shared
/// depth controller, which must not change a seeded request's draws).
fn seeded_is_reproducible(name: &str, extra: &[&str]) {
    let p = GoParent::load(&fixture(name), extra);
    let seeded = GoCompletionRequest::new(
        TEXT_PROMPT,
        GoOptions {
            seed: 0,
            num_predict: 24,
            ..GoOptions::defaults()
        },
    );
    assert!(serde_json::to_value(&seeded).unwrap()["Options"]
        .get("seed")
        .is_none());
    let first = p.completion(&seeded).unwrap();
    let mut drafted = last(&first).eval_count;
    for i in 0..3 {
        // Something else in between: unseeded sampling and greedy requests.
        let other = GoCompletionRequest::new(
            if i % 2 == 0 { "Hello" } else { TEXT_PROMPT },
            GoOptions {
                num_predict: 16,
                temperature: if i == 1 { 0.0 } else { 1.0 },
                ..GoOptions::defaults()
            },
        );
        p.completion(&other).unwrap();
        let again = p.completion(&seeded).unwrap();
        assert_eq!(text(&again), text(&first), "{name}: run {} differs", i + 2);
        drafted += last(&again).eval_count;
    }
    assert!(drafted > 0);
    // A different seed draws differently (random weights give a spread-out distribution).
    let other_seed = GoCompletionRequest::new(
        TEXT_PROMPT,
        GoOptions {
            seed: 12345,
            num_predict: 24,
            ..GoOptions::defaults()
        },
    );
    assert_ne!(text(&p.completion(&other_seed).unwrap()), text(&first));
}

#[test]
fn glm_seed_zero_omitted_is_reproducible_with_mtp_drafting() {
    seeded_is_reproducible("glm4_moe_lite", &[]);
}

#[test]
fn gemma4_seed_zero_omitted_is_reproducible_with_the_assistant() {
    let draft = fixture("gemma4_assistant");
    seeded_is_reproducible("gemma4_e2b_like", &["--draft", draft.to_str().unwrap()]);
}

/// Values ollama's sampler accepts are normalised, not refused: top_k −1 and top_p 1.5 turn
/// those filters off, exactly as leaving them out (zero) does.
#[test]
fn out_of_range_filters_are_normalised_not_refused() {
    let p = GoParent::load(&fixture("gemma4_e2b_like"), &[]);
    let with = |top_k: i64, top_p: f32| {
        let req = GoCompletionRequest::new(
            TEXT_PROMPT,
            GoOptions {
                seed: 7,
                num_predict: 12,
                top_k,
                top_p,
                ..GoOptions::defaults()
            },
        );
        text(&p.completion(&req).unwrap())
    };
    let off = with(0, 0.0);
    assert_eq!(with(-1, 0.0), off, "top_k -1");
    assert_eq!(with(0, 1.5), off, "top_p 1.5");
    assert_eq!(with(-1, -3.0), off, "both");
}

/// Errors reach the user as the parent shows them: the body of a non-200 is the message, as
/// plain text.
#[test]
fn refusals_read_cleanly_through_the_parent() {
    let p = GoParent::load(&fixture("gemma4_e2b_like"), &["--ctx-size", "64"]);
    assert_eq!(p.status.status, 0);
    assert_eq!(p.status.progress, 100);
    assert_eq!(p.status.context_length, 64);
    assert!(p.status.memory > 0);
    let cases = [
        (
            GoCompletionRequest {
                media: Some(vec![GoMedia {
                    data: "iVBORw0KGgo=".into(),
                    id: 0,
                    kind: 0,
                }]),
                ..GoCompletionRequest::new("[img-0] What is in this picture?", GoOptions::greedy(4))
            },
            "this model does not support images",
        ),
        (
            GoCompletionRequest::new(&"word ".repeat(200), GoOptions::greedy(4)),
            "prompt is too long",
        ),
        (
            GoCompletionRequest::new("", GoOptions::greedy(4)),
            "prompt is empty",
        ),
        (
            GoCompletionRequest {
                top_logprobs: 21,
                logprobs: true,
                ..GoCompletionRequest::new("Hi", GoOptions::greedy(4))
            },
            "TopLogprobs must be in [0, 20]",
        ),
    ];
    for (req, want) in cases {
        match p.completion(&req) {
            Err(GoError::Status { code, message }) => {
                assert_eq!(code, 400);
                assert!(message.starts_with(want), "{message}");
                assert!(
                    !message.starts_with('{'),
                    "a JSON body shown to the user: {message}"
                );
            }
            other => panic!("{want}: {other:?}"),
        }
    }
    // `/v1/models` and `/load` answer as ollama's runner does: the model is already loaded.
    for (method, path) in [
        ("GET", "/v1/models"),
        ("POST", "/v1/models"),
        ("POST", "/load"),
    ] {
        let r = ureq::request(method, &p.url(path)).call().unwrap();
        let v: Value = serde_json::from_str(&r.into_string().unwrap()).unwrap();
        assert_eq!(v, json!({"Success": true}), "{method} {path}");
    }
    // Still serving.
    let ok = p
        .completion(&GoCompletionRequest::new("Hi", GoOptions::greedy(3)))
        .unwrap();
    assert_eq!(last(&ok).eval_count, 3);
}

/// A runner that is told to stop (the parent's `Close` sends SIGINT) ends a running stream with
/// an error, so the parent reports a failure rather than a success with a truncated answer.
#[test]
fn sigint_mid_stream_is_an_error_for_the_parent() {
    let p = GoParent::load(&fixture("gemma4_e2b_like"), &[]);
    let req = GoCompletionRequest::new(TEXT_PROMPT, GoOptions::greedy(-1));
    let (tx, rx) = std::sync::mpsc::channel();
    let result = std::thread::scope(|s| {
        let stream = s.spawn(|| {
            p.completion_with(&req, |_| {
                let _ = tx.send(());
            })
        });
        rx.recv_timeout(Duration::from_secs(30))
            .expect("the stream started");
        // SAFETY: kill with a valid pid and signal has no memory-safety preconditions.
        unsafe { libc::kill(p.child.id() as i32, libc::SIGINT) };
        stream.join().unwrap()
    });
    match result {
        Err(GoError::Stream(e)) => {
            assert_eq!(e.status_code, 500);
            assert!(e.error.contains("shutting down"), "{e:?}");
        }
        other => panic!("the parent saw {other:?}"),
    }
    assert!(p.close(), "the runner exited");
}

/// The tokens the runner's caches hold after a greedy completion of `prompt`: the prompt's
/// and every generated token but the last (the last is emitted, never fed).
fn fed_after(p: &GoParent, prompt: &str, answer: &[u32]) -> Vec<u32> {
    let mut ids = tokenize(p, prompt);
    ids.extend_from_slice(&answer[..answer.len() - 1]);
    ids
}

fn tokenize(p: &GoParent, text: &str) -> Vec<u32> {
    let body = ureq::post(&p.url("/v1/tokenize"))
        .send_string(text)
        .unwrap()
        .into_string()
        .unwrap();
    serde_json::from_str(&body).unwrap()
}

fn detokenize(p: &GoParent, ids: &[u32]) -> String {
    let r = ureq::post(&p.url("/v1/detokenize"))
        .send_string(&serde_json::to_string(ids).unwrap())
        .unwrap();
    let v: Value = serde_json::from_str(&r.into_string().unwrap()).unwrap();
    v["Content"].as_str().unwrap().to_string()
}

/// Where the next turn's prompt leaves what the caches hold.
fn divergence(p: &GoParent, next: &str, fed: &[u32]) -> usize {
    tokenize(p, next)
        .iter()
        .zip(fed)
        .take_while(|(a, b)| a == b)
        .count()
}

/// The next turn keeps the first `keep` tokens of the previous answer and then says something
/// else (a parent that re-renders or edits the answer). Returns the divergence point and the
/// `CachedTokens` the runner reported.
fn next_turn_reuse(p: &GoParent, name: &str, keep: usize) -> (usize, usize, usize) {
    let answer = golden_ids(name);
    let first = p
        .completion(&GoCompletionRequest::new(
            TEXT_PROMPT,
            GoOptions::greedy(answer.len() as i64),
        ))
        .unwrap();
    let prompt_len = last(&first).prompt_eval_count as usize;
    let fed = fed_after(p, TEXT_PROMPT, &answer);
    let next = format!(
        "{TEXT_PROMPT}{} But that is another story.",
        detokenize(p, &answer[..keep])
    );
    let d = divergence(p, &next, &fed);
    assert!(
        d > prompt_len,
        "{name}: the next turn leaves the answer at once ({d} ≤ {prompt_len})"
    );
    // The raw protocol reports CachedTokens (our addition, which a Go parent ignores).
    let raw = json!({"Prompt": next, "Options": {"num_predict": 1}});
    let lines: Vec<Value> = ureq::post(&p.url("/completion"))
        .send_string(&raw.to_string())
        .unwrap()
        .into_string()
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let cached = lines.last().unwrap()["CachedTokens"].as_u64().unwrap() as usize;
    (prompt_len, d, cached)
}

/// A chat whose next turn diverges inside the previous answer reuses the answer up to the
/// divergence point: gemma4's sliding-window layers are snapshotted while generating too (every
/// `--cache-interval` positions; 2 here, so that a snapshot lies on the divergence point).
#[test]
fn gemma4_next_turn_diverging_inside_the_answer_reuses_it() {
    let p = GoParent::load(&fixture("gemma4_e2b_like"), &["--cache-interval", "2"]);
    let (prompt_len, d, cached) = next_turn_reuse(&p, "gemma4_e2b_like", 6);
    let reachable = d / 2 * 2;
    assert!(cached > prompt_len, "only the prompt was reused: {cached}");
    assert_eq!(cached, reachable, "divergence at {d}");
}

// GLM's random fixture writes bytes that do not survive detokenising and tokenising again, so
// a text prompt cannot diverge inside its answer; `crates/runner/tests/reuse.rs` shows the same
// for GLM (drafting and not) and gemma4 with token-id prompts through the engine.

#[test]
fn stderr_is_the_runners_only_output() {
    // The parent reads the child's stdout and stderr into one status writer and keeps the last
    // error line for its messages; stdout must stay quiet so that nothing else lands there.
    let mut c = binary()
        .args(["runner", "--mlx-engine", "--model"])
        .arg(fixture("gemma4_e2b_like"))
        .args(["--port", &free_port().to_string()])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    // SAFETY: kill with a valid pid and signal has no memory-safety preconditions.
    unsafe { libc::kill(c.id() as i32, libc::SIGINT) };
    wait_timeout(&mut c, Duration::from_secs(10)).expect("exits on SIGINT");
    let mut out = String::new();
    c.stdout.take().unwrap().read_to_string(&mut out).unwrap();
    assert!(out.is_empty(), "stdout: {out}");
}
