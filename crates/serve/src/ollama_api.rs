//! ollama's API (`/api/...`), shaped as its Go types (`api/types.go`) marshal: durations in
//! nanoseconds, `done_reason` strings, errors as `{"error": "..."}`.

use crate::body::{json_body, JsonBody};
use crate::pipeline::{self, ApiError, Event, Input, Running, Summary};
use crate::App;
use axum::body::Body;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use serde_json::{json, Map, Value};
use std::sync::Arc;

pub fn error(e: &ApiError) -> Response {
    let code = StatusCode::from_u16(e.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (code, axum::Json(json!({ "error": e.message }))).into_response()
}

pub fn now() -> String {
    chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Nanos, true)
}

pub fn time_of(t: std::time::SystemTime) -> String {
    chrono::DateTime::<chrono::Utc>::from(t).to_rfc3339_opts(chrono::SecondsFormat::Nanos, true)
}

fn string(v: &Value, key: &str) -> Result<String, ApiError> {
    match &v[key] {
        Value::Null => Ok(String::new()),
        Value::String(s) => Ok(s.clone()),
        other => Err(ApiError::bad(format!(
            "invalid value for {key}: expected a string, got {other}"
        ))),
    }
}

fn boolean(v: &Value, key: &str) -> Result<Option<bool>, ApiError> {
    match &v[key] {
        Value::Null => Ok(None),
        Value::Bool(b) => Ok(Some(*b)),
        other => Err(ApiError::bad(format!(
            "invalid value for {key}: expected a boolean, got {other}"
        ))),
    }
}

fn object(v: &Value, key: &str) -> Result<Map<String, Value>, ApiError> {
    match &v[key] {
        Value::Null => Ok(Map::new()),
        Value::Object(m) => Ok(m.clone()),
        other => Err(ApiError::bad(format!(
            "invalid value for {key}: expected an object, got {other}"
        ))),
    }
}

fn array(v: &Value, key: &str) -> Result<Vec<Value>, ApiError> {
    match &v[key] {
        Value::Null => Ok(Vec::new()),
        Value::Array(a) => Ok(a.clone()),
        other => Err(ApiError::bad(format!(
            "invalid value for {key}: expected an array, got {other}"
        ))),
    }
}

/// `think`: a boolean, or a level string (`high`, `medium`, `low`), which these models read as
/// thinking on.
fn think(v: &Value) -> Result<Option<bool>, ApiError> {
    match &v["think"] {
        Value::Null => Ok(None),
        Value::Bool(b) => Ok(Some(*b)),
        Value::String(s) if matches!(s.as_str(), "high" | "medium" | "low" | "max") => {
            Ok(Some(true))
        }
        other => Err(ApiError::bad(format!(
            "invalid think value: {other} (must be true, false, \"high\", \"medium\" or \"low\")"
        ))),
    }
}

fn common(v: &Value, input: &mut Input) -> Result<(), ApiError> {
    input.model = string(v, "model")?;
    if input.model.is_empty() {
        input.model = string(v, "name")?;
    }
    input.options = object(v, "options")?;
    input.format = match &v["format"] {
        Value::String(s) if s.is_empty() => Value::Null,
        f => f.clone(),
    };
    input.keep_alive = pipeline::parse_keep_alive(&v["keep_alive"]).map_err(ApiError::bad)?;
    input.think = think(v)?;
    input.logprobs = boolean(v, "logprobs")?.unwrap_or(false);
    input.top_logprobs = match &v["top_logprobs"] {
        Value::Null => 0,
        n => n
            .as_i64()
            .and_then(|n| i32::try_from(n).ok())
            .ok_or_else(|| ApiError::bad("top_logprobs must be an integer"))?,
    };
    if !(0..=20).contains(&input.top_logprobs) {
        return Err(ApiError::bad("top_logprobs must be between 0 and 20"));
    }
    Ok(())
}

