//! Prompts from chat messages: a Jinja chat template (the Modelfile's TEMPLATE, the model's own
//! `chat_template`, or our template for its family) rendered by minijinja with Python's string
//! and dict methods, as transformers renders it.
//!
//! A template is a program, and a request may bring its own (ollama's `template`, or one stored
//! with `/api/create`), so rendering is bounded ([`Limits`]): instructions by minijinja's fuel,
//! nesting by its recursion limit, the rendered text by its size. Fuel cannot bound memory (one
//! `{% set s = s ~ s %}` doubles a string), so `serve` renders in worker processes
//! ([`Renderer`]) whose memory the kernel caps, killed at a wall-clock bound or when their
//! request goes away: no template can hold serve's threads, memory or signals.

use crate::families;
use minijinja::{Environment, Error, ErrorKind, Value as JValue};
use serde::Serialize;

/// The bounds one render runs under.
#[derive(Debug, Clone, Copy, Serialize, serde::Deserialize)]
pub struct Limits {
    /// minijinja instructions (a loop's iteration is a few). The family templates use about
    /// 60 a message; a million is a conversation of ~15,000 messages.
    pub fuel: u64,
    /// Nesting of loops, conditions, macro calls and includes.
    pub recursion: usize,
    /// Bytes of rendered text: what a runner accepts as a prompt, less the request around it.
    pub max_output: usize,
}

/// The bounds of a request's render.
pub const LIMITS: Limits = Limits {
    fuel: 1_000_000,
    recursion: 200,
    max_output: 30 << 20,
};

/// Why a prompt could not be rendered. All but [`RenderError::Unavailable`] are the request's
/// doing (its messages, its template, or a template it chose): a 400 naming the reason.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, serde::Deserialize)]
pub enum RenderError {
    #[error("the chat template does not parse: {0}")]
    Syntax(String),
    #[error("the chat template failed: {0}")]
    Failed(String),
    #[error(
        "the chat template ran past its limit of {0} steps (is there a loop that does not end?)"
    )]
    OutOfFuel(u64),
    #[error("the chat template nests deeper than {0} levels")]
    TooDeep(usize),
    #[error("the rendered prompt is larger than {0} bytes")]
    TooLarge(usize),
    #[error("the chat template needed more than {0} MiB of memory")]
    OutOfMemory(u64),
    #[error("the chat template took longer than {0} s to render")]
    TooSlow(String),
    /// Serve's own failure (no renderer could be started, one died of something else): not
    /// the request's doing.
    #[error("the template renderer failed: {0}")]
    Unavailable(String),
}

/// What a template is rendered with (the names transformers passes).
#[derive(Debug, Clone, Serialize)]
pub struct Context<'a> {
    pub messages: &'a [serde_json::Value],
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tools: Option<&'a [serde_json::Value]>,
    pub add_generation_prompt: bool,
    pub bos_token: &'a str,
    pub eos_token: &'a str,
    /// `think` as templates read it; absent when the request did not say.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub enable_thinking: Option<bool>,
}

/// Our templates for the families we serve, used when a checkpoint ships none.
pub fn builtin(family: &str) -> Option<&'static str> {
    match family {
        "gemma4" => Some(include_str!("templates/gemma4.jinja")),
        "glm-4.7" => Some(include_str!("templates/glm4_moe_lite.jinja")),
        _ => None,
    }
}

fn environment(limits: &Limits) -> Environment<'static> {
    let mut env = Environment::new();
    env.set_fuel(Some(limits.fuel));
    env.set_recursion_limit(limits.recursion);
    minijinja_contrib::add_to_environment(&mut env);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    // Chat templates are written for Python's Jinja: keep the template's own whitespace.
    env.set_keep_trailing_newline(true);
    env.add_function("raise_exception", |msg: String| -> Result<JValue, Error> {
        Err(Error::new(ErrorKind::InvalidOperation, msg))
    });
    env.add_filter("gemma4_declaration", |t: JValue| -> Result<String, Error> {
        Ok(families::gemma4_declaration(&to_json(&t)?))
    });
    env.add_filter("gemma4_value", |v: JValue| -> Result<String, Error> {
        Ok(families::gemma4_value(&to_json(&v)?))
    });
    env.add_filter("gemma4_strip_thinking", |s: String| -> String {
        families::gemma4_strip_thinking(&s)
    });
    env.add_filter("glm_tool_json", |t: JValue| -> Result<String, Error> {
        Ok(families::glm_tool_json(&to_json(&t)?))
    });
    env.add_filter("json_compact", |v: JValue| -> Result<String, Error> {
        Ok(families::go_json(&to_json(&v)?))
    });
    env.add_function("strftime_now", |fmt: String| -> String {
        chrono::Local::now().format(&fmt).to_string()
    });
    // transformers' `tojson` keeps non-ASCII text and key order, and takes `indent`.
    env.add_filter(
        "tojson",
        |v: JValue, kwargs: minijinja::value::Kwargs| -> Result<String, Error> {
            let indent: Option<usize> = kwargs.get("indent")?;
            let _: Option<bool> = kwargs.get("ensure_ascii")?;
            let _: Option<JValue> = kwargs.get("separators")?;
            kwargs.assert_all_used()?;
            let json = serde_json::to_value(&v)
                .map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
            let s = match indent {
                Some(n) => {
                    let pad = vec![b' '; n];
                    let fmt = serde_json::ser::PrettyFormatter::with_indent(&pad);
                    let mut out = Vec::new();
                    let mut ser = serde_json::Serializer::with_formatter(&mut out, fmt);
                    json.serialize(&mut ser)
                        .map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
                    String::from_utf8(out).unwrap_or_default()
                }
                None => python_json(&json),
            };
            Ok(s)
        },
    );
    env
}

