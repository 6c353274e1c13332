//! One completion through a runner, for either API: find the model, merge its options, render
//! the prompt, hold a runner, forward the request, and turn the runner's chunks into parsed
//! pieces (content, thinking, tool calls) and a final summary.

use crate::catalog::{FindError, Model};
use crate::client::{self, Chunk, CompletionRequest, TokenLogprob};
use crate::options;
use crate::parse::{self, Parsed};
use crate::sched::{KeepAlive, Lease, LoadError, Target};
use crate::template;
use crate::App;
use futures::{Stream, StreamExt};
use serde_json::{Map, Value};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// An API error: its HTTP status and message (each API shapes the body its own way).
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: u16,
    pub message: String,
}

impl ApiError {
    pub fn new(status: u16, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
        }
    }

    pub fn bad(message: impl Into<String>) -> ApiError {
        ApiError::new(400, message)
    }
}

impl From<FindError> for ApiError {
    fn from(e: FindError) -> ApiError {
        match e {
            FindError::BadName(m) => ApiError::bad(m),
            FindError::NotFound(_) => ApiError::new(404, e.to_string()),
            FindError::Store(e) => ApiError::new(500, e.to_string()),
        }
    }
}

impl From<LoadError> for ApiError {
    fn from(e: LoadError) -> ApiError {
        let status = match e {
            LoadError::Busy(_) | LoadError::ShuttingDown => 503,
            LoadError::Failed(_) => 500,
        };
        ApiError::new(status, e.to_string())
    }
}

/// What a completion asks for, in either API's terms.
#[derive(Debug, Clone, Default)]
pub struct Input {
    pub model: String,
    /// Chat messages (ollama's `api.Message` shape); ignored when `raw` is set.
    pub messages: Vec<Value>,
    /// A prompt sent as it is (ollama's `raw`, OpenAI's completions).
    pub raw: Option<String>,
    pub tools: Vec<Value>,
    pub think: Option<bool>,
    /// A template for this request only (ollama's `template`).
    pub template: Option<String>,
    pub options: Map<String, Value>,
    pub format: Value,
    pub logprobs: bool,
    pub top_logprobs: i32,
    pub keep_alive: Option<KeepAlive>,
    /// The answer must be a call of one of `tools` (OpenAI's `tool_choice`).
    pub forced: Option<crate::forced::Forced>,
}

/// A running completion.
pub struct Running {
    pub model: String,
    pub started: Instant,
    pub load_duration: Duration,
    /// The rendered prompt.
    pub prompt: String,
    pub events: std::pin::Pin<Box<dyn Stream<Item = Event> + Send>>,
}

#[derive(Debug, Clone)]
pub enum Event {
    Piece {
        parsed: Parsed,
        logprobs: Vec<TokenLogprob>,
    },
    Done(Summary),
    Error(ApiError),
}

#[derive(Debug, Clone, Default)]
pub struct Summary {
    /// `stop` or `length`.
    pub done_reason: &'static str,
    pub prompt_eval_count: u64,
    pub prompt_eval_duration: u64,
    pub eval_count: u64,
    pub eval_duration: u64,
}

/// The keep-alive a request asks for, else the server's default.
pub fn keep_alive(app: &App, asked: Option<KeepAlive>) -> KeepAlive {
    asked.unwrap_or(app.cfg.keep_alive)
}

pub fn find(app: &App, name: &str) -> Result<Model, ApiError> {
    if name.trim().is_empty() {
        return Err(ApiError::bad("model is required"));
    }
    Ok(app.catalog.find(name)?)
}

pub fn target(m: &Model) -> Target {
    Target {
        name: m.name.to_string(),
        digest: m.digest().to_string(),
        ctx_size: None,
    }
}

/// Loads `model` (the empty-prompt request: load, or unload with `keep_alive: 0`).
pub async fn load_only(app: &Arc<App>, m: &Model, ka: KeepAlive) -> Result<&'static str, ApiError> {
    if ka == KeepAlive::For(Duration::ZERO) {
        app.sched.unload_model(&m.name.to_string()).await;
        return Ok("unload");
    }
    drop(app.sched.acquire(&target(m), ka).await?);
    Ok("load")
}