/// A list of images as ollama's API takes them (`api.ImageData`: base64 strings, decoded by
/// Go's JSON decoding, so a string that is not base64 is the request's error).
fn images(v: &Value, key: &str) -> Result<Vec<String>, ApiError> {
    use base64::Engine;
    array(v, key)?
        .into_iter()
        .enumerate()
        .map(|(i, img)| match img {
            Value::String(s) => base64::engine::general_purpose::STANDARD
                .decode(&s)
                .map(|_| s)
                .map_err(|e| ApiError::bad(format!("image {i} is not valid base64: {e}"))),
            other => Err(ApiError::bad(format!(
                "image {i} must be a base64 string, got {other}"
            ))),
        })
        .collect()
}

/// A message as the template and the history see it: roles lower-cased (as Go's
/// `Message.UnmarshalJSON`), tool-call arguments as objects.
fn message(m: &Value) -> Result<Value, ApiError> {
    let Value::Object(o) = m else {
        return Err(ApiError::bad("each message must be an object"));
    };
    let mut o = o.clone();
    let role = match o.get("role") {
        Some(Value::String(r)) => r.to_lowercase(),
        _ => return Err(ApiError::bad("each message needs a role")),
    };
    o.insert("role".into(), Value::from(role));
    match o.get("content") {
        None | Some(Value::Null) => {
            o.insert("content".into(), Value::from(""));
        }
        Some(Value::String(_)) => {}
        Some(other) => {
            return Err(ApiError::bad(format!(
                "message content must be a string, got {other}"
            )))
        }
    }
    let list = images(&Value::Object(o.clone()), "images")?;
    if list.is_empty() {
        o.remove("images");
    } else {
        o.insert("images".into(), list.into());
    }
    Ok(Value::Object(o))
}

fn metrics(out: &mut Map<String, Value>, run: &Running, s: &Summary) {
    out.insert(
        "total_duration".into(),
        (run.started.elapsed().as_nanos() as u64).into(),
    );
    out.insert(
        "load_duration".into(),
        (run.load_duration.as_nanos() as u64).into(),
    );
    for (k, v) in [
        ("prompt_eval_count", s.prompt_eval_count),
        ("prompt_eval_duration", s.prompt_eval_duration),
        ("eval_count", s.eval_count),
        ("eval_duration", s.eval_duration),
    ] {
        if v != 0 {
            out.insert(k.into(), v.into());
        }
    }
}

fn logprobs_json(lp: &[crate::client::TokenLogprob]) -> Value {
    Value::Array(
        lp.iter()
            .map(|t| {
                let mut o = json!({"token": t.token, "logprob": t.logprob, "bytes": t.token.as_bytes()});
                if !t.top_logprobs.is_empty() {
                    o["top_logprobs"] = t
                        .top_logprobs
                        .iter()
                        .map(|t| json!({"token": t.token, "logprob": t.logprob, "bytes": t.token.as_bytes()}))
                        .collect();
                }
                o
            })
            .collect(),
    )
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Generate,
    Chat,
}