fn to_json(v: &JValue) -> Result<serde_json::Value, Error> {
    serde_json::to_value(v).map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))
}

/// `json.dumps` with its default separators (`", "` and `": "`), which templates' tool
/// definitions are written with.
pub fn python_json(v: &serde_json::Value) -> String {
    use serde_json::Value;
    match v {
        Value::Array(items) => format!(
            "[{}]",
            items.iter().map(python_json).collect::<Vec<_>>().join(", ")
        ),
        Value::Object(m) => format!(
            "{{{}}}",
            m.iter()
                .map(|(k, v)| format!("{}: {}", Value::from(k.as_str()), python_json(v)))
                .collect::<Vec<_>>()
                .join(", ")
        ),
        other => other.to_string(),
    }
}

/// Whether `source` parses as a template (the parser's own nesting limit bounds the work).
pub fn check(source: &str) -> Result<(), RenderError> {
    environment(&LIMITS)
        .template_from_str(source)
        .map(drop)
        .map_err(|e| RenderError::Syntax(e.to_string()))
}

/// Renders `source` with `ctx` under [`LIMITS`], on the calling thread.
pub fn render(source: &str, ctx: &Context) -> Result<String, RenderError> {
    render_with(source, ctx, &LIMITS)
}

/// Renders `source` with `ctx` under `limits`, on the calling thread (serve calls this in a
/// worker process, which is killed to cancel it).
pub fn render_with(source: &str, ctx: &Context, limits: &Limits) -> Result<String, RenderError> {
    let env = environment(limits);
    let tmpl = env
        .template_from_str(source)
        .map_err(|e| RenderError::Syntax(e.to_string()))?;
    let mut out = Bounded {
        text: Vec::new(),
        max: limits.max_output,
        full: false,
    };
    let rendered = tmpl.render_captured_to(ctx, &mut out).map(drop);
    match rendered {
        Ok(()) => String::from_utf8(out.text)
            .map_err(|_| RenderError::Failed("the rendered text is not UTF-8".into())),
        Err(_) if out.full => Err(RenderError::TooLarge(limits.max_output)),
        Err(e) => Err(match e.kind() {
            ErrorKind::OutOfFuel => RenderError::OutOfFuel(limits.fuel),
            _ if e.to_string().contains("recursion limit exceeded") => {
                RenderError::TooDeep(limits.recursion)
            }
            _ => RenderError::Failed(e.to_string()),
        }),
    }
}

/// The rendered text, refusing to grow past its bound.
struct Bounded {
    text: Vec<u8>,
    max: usize,
    /// It refused to grow (minijinja reports only that a write failed).
    full: bool,
}

