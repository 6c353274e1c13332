//! One completion through a runner, for either API: find the model, merge its options, render
//! the prompt, hold a runner, forward the request, and turn the runner's chunks into parsed
//! pieces (content, thinking, tool calls) and a final summary.

use crate::catalog::{FindError, Model};
use crate::client::RunnerError;
use crate::client::{self, Chunk, CompletionRequest, TokenLogprob};
use crate::options;
use crate::parse::{self, Parsed};
use crate::sched::{KeepAlive, Lease, LoadError, Runner, Target};
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
    /// Images of a raw prompt (ollama's `/api/generate` with `raw`), base64: its own `[img-N]`
    /// tags name them 0, 1, ... Images of messages ride in the messages (`images`).
    pub raw_images: Vec<String>,
}

/// A message's or a raw prompt's images as the runner takes them, numbered in order across the
/// messages; each message's content gets their `[img-N]` tags, in place of its `[img]` markers
/// or before its text (ollama's `imageTaggedMessages`). Audio rides the same way (ollama sends
/// clips as images); an image is refused for a model without vision, a clip (WAV, MP3, FLAC,
/// Ogg by its first bytes) for one without audio.
fn tag_images(m: &Model, input: &Input) -> Result<(Vec<Value>, Vec<Value>), ApiError> {
    let mut media = Vec::new();
    let mut messages = input.messages.clone();
    if input.raw.is_some() {
        for (i, data) in input.raw_images.iter().enumerate() {
            media.push(serde_json::json!({"data": data, "id": i}));
        }
    } else {
        for msg in &mut messages {
            let Some(images) = msg.get("images").and_then(Value::as_array).cloned() else {
                continue;
            };
            let offset = media.len();
            for data in images.iter() {
                media.push(serde_json::json!({"data": data, "id": media.len()}));
            }
            let content = msg["content"].as_str().unwrap_or_default();
            let content = tagged_content(content, offset, images.len());
            if let Some(o) = msg.as_object_mut() {
                o.remove("images");
                o.insert("content".into(), Value::from(content));
            }
        }
    }
    let caps = m.capabilities();
    for item in &media {
        let (needs, what) = if media_is_audio(item["data"].as_str().unwrap_or_default()) {
            ("audio", "audio")
        } else {
            ("vision", "images")
        };
        if !caps.iter().any(|c| c == needs) {
            return Err(ApiError::bad(format!(
                "{} does not support {what}",
                m.display()
            )));
        }
    }
    Ok((messages, media))
}

/// A message's content with `[img-N]` tags for its `count` media items numbered from `offset`
/// (ollama's `renderContentWithImageTags`): content that already names tags is left as it is;
/// else each `[img]` marker takes the next tag and the rest go in front, a space between them
/// and content that starts with a non-space character.
fn tagged_content(content: &str, offset: usize, count: usize) -> String {
    if count == 0 || content.contains("[img-") {
        return content.to_string();
    }
    let mut content = content.to_string();
    let mut prefix = String::new();
    for i in 0..count {
        let tag = format!("[img-{}]", offset + i);
        if content.contains("[img]") {
            content = content.replacen("[img]", &tag, 1);
        } else {
            prefix.push_str(&tag);
        }
    }
    if !prefix.is_empty() && content.chars().next().is_some_and(|c| !c.is_whitespace()) {
        prefix.push(' ');
    }
    prefix + &content
}