/// The response objects of a completion: one per piece when streaming, one in all otherwise.
async fn respond(run: Running, kind: Kind, stream: bool) -> Response {
    let model = run.model.clone();
    let base = move || {
        let mut o = Map::new();
        o.insert("model".into(), model.clone().into());
        o.insert("created_at".into(), now().into());
        o
    };
    let piece = move |content: &str,
                      thinking: &str,
                      calls: &[Value],
                      lp: &[crate::client::TokenLogprob],
                      done: bool| {
        let mut o = base();
        match kind {
            Kind::Generate => {
                o.insert("response".into(), content.into());
                if !thinking.is_empty() {
                    o.insert("thinking".into(), thinking.into());
                }
            }
            Kind::Chat => {
                let mut m = json!({"role": "assistant", "content": content});
                if !thinking.is_empty() {
                    m["thinking"] = thinking.into();
                }
                if !calls.is_empty() {
                    m["tool_calls"] = Value::Array(calls.to_vec());
                }
                o.insert("message".into(), m);
            }
        }
        if kind == Kind::Generate && !calls.is_empty() {
            o.insert("tool_calls".into(), Value::Array(calls.to_vec()));
        }
        o.insert("done".into(), done.into());
        if !lp.is_empty() {
            o.insert("logprobs".into(), logprobs_json(lp));
        }
        o
    };
    if stream {
        let mut run = run;
        let events = std::mem::replace(&mut run.events, Box::pin(futures::stream::empty()));
        let lines = events.map(move |ev| {
            let obj = match ev {
                Event::Piece { parsed, logprobs } => Value::Object(piece(
                    &parsed.content,
                    &parsed.thinking,
                    &parsed.tool_calls,
                    &logprobs,
                    false,
                )),
                Event::Done(s) => {
                    let mut o = piece("", "", &[], &[], true);
                    o.insert("done_reason".into(), s.done_reason.into());
                    metrics(&mut o, &run, &s);
                    Value::Object(o)
                }
                Event::Error(e) => json!({"error": e.message}),
            };
            let mut line = serde_json::to_vec(&obj).unwrap_or_default();
            line.push(b'\n');
            Ok::<_, std::convert::Infallible>(bytes::Bytes::from(line))
        });
        return Response::builder()
            .header(header::CONTENT_TYPE, "application/x-ndjson")
            .body(Body::from_stream(lines))
            .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response());
    }
    // Not streaming: one answer once the completion ends.
    let mut run = run;
    let events = std::mem::replace(&mut run.events, Box::pin(futures::stream::empty()));
    match pipeline::collect(events).await {
        Ok((all, lps, s)) => {
            let mut o = piece(&all.content, &all.thinking, &all.tool_calls, &lps, true);
            o.insert("done_reason".into(), s.done_reason.into());
            metrics(&mut o, &run, &s);
            axum::Json(Value::Object(o)).into_response()
        }
        Err(e) => error(&e),
    }
}

async fn complete(app: Arc<App>, v: Value, kind: Kind) -> Result<Response, ApiError> {
    let mut input = Input::default();
    common(&v, &mut input)?;
    let stream = boolean(&v, "stream")?.unwrap_or(true);
    let m = pipeline::find(&app, &input.model)?;
    let empty = match kind {
        Kind::Generate => {
            let prompt = string(&v, "prompt")?;
            let system = string(&v, "system")?;
            let raw = boolean(&v, "raw")?.unwrap_or(false);
            input.template = Some(string(&v, "template")?).filter(|t| !t.is_empty());
            if !array(&v, "context")?.is_empty() {
                return Err(ApiError::bad(
                    "context is not supported: send the conversation with /api/chat (the runner's prefix cache reuses it)",
                ));
            }
            if !string(&v, "suffix")?.is_empty() {
                return Err(ApiError::bad(format!(
                    "{} does not support insert (suffix)",
                    m.display()
                )));
            }
            let imgs = images(&v, "images")?;
            if raw {
                input.raw = Some(prompt.clone());
                input.raw_images = imgs;
            } else {
                if !system.is_empty() {
                    input
                        .messages
                        .push(json!({"role": "system", "content": system}));
                }
                let mut user = json!({"role": "user", "content": prompt});
                if !imgs.is_empty() {
                    user["images"] = imgs.into();
                }
                input.messages.push(user);
            }
            prompt.is_empty()
        }
        Kind::Chat => {
            input.messages = array(&v, "messages")?
                .iter()
                .map(message)
                .collect::<Result<_, _>>()?;
            input.tools = array(&v, "tools")?;
            input.messages.is_empty()
        }
    };
    if empty {
        let ka = pipeline::keep_alive(&app, input.keep_alive);
        let reason = pipeline::load_only(&app, &m, ka).await?;
        let mut o = Map::new();
        o.insert("model".into(), m.display().into());
        o.insert("created_at".into(), now().into());
        match kind {
            Kind::Generate => o.insert("response".into(), "".into()),
            Kind::Chat => o.insert(
                "message".into(),
                json!({"role": "assistant", "content": ""}),
            ),
        };
        o.insert("done".into(), true.into());
        o.insert("done_reason".into(), reason.into());
        return Ok(axum::Json(Value::Object(o)).into_response());
    }
    let run = pipeline::start(&app, &m, input).await?;
    Ok(respond(run, kind, stream).await)
}