impl std::io::Write for Bounded {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.text.len() + buf.len() > self.max {
            self.full = true;
            return Err(std::io::Error::other("the rendered text is too large"));
        }
        self.text.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Stack for the worker's render thread: minijinja's recursion limit is validated against a
/// few MiB; the pages are only touched as deep as a template goes.
const RENDER_STACK: usize = 64 << 20;

/// Renders at most this many prompts at once: hostile templates can occupy these workers, not
/// the async runtime or every core.
const RENDERERS: usize = 4;

/// What one worker may allocate beyond what it holds at start (the rendered prompt, its
/// context, minijinja's values).
pub const WORKER_MEMORY: u64 = 512 << 20;

/// A render that takes longer than this is stopped (fuel ends any loop long before; this
/// bounds what fuel does not count, such as one huge string operation).
pub const RENDER_TIME: std::time::Duration = std::time::Duration::from_secs(10);

/// What a worker is asked: one line of JSON.
#[derive(Serialize, serde::Deserialize)]
struct WorkRequest {
    source: String,
    ctx: OwnedContext,
    limits: Limits,
}

/// What a worker answers: one line of JSON.
#[derive(Serialize, serde::Deserialize)]
enum WorkReply {
    Ok(String),
    Err(RenderError),
}

/// Render worker processes (`mlx-runner render-worker`), started on demand and reused; each
/// render has one to itself. A worker that runs out of memory dies (its allocation fails),
/// one that runs past its time limit or whose request is dropped is killed; either way the
/// next render gets a fresh one.
pub struct Renderer {
    exe: std::path::PathBuf,
    time: std::time::Duration,
    idle: std::sync::Mutex<Vec<Worker>>,
    slots: tokio::sync::Semaphore,
}

struct Worker {
    child: tokio::process::Child,
    stdin: tokio::process::ChildStdin,
    stdout: tokio::io::BufReader<tokio::process::ChildStdout>,
}

impl Renderer {
    /// Workers are `exe render-worker`.
    pub fn new(exe: std::path::PathBuf) -> Renderer {
        Renderer {
            exe,
            time: RENDER_TIME,
            idle: Default::default(),
            slots: tokio::sync::Semaphore::new(RENDERERS),
        }
    }

    /// The wall-clock bound of one render (default [`RENDER_TIME`]).
    pub fn with_time_limit(mut self, time: std::time::Duration) -> Renderer {
        self.time = time;
        self
    }

    fn spawn(&self) -> Result<Worker, RenderError> {
        let mut child = tokio::process::Command::new(&self.exe)
            .arg("render-worker")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| RenderError::Unavailable(format!("cannot start one: {e}")))?;
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            return Err(RenderError::Unavailable("it has no pipes".into()));
        };
        Ok(Worker {
            child,
            stdin,
            stdout: tokio::io::BufReader::new(stdout),
        })
    }

    /// A worker that is still alive, from the pool or new.
    fn worker(&self) -> Result<Worker, RenderError> {
        while let Some(mut w) = self.idle.lock().unwrap().pop() {
            if matches!(w.child.try_wait(), Ok(None)) {
                return Ok(w);
            }
        }
        self.spawn()
    }

    /// Renders `source` with `ctx` under `limits` in a worker. Dropping the future kills the
    /// worker, so a request that goes away stops its render at once.
    pub async fn render(
        &self,
        source: String,
        ctx: OwnedContext,
        limits: Limits,
    ) -> Result<String, RenderError> {
        use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
        let _slot = self
            .slots
            .acquire()
            .await
            .map_err(|_| RenderError::Unavailable("the renderers are closed".into()))?;
        let mut w = self.worker()?;
        let mut line = serde_json::to_vec(&WorkRequest {
            source,
            ctx,
            limits,
        })
        .map_err(|e| RenderError::Unavailable(e.to_string()))?;
        line.push(b'\n');
        let exchange = async {
            w.stdin.write_all(&line).await?;
            w.stdin.flush().await?;
            let mut answer = Vec::new();
            w.stdout.read_until(b'\n', &mut answer).await?;
            Ok::<_, std::io::Error>(answer)
        };
        let answer = match tokio::time::timeout(self.time, exchange).await {
            Err(_) => return Err(RenderError::TooSlow(self.time.as_secs_f64().to_string())),
            Ok(Ok(a)) if !a.is_empty() => a,
            // It died mid-render: out of memory, unless something else killed it.
            Ok(_) => {
                let status =
                    tokio::time::timeout(std::time::Duration::from_secs(2), w.child.wait()).await;
                return Err(match status {
                    Ok(Ok(st)) if died_of_memory(&st) => {
                        RenderError::OutOfMemory(WORKER_MEMORY >> 20)
                    }
                    _ => RenderError::Unavailable("it exited".into()),
                });
            }
        };
        let reply: WorkReply = serde_json::from_slice(&answer)
            .map_err(|e| RenderError::Unavailable(format!("an unreadable answer: {e}")))?;
        self.idle.lock().unwrap().push(w);
        match reply {
            WorkReply::Ok(text) => Ok(text),
            WorkReply::Err(e) => Err(e),
        }
    }
}

/// A failed allocation aborts (SIGABRT); the kernel's OOM killer sends SIGKILL.
fn died_of_memory(status: &std::process::ExitStatus) -> bool {
    use std::os::unix::process::ExitStatusExt;
    matches!(status.signal(), Some(libc::SIGABRT) | Some(libc::SIGKILL))
}