/// The Jinja source that renders `m`'s prompts.
fn template_source(m: &Model, input: &Input) -> Option<String> {
    input
        .template
        .clone()
        .filter(|t| !t.is_empty())
        .or_else(|| m.modelfile.template.clone())
        .or_else(|| m.chat_template())
        .or_else(|| template::builtin(&m.family).map(String::from))
}

/// The prompt `input` renders to for `m`: the raw prompt, or the messages (with the model's
/// SYSTEM and MESSAGEs first) through its chat template.
pub fn prompt(m: &Model, input: &Input) -> Result<String, ApiError> {
    if let Some(raw) = &input.raw {
        return Ok(raw.clone());
    }
    let mut messages: Vec<Value> = Vec::new();
    let has_system = input.messages.iter().any(|m| m["role"] == "system");
    if let (Some(system), false) = (&m.modelfile.system, has_system) {
        messages.push(serde_json::json!({"role": "system", "content": system}));
    }
    for msg in &m.modelfile.messages {
        messages.push(serde_json::json!({"role": msg.role, "content": msg.content}));
    }
    messages.extend(input.messages.iter().cloned());
    let Some(source) = template_source(m, input) else {
        // No template at all: the messages' text, in order.
        return Ok(messages
            .iter()
            .filter_map(|m| m["content"].as_str())
            .collect::<Vec<_>>()
            .join("\n"));
    };
    let bos = m.special_token("bos_token");
    let eos = m.special_token("eos_token");
    let ctx = template::Context {
        messages: &messages,
        tools: (!input.tools.is_empty()).then_some(input.tools.as_slice()),
        // Always, as ollama's renderers do: a conversation that ends with an assistant
        // message gets a new assistant turn.
        add_generation_prompt: true,
        bos_token: &bos,
        eos_token: &eos,
        enable_thinking: input.think,
    };
    template::render(&source, &ctx).map_err(|e| ApiError::new(500, e))
}