pub async fn generate(State(app): State<Arc<App>>, body: JsonBody) -> Response {
    match json_body(body).map(|v| complete(app, v, Kind::Generate)) {
        Ok(f) => f.await.unwrap_or_else(|e| error(&e)),
        Err(e) => error(&e),
    }
}

pub async fn chat(State(app): State<Arc<App>>, body: JsonBody) -> Response {
    match json_body(body).map(|v| complete(app, v, Kind::Chat)) {
        Ok(f) => f.await.unwrap_or_else(|e| error(&e)),
        Err(e) => error(&e),
    }
}

fn list_entry(m: &crate::catalog::Model) -> Value {
    json!({
        "name": m.display(),
        "model": m.display(),
        "modified_at": time_of(m.modified),
        "size": m.size,
        "digest": m.digest(),
        "details": m.details(),
    })
}

pub async fn tags(State(app): State<Arc<App>>) -> Response {
    let models: Vec<Value> = app.catalog.list().iter().map(list_entry).collect();
    axum::Json(json!({ "models": models })).into_response()
}

pub async fn ps(State(app): State<Arc<App>>) -> Response {
    let mut models = Vec::new();
    for r in app.sched.loaded() {
        let Ok(m) = app.catalog.find(&r.name) else {
            continue;
        };
        let memory = r.memory.load(std::sync::atomic::Ordering::SeqCst);
        let expires = r.expires_at().unwrap_or_else(|| {
            std::time::SystemTime::now() + std::time::Duration::from_secs(100 * 365 * 86400)
        });
        models.push(json!({
            "name": m.display(),
            "model": m.display(),
            "size": if memory > 0 { memory } else { m.size },
            "digest": m.digest(),
            "details": m.details(),
            "expires_at": time_of(expires),
            "size_vram": 0,
            "context_length": r.context_length.load(std::sync::atomic::Ordering::SeqCst),
            // Ours: the processes the model is split over.
            "ranks": r.ranks,
        }));
    }
    axum::Json(json!({ "models": models })).into_response()
}

pub async fn show(State(app): State<Arc<App>>, body: JsonBody) -> Response {
    let r = (|| {
        let v = json_body(body)?;
        let mut name = string(&v, "model")?;
        if name.is_empty() {
            name = string(&v, "name")?;
        }
        let m = pipeline::find(&app, &name)?;
        let mf = &m.modelfile;
        let params: Vec<String> = mf
            .parameters
            .iter()
            .flat_map(|(k, v)| match v {
                Value::Array(items) => items
                    .iter()
                    .map(|i| format!("{k:<30} {}", i))
                    .collect::<Vec<_>>(),
                other => vec![format!("{k:<30} {other}")],
            })
            .collect();
        let cfg = m.config_json();
        let arch = cfg["model_type"].as_str().unwrap_or_default().to_string();
        let mut info = Map::new();
        info.insert("general.architecture".into(), arch.clone().into());
        info.insert("general.parameter_count".into(), m.parameter_count().into());
        for (k, ours) in [
            ("hidden_size", "embedding_length"),
            ("num_hidden_layers", "block_count"),
            ("max_position_embeddings", "context_length"),
            ("num_attention_heads", "attention.head_count"),
            ("num_key_value_heads", "attention.head_count_kv"),
            ("vocab_size", "vocab_size"),
        ] {
            let value = cfg
                .get(k)
                .or_else(|| cfg.pointer(&format!("/text_config/{k}")));
            if let Some(val) = value {
                info.insert(format!("{arch}.{ours}"), val.clone());
            }
        }
        let mut out = json!({
            "modelfile": mf.to_string(),
            "parameters": params.join("\n"),
            "template": mf.template.clone().or_else(|| m.chat_template()).or_else(|| crate::template::builtin(&m.family).map(String::from)).unwrap_or_default(),
            "details": m.details(),
            "model_info": info,
            "capabilities": m.capabilities(),
            "modified_at": time_of(m.modified),
        });
        if let Some(s) = &mf.system {
            out["system"] = s.clone().into();
        }
        if !mf.license.is_empty() {
            out["license"] = mf.license.join("\n").into();
        }
        if !m.family.is_empty() {
            out["renderer"] = m.family.clone().into();
            out["parser"] = m.family.clone().into();
        }
        Ok::<_, ApiError>(axum::Json(out).into_response())
    })();
    r.unwrap_or_else(|e| error(&e))
}