/// `mlx-runner render-worker`: renders the requests on stdin, one JSON line each, answering
/// each on stdout, until stdin closes. Its memory is capped at what it holds now plus
/// [`WORKER_MEMORY`]; it dies with its parent.
pub fn worker_main() -> std::io::Result<()> {
    let thread = std::thread::Builder::new()
        .name("render".into())
        .stack_size(RENDER_STACK)
        .spawn(|| {
            // After the thread exists: its stack is part of the baseline, not the budget.
            confine(WORKER_MEMORY);
            work(std::io::stdin().lock(), std::io::stdout().lock())
        })?;
    thread
        .join()
        .unwrap_or_else(|_| Err(std::io::Error::other("the render thread panicked")))
}

fn work(input: impl std::io::BufRead, mut output: impl std::io::Write) -> std::io::Result<()> {
    for line in input.lines() {
        let line = line?;
        let reply = match serde_json::from_str::<WorkRequest>(&line) {
            // Serve's own mistake, not the request's.
            Err(e) => WorkReply::Err(RenderError::Unavailable(format!(
                "a malformed render request: {e}"
            ))),
            Ok(req) => match render_with(&req.source, &req.ctx.borrowed(), &req.limits) {
                Ok(text) => WorkReply::Ok(text),
                Err(e) => WorkReply::Err(e),
            },
        };
        serde_json::to_writer(&mut output, &reply)?;
        output.write_all(b"\n")?;
        output.flush()?;
    }
    Ok(())
}

/// Caps this process's data (heap and private mappings) at its current size plus `budget`,
/// and has it killed when its parent dies.
fn confine(budget: u64) {
    #[cfg(target_os = "linux")]
    {
        let now = std::fs::read_to_string("/proc/self/status")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("VmData:"))
                    .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
            })
            .unwrap_or(0)
            * 1024;
        let cap = libc::rlimit {
            rlim_cur: now + budget,
            rlim_max: now + budget,
        };
        // SAFETY: setrlimit and prctl take plain values; neither touches our memory.
        unsafe {
            libc::setrlimit(libc::RLIMIT_DATA, &cap);
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = budget;
}

/// A [`Context`] that owns its parts, to be sent to a render worker.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct OwnedContext {
    pub messages: Vec<serde_json::Value>,
    #[serde(default)]
    pub tools: Option<Vec<serde_json::Value>>,
    pub add_generation_prompt: bool,
    pub bos_token: String,
    pub eos_token: String,
    pub enable_thinking: Option<bool>,
}

impl OwnedContext {
    pub fn borrowed(&self) -> Context<'_> {
        Context {
            messages: &self.messages,
            tools: self.tools.as_deref(),
            add_generation_prompt: self.add_generation_prompt,
            bos_token: &self.bos_token,
            eos_token: &self.eos_token,
            enable_thinking: self.enable_thinking,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn ctx<'a>(messages: &'a [serde_json::Value]) -> Context<'a> {
        Context {
            messages,
            tools: None,
            add_generation_prompt: true,
            bos_token: "<s>",
            eos_token: "</s>",
            enable_thinking: None,
        }
    }

    /// The constructs Hugging Face templates lean on: Python string and dict methods,
    /// namespaces, `raise_exception`, `tojson`.
    #[test]
    fn python_flavoured_templates_render() {
        let t = r#"{{ bos_token }}{%- set ns = namespace(n=0) -%}
{%- for m in messages -%}
{%- if m.role not in ['user', 'assistant', 'system'] %}{{ raise_exception('bad role ' + m.role) }}{% endif -%}
{%- set ns.n = ns.n + 1 -%}
<{{ m.role | upper }}>{{ m.content.strip() }}{% if m.content.startswith('x') %}!{% endif %}
{%- if m.args %}{% for k, v in m.args.items() %} {{ k }}={{ v | tojson }}{% endfor %}{% endif %}
{% endfor -%}
{{ ns.n }}{% if add_generation_prompt %}<ASSISTANT>{% endif %}"#;
        let msgs = [
            json!({"role": "user", "content": "  xhello "}),
            json!({"role": "assistant", "content": "hi", "args": {"b": "é", "a": [1, 2]}}),
        ];
        let out = render(t, &ctx(&msgs)).unwrap();
        assert_eq!(
            out,
            "<s><USER>xhello\n<ASSISTANT>hi b=\"é\" a=[1, 2]\n2<ASSISTANT>"
        );
        let bad = [json!({"role": "robot", "content": "x"})];
        let e = render(t, &ctx(&bad)).unwrap_err().to_string();
        assert!(e.contains("bad role robot"), "{e}");
    }
}