/// Starts a completion: everything that can be refused is refused before the stream starts.
pub async fn start(app: &Arc<App>, m: &Model, mut input: Input) -> Result<Running, ApiError> {
    let started = Instant::now();
    if let Some(forced) = &input.forced {
        if !input.format.is_null() {
            return Err(ApiError::bad(
                "a required tool call cannot be combined with a response format",
            ));
        }
        let special = app.special_tokens(m);
        let lookup = |t: &str| special.get(t).copied();

        let marks = crate::forced::Marks { special: &lookup };
        let g = crate::forced::grammar(&m.family, &input.tools, forced, &marks)
            .map_err(ApiError::bad)?;
        input.format = Value::String(g);
        // The call is the whole answer: no thought before it.
        input.think = Some(false);
    }
    if !input.format.is_null() && input.forced.is_none() {
        // The runner enforces a format from the first token: a thought would have to be
        // JSON too. Thinking is off unless asked for, and then refused.
        if input.think == Some(true) && !m.family.is_empty() {
            return Err(ApiError::bad(
                "think cannot be combined with format: the format applies from the first token; set think to false",
            ));
        }
        input.think = Some(false);
    }
    let mut opts = options::defaults(options::DEFAULT_NUM_CTX);
    options::apply(&mut opts, &m.parameters()).map_err(ApiError::bad)?;
    options::apply(&mut opts, &input.options).map_err(ApiError::bad)?;
    let can_think = m.capabilities().iter().any(|c| c == "thinking");
    let thinking = input.think.unwrap_or(true) && can_think;
    if input.think == Some(true) && !can_think {
        return Err(ApiError::bad(format!(
            "\"{}\" does not support thinking",
            m.display()
        )));
    }
    if !input.tools.is_empty() && !m.capabilities().iter().any(|c| c == "tools") {
        return Err(ApiError::bad(format!(
            "registry.ollama.ai/library/{} does not support tools",
            m.display()
        )));
    }
    if can_think {
        // Thinking-capable models think unless told not to (ollama sets `think` so too); the
        // template hears the decision.
        input.think = Some(thinking);
    }
    let prompt = prompt(m, &input)?;
    let family = if input.raw.is_some() {
        ""
    } else {
        m.family.as_str()
    };
    options::add_stops(&mut opts, parse::stops(family));
    if opts["stop"].as_array().is_some_and(Vec::is_empty) {
        opts.remove("stop");
    }
    let req = CompletionRequest {
        prompt: prompt.clone(),
        options: options::omit_empty(opts),
        logprobs: input.logprobs,
        top_logprobs: input.top_logprobs,
        format: input.format.clone(),
    };
    let ka = keep_alive(app, input.keep_alive);
    // A runner that died a moment ago may not be known dead yet: when the request cannot
    // reach it, wait for its death to be noticed and start a new one, once.
    let mut attempt = 0;
    let (lease, chunks, load_duration) = loop {
        let lease = app.sched.acquire(&target(m), ka).await?;
        let load_duration = started.elapsed();
        match client::complete(&app.sched.client, lease.runner.port, &req).await {
            Ok(chunks) => break (lease, chunks, load_duration),
            Err(e) if e.unreachable && attempt == 0 => {
                attempt += 1;
                let deadline = Instant::now() + Duration::from_secs(2);
                while lease.runner.alive() && Instant::now() < deadline {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                if lease.runner.alive() {
                    return Err(ApiError::new(500, e.message));
                }
                tracing::warn!(model = %m.display(), "the runner died; starting a new one");
            }
            Err(e) => {
                let mut msg = e.message;
                if !lease.runner.alive() {
                    msg = format!("the runner exited: {}", lease.runner.last_error());
                }
                return Err(ApiError::new(e.status, msg));
            }
        }
    };
    tracing::debug!(
        model = %m.display(),
        prepare_us = started.elapsed().as_micros() as u64,
        "completion forwarded"
    );
    let parser = parse::parser(family, &input.tools, thinking, &prompt);
    Ok(Running {
        // The name as the request gave it, as ollama echoes it.
        model: input.model.clone(),
        started,
        load_duration,
        prompt,
        events: Box::pin(events(chunks, parser, lease)),
    })
}

/// A whole answer, for a request that does not stream: every piece joined, and the summary.
pub async fn collect(
    mut events: std::pin::Pin<Box<dyn Stream<Item = Event> + Send>>,
) -> Result<(Parsed, Vec<TokenLogprob>, Summary), ApiError> {
    let (mut all, mut lps) = (Parsed::default(), Vec::new());
    while let Some(ev) = events.next().await {
        match ev {
            Event::Piece { parsed, logprobs } => {
                all.content.push_str(&parsed.content);
                all.thinking.push_str(&parsed.thinking);
                all.tool_calls.extend(parsed.tool_calls);
                lps.extend(logprobs);
            }
            Event::Done(s) => return Ok((all, lps, s)),
            Event::Error(e) => return Err(e),
        }
    }
    Err(ApiError::new(500, "the completion ended without an answer"))
}

/// The runner's chunks as parsed events; the lease lives as long as the stream.
fn events(
    chunks: impl Stream<Item = Result<Chunk, client::RunnerError>> + Send + 'static,
    mut parser: Box<dyn parse::OutputParser>,
    lease: Lease,
) -> impl Stream<Item = Event> + Send {
    chunks
        .map(move |c| {
            let _hold = &lease;
            match c {
                Err(e) => {
                    let msg = if lease.runner.alive() {
                        e.message
                    } else {
                        format!(
                            "the model runner exited unexpectedly: {}",
                            lease.runner.last_error()
                        )
                    };
                    vec![Event::Error(ApiError::new(e.status.max(500), msg))]
                }
                Ok(c) => {
                    let parsed = parser.add(&c.content, c.done);
                    let mut out = Vec::new();
                    let logprobs = c.logprobs.clone().unwrap_or_default();
                    if !parsed.is_empty() || !logprobs.is_empty() {
                        out.push(Event::Piece { parsed, logprobs });
                    }
                    if c.done {
                        out.push(Event::Done(Summary {
                            done_reason: if c.done_reason == 1 { "length" } else { "stop" },
                            prompt_eval_count: c.prompt_eval_count,
                            prompt_eval_duration: c.prompt_eval_duration,
                            eval_count: c.eval_count,
                            eval_duration: c.eval_duration,
                        }));
                    }
                    out
                }
            }
        })
        .flat_map(futures::stream::iter)
}

/// Seconds-granular Go-style durations: `"5m"`, `"1h30m"`, `"10s"`, `"500ms"`, a number of
/// seconds, or a negative value for "forever".
pub fn parse_keep_alive(v: &Value) -> Result<Option<KeepAlive>, String> {
    let secs = match v {
        Value::Null => return Ok(None),
        Value::Number(n) => n.as_f64().unwrap_or(0.0),
        Value::String(s) if s.trim().is_empty() => return Ok(None),
        Value::String(s) => match s.trim().parse::<f64>() {
            Ok(n) => n,
            Err(_) => go_duration(s.trim()).ok_or_else(|| {
                format!("invalid keep_alive {s:?}: expected a duration like \"5m\"")
            })?,
        },
        other => return Err(format!("invalid keep_alive {other}: expected a duration")),
    };
    if !secs.is_finite() {
        return Err(format!("invalid keep_alive {v}: not a finite duration"));
    }
    // Past Go's longest duration (about 292 years) means forever.
    Ok(Some(if !(0.0..=9.2e9).contains(&secs) {
        KeepAlive::Forever
    } else {
        KeepAlive::For(Duration::from_secs_f64(secs))
    }))
}

/// Go's `time.ParseDuration`, in seconds.
pub fn go_duration(s: &str) -> Option<f64> {
    let (neg, mut rest) = match s.strip_prefix('-') {
        Some(r) => (true, r),
        None => (false, s.strip_prefix('+').unwrap_or(s)),
    };
    if rest == "0" {
        return Some(0.0);
    }
    let mut total = 0.0;
    let mut any = false;
    while !rest.is_empty() {
        let num_end = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let n: f64 = rest[..num_end].parse().ok()?;
        rest = &rest[num_end..];
        let unit_end = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let scale = match &rest[..unit_end] {
            "ns" => 1e-9,
            "us" | "µs" | "μs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            _ => return None,
        };
        rest = &rest[unit_end..];
        total += n * scale;
        any = true;
    }
    any.then_some(if neg { -total } else { total })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn keep_alive_reads_go_durations_and_numbers() {
        let f = |v: Value| parse_keep_alive(&v).unwrap();
        assert_eq!(
            f(json!("5m")),
            Some(KeepAlive::For(Duration::from_secs(300)))
        );
        assert_eq!(
            f(json!("1h30m")),
            Some(KeepAlive::For(Duration::from_secs(5400)))
        );
        assert_eq!(
            f(json!("250ms")),
            Some(KeepAlive::For(Duration::from_millis(250)))
        );
        assert_eq!(f(json!(0)), Some(KeepAlive::For(Duration::ZERO)));
        assert_eq!(f(json!("0")), Some(KeepAlive::For(Duration::ZERO)));
        assert_eq!(f(json!(-1)), Some(KeepAlive::Forever));
        assert_eq!(f(json!("-1m")), Some(KeepAlive::Forever));
        assert_eq!(f(json!(null)), None);
        assert!(parse_keep_alive(&json!("soon")).is_err());
        assert!(parse_keep_alive(&json!("nan")).is_err());
        assert!(parse_keep_alive(&json!("inf")).is_err());
        assert_eq!(f(json!(1e19)), Some(KeepAlive::Forever));
        assert!(parse_keep_alive(&json!("1e400")).is_err());
        assert!(parse_keep_alive(&json!([1])).is_err());
    }
}