pub async fn copy(State(app): State<Arc<App>>, body: JsonBody) -> Response {
    let r = (|| {
        let v = json_body(body)?;
        let (src, dst) = (string(&v, "source")?, string(&v, "destination")?);
        if src.is_empty() || dst.is_empty() {
            return Err(ApiError::bad("source and destination are required"));
        }
        let from = crate::catalog::Catalog::parse(&src)?;
        let to = crate::catalog::Catalog::parse(&dst)?;
        let Some(st) = app.catalog.store_of(&from) else {
            return Err(ApiError::new(404, format!("model '{src}' not found")));
        };
        let (manifest, _) = st
            .manifest(&from)
            .map_err(|e| ApiError::new(500, e.to_string()))?
            .ok_or_else(|| ApiError::new(404, format!("model '{src}' not found")))?;
        // The copy lives in our store; blobs from ollama's store are copied in first.
        let ours = &app.catalog.ours;
        let lock = ours.lock().map_err(|e| ApiError::new(500, e.to_string()))?;
        if st.root() != ours.root() {
            for l in manifest.all_layers() {
                let from_path = st
                    .blob_path(&l.digest)
                    .map_err(|e| ApiError::new(500, e.to_string()))?;
                let bytes =
                    std::fs::read(&from_path).map_err(|e| ApiError::new(500, e.to_string()))?;
                ours.write_blob(&lock, &l.media_type, &bytes)
                    .map_err(|e| ApiError::new(500, e.to_string()))?;
            }
        }
        ours.write_manifest(&lock, &to, &manifest)
            .map_err(|e| ApiError::new(500, e.to_string()))?;
        Ok(StatusCode::OK.into_response())
    })();
    r.unwrap_or_else(|e| error(&e))
}

pub async fn delete(State(app): State<Arc<App>>, body: JsonBody) -> Response {
    let r = async {
        let v = json_body(body)?;
        let mut name = string(&v, "model")?;
        if name.is_empty() {
            name = string(&v, "name")?;
        }
        let parsed = crate::catalog::Catalog::parse(&name)?;
        let ours = &app.catalog.ours;
        match ours.manifest(&parsed) {
            Ok(Some(_)) => {}
            Ok(None) => return Err(ApiError::new(404, format!("model '{name}' not found"))),
            Err(e) => return Err(ApiError::new(500, e.to_string())),
        }
        app.sched.unload_model(&parsed.to_string()).await;
        ours.remove(&parsed)
            .map_err(|e| ApiError::new(500, e.to_string()))?;
        Ok(StatusCode::OK.into_response())
    };
    r.await.unwrap_or_else(|e| error(&e))
}

pub async fn version() -> Response {
    axum::Json(json!({ "version": env!("CARGO_PKG_VERSION") })).into_response()
}