/// Whether base64 `data` is an audio clip, by its first bytes (the 12 that 16 characters hold).
fn media_is_audio(data: &str) -> bool {
    use base64::Engine;
    let head = data.get(..16.min(data.len())).unwrap_or_default();
    base64::engine::general_purpose::STANDARD
        .decode(head)
        .ok()
        .and_then(|b| base::protocol::audio_kind(&b))
        .is_some()
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
        size: m.size,
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

/// The prompt `input` renders to for `m`, and the images its `[img-N]` tags name: the raw
/// prompt, or the messages (with the model's SYSTEM and MESSAGEs first) through its chat
/// template, rendered under [`template::LIMITS`] in a render worker.
pub async fn prompt(app: &App, m: &Model, input: &Input) -> Result<(String, Vec<Value>), ApiError> {
    let (tagged, media) = tag_images(m, input)?;
    let text = render(app, m, input, tagged).await?;
    Ok((text, media))
}

async fn render(
    app: &App,
    m: &Model,
    input: &Input,
    tagged: Vec<Value>,
) -> Result<String, ApiError> {
    let max = template::LIMITS.max_output;
    if let Some(raw) = &input.raw {
        if raw.len() > max {
            return Err(ApiError::bad(format!(
                "the prompt is {} bytes, larger than the {max} bytes a runner accepts",
                raw.len()
            )));
        }
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
    messages.extend(tagged);
    let Some(source) = template_source(m, input) else {
        // No template at all: the messages' text, in order.
        let text = messages
            .iter()
            .filter_map(|m| m["content"].as_str())
            .collect::<Vec<_>>()
            .join("\n");
        if text.len() > max {
            return Err(ApiError::bad(
                template::RenderError::TooLarge(max).to_string(),
            ));
        }
        return Ok(text);
    };
    let ctx = template::OwnedContext {
        messages,
        tools: (!input.tools.is_empty()).then(|| input.tools.clone()),
        // Always, as ollama's renderers do: a conversation that ends with an assistant
        // message gets a new assistant turn.
        add_generation_prompt: true,
        bos_token: m.special_token("bos_token"),
        eos_token: m.special_token("eos_token"),
        enable_thinking: input.think,
    };
    app.renderer
        .render(source, ctx, template::LIMITS)
        .await
        .map_err(|e| match e {
            template::RenderError::Unavailable(_) => ApiError::new(500, e.to_string()),
            _ => ApiError::bad(e.to_string()),
        })
}

/// Each tool as both APIs define one: `{"type": "function", "function": {"name": ...,
/// "description"?, "parameters"?}}`. One that is not is the client's mistake, refused rather than
/// passed to a template that would skip or mangle it.
fn check_tools(tools: &[Value]) -> Result<(), ApiError> {
    for (i, t) in tools.iter().enumerate() {
        let bad = |why: &str| Err(ApiError::bad(format!("invalid tool {i}: {why}")));
        let Some(t) = t.as_object() else {
            return bad("a tool must be an object");
        };
        match t.get("type") {
            None | Some(Value::Null) => {}
            Some(Value::String(s)) if s == "function" => {}
            Some(other) => return bad(&format!("type must be \"function\", got {other}")),
        }
        let Some(f) = t.get("function").and_then(Value::as_object) else {
            return bad("function must be an object with a name");
        };
        match f.get("name") {
            Some(Value::String(n)) if !n.trim().is_empty() => {}
            _ => return bad("function.name must be a non-empty string"),
        }
        if let Some(p) = f.get("parameters") {
            if !(p.is_object() || p.is_null()) {
                return bad("function.parameters must be a JSON Schema object");
            }
        }
        if let Some(d) = f.get("description") {
            if !(d.is_string() || d.is_null()) {
                return bad("function.description must be a string");
            }
        }
    }
    Ok(())
}

/// What the request decides before anything is rendered, for a completion and for a token count
/// alike: tools checked, a forced call's grammar as the format, thinking on or off (refused where
/// the model or the format cannot have it), and the merged options.
fn decide(app: &App, m: &Model, input: &mut Input) -> Result<(Map<String, Value>, bool), ApiError> {
    check_tools(&input.tools)?;
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
    Ok((opts, thinking))
}

/// Starts a completion: everything that can be refused is refused before the stream starts.
pub async fn start(app: &Arc<App>, m: &Model, mut input: Input) -> Result<Running, ApiError> {
    let started = Instant::now();
    let (mut opts, thinking) = decide(app, m, &mut input)?;
    let (prompt, media) = prompt(app, m, &input).await?;
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
        media,
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
        let answer = watched(
            app,
            &lease.runner,
            client::complete(&app.sched.client, lease.runner.port, &req),
        )
        .await
        .unwrap_or_else(Err);
        match answer {
            Ok(chunks) => break (lease, chunks, load_duration),
            Err(e) if e.unreachable && attempt == 0 => {
                attempt += 1;
                if !lease.runner.exited_within(Duration::from_secs(2)).await {
                    return Err(ApiError::new(500, e.message));
                }
                tracing::warn!(model = %m.display(), "the runner died; starting a new one");
            }
            Err(e) => {
                let mut msg = e.message;
                if lease.runner.frozen() {
                    msg = frozen_error(app.sched.stall_timeout()).message;
                } else if !lease.runner.alive() {
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
        events: Box::pin(events(
            watch_stream(app.clone(), lease.runner.clone(), chunks),
            parser,
            lease,
        )),
    })
}

/// How often a runner that has said nothing is asked whether it is still there.
const PROBE_EVERY: Duration = Duration::from_secs(5);

/// `fut` (a call to `runner`), or an error once the runner has gone quiet: no answer for
/// [`PROBE_EVERY`] and then no status answer within the stall timeout. A runner that is
/// merely busy (a long prefill, a queue behind `--parallel` requests) answers its status, and
/// is waited on.
async fn watched<T>(
    app: &App,
    runner: &Runner,
    fut: impl std::future::Future<Output = T>,
) -> Result<T, client::RunnerError> {
    tokio::pin!(fut);
    let stall = app.sched.stall_timeout();
    loop {
        tokio::select! {
            out = &mut fut => return Ok(out),
            _ = tokio::time::sleep(PROBE_EVERY.min(stall)) => {}
        }
        let quiet = Instant::now();
        let answered = tokio::select! {
            out = &mut fut => return Ok(out),
            ok = runner.responsive(&app.sched.client, stall) => ok,
        };
        if !answered && runner.alive() {
            runner.kill_frozen(quiet.elapsed());
            return Err(frozen_error(stall));
        }
    }
}

fn frozen_error(stall: Duration) -> client::RunnerError {
    client::RunnerError {
        status: 500,
        message: format!(
            "the model runner stopped responding (no token and no status answer for {} s) and was stopped; the next request starts a new one",
            stall.as_secs_f64()
        ),
        // Never reached it: the request may be tried again on a new runner.
        unreachable: true,
        lost: true,
    }
}

/// A lost connection's error in the runner's terms: frozen, or dead with its last words. Its
/// exit may take a moment to be known (its last lines are read first).
async fn explained(app: &App, runner: &Runner, e: RunnerError) -> RunnerError {
    if !e.lost {
        return e;
    }
    // A frozen one was killed: it too is known dead in a moment.
    runner.exited_within(Duration::from_secs(2)).await;
    let message = if runner.frozen() {
        frozen_error(app.sched.stall_timeout()).message
    } else if !runner.alive() {
        format!(
            "the model runner exited unexpectedly: {}",
            runner.last_error()
        )
    } else {
        e.message
    };
    RunnerError { message, ..e }
}

/// The runner's chunks, each awaited under [`watched`].
fn watch_stream(
    app: Arc<App>,
    runner: Arc<Runner>,
    chunks: impl Stream<Item = Result<Chunk, client::RunnerError>> + Send + 'static,
) -> impl Stream<Item = Result<Chunk, client::RunnerError>> + Send + 'static {
    let chunks = Box::pin(chunks);
    futures::stream::unfold(Some(chunks), move |st| {
        let (app, runner) = (app.clone(), runner.clone());
        async move {
            let mut chunks = st?;
            match watched(&app, &runner, chunks.next()).await {
                Ok(Some(Ok(c))) => Some((Ok(c), Some(chunks))),
                Ok(Some(Err(e))) => Some((Err(explained(&app, &runner, e).await), None)),
                Ok(None) => None,
                Err(e) => Some((
                    Err(RunnerError {
                        unreachable: false,
                        ..e
                    }),
                    None,
                )),
            }
        }
    })
}

/// How many tokens `input`'s prompt is for `m`, by its runner's tokenizer (the runner is loaded
/// for it), rendered as its completion would render it.
pub async fn count_tokens(app: &Arc<App>, m: &Model, mut input: Input) -> Result<u64, ApiError> {
    // The prompt the completion would render: a forced call or a format turns thinking off.
    decide(app, m, &mut input)?;
    let (prompt, media) = prompt(app, m, &input).await?;
    if !media.is_empty() {
        return Err(ApiError::bad(
            "counting the tokens of a prompt with images is not supported",
        ));
    }
    let ka = keep_alive(app, input.keep_alive);
    let lease = app.sched.acquire(&target(m), ka).await?;
    let ids = watched(
        app,
        &lease.runner,
        client::tokenize(&app.sched.client, lease.runner.port, &prompt),
    )
    .await
    .unwrap_or_else(Err)
    .map_err(|e| ApiError::new(e.status, e.message))?;
    Ok(ids.len() as u64)
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
                Err(e) => vec![Event::Error(ApiError::new(e.status.max(500), e.message))],
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
    #[test]
    fn media_tags_go_where_ollamas_renderer_puts_them() {
        use super::tagged_content as t;
        assert_eq!(t("What is this?", 0, 1), "[img-0] What is this?");
        assert_eq!(t(" spaced", 2, 2), "[img-2][img-3] spaced");
        assert_eq!(t("", 0, 1), "[img-0]");
        assert_eq!(t("a [img] b [img]", 1, 2), "a [img-1] b [img-2]");
        assert_eq!(t("one [img] marker", 0, 2), "[img-1] one [img-0] marker");
        // Tags already there: left alone.
        assert_eq!(t("see [img-7]", 0, 1), "see [img-7]");
        assert_eq!(t("x", 0, 0), "x");
    }
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
