//! The OpenAI API (`/v1/...`) as ollama's compatibility layer maps it (`openai/openai.go`):
//! temperature and top_p default to 1, `max_tokens` is `num_predict`, `response_format` is
//! `format`, streams are server-sent events ending with `data: [DONE]`.

use crate::body::{json_body, JsonBody};
use crate::pipeline::{self, ApiError, Event, Input, Summary};
use crate::App;
use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use serde_json::{json, Map, Value};
use std::sync::Arc;

pub fn error(e: &ApiError) -> Response {
    let code = StatusCode::from_u16(e.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let kind = match e.status {
        404 => "not_found_error",
        400..=499 => "invalid_request_error",
        _ => "api_error",
    };
    (
        code,
        axum::Json(
            json!({"error": {"message": e.message, "type": kind, "param": null, "code": null}}),
        ),
    )
        .into_response()
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default()
}

fn id(prefix: &str) -> String {
    use rand::Rng;
    format!("{prefix}-{}", rand::rng().random_range(0..1_000_000u32))
}

/// The options a request sets, as ollama's `FromChatRequest` does.
fn options(v: &Value) -> Result<Map<String, Value>, ApiError> {
    let mut o = Map::new();
    match &v["stop"] {
        Value::Null => {}
        Value::String(s) => {
            o.insert("stop".into(), json!([s]));
        }
        Value::Array(items) => {
            if items.iter().any(|i| !i.is_string()) {
                return Err(ApiError::bad(
                    "invalid type for 'stop' field: expected strings",
                ));
            }
            o.insert("stop".into(), Value::Array(items.clone()));
        }
        other => {
            return Err(ApiError::bad(format!(
                "invalid type for 'stop' field: {other}"
            )))
        }
    }
    let max = match (&v["max_completion_tokens"], &v["max_tokens"]) {
        (Value::Null, m) => m,
        (m, _) => m,
    };
    let number = |key: &str, val: &Value| -> Result<Option<Value>, ApiError> {
        match val {
            Value::Null => Ok(None),
            Value::Number(n) => Ok(Some(Value::Number(n.clone()))),
            other => Err(ApiError::bad(format!(
                "{key} must be a number, got {other}"
            ))),
        }
    };
    if let Some(n) = number("max_tokens", max)? {
        o.insert("num_predict".into(), n);
    }
    o.insert(
        "temperature".into(),
        number("temperature", &v["temperature"])?.unwrap_or(json!(1.0)),
    );
    o.insert(
        "top_p".into(),
        number("top_p", &v["top_p"])?.unwrap_or(json!(1.0)),
    );
    for key in ["seed", "frequency_penalty", "presence_penalty"] {
        if let Some(n) = number(key, &v[key])? {
            o.insert(key.into(), n);
        }
    }
    Ok(o)
}

/// Fields we do not implement are refused, never accepted and ignored: a client that asks for
/// two choices or biased logits must not get one choice or plain ones without knowing.
fn refuse_unsupported(v: &Value) -> Result<(), ApiError> {
    match &v["n"] {
        Value::Null => {}
        n if n.as_u64() == Some(1) => {}
        other => {
            return Err(ApiError::bad(format!(
                "n must be 1 (got {other}): one choice per request; send several requests, which share the prompt's cached prefix"
            )))
        }
    }
    match &v["logit_bias"] {
        Value::Null => {}
        Value::Object(m) if m.is_empty() => {}
        _ => {
            return Err(ApiError::bad(
                "logit_bias is not supported: use a response_format (a JSON schema) to constrain the output",
            ))
        }
    }
    match &v["best_of"] {
        Value::Null => {}
        n if n.as_u64() == Some(1) => {}
        other => return Err(ApiError::bad(format!("best_of must be 1 (got {other})"))),
    }
    if v["echo"] == true {
        return Err(ApiError::bad("echo is not supported"));
    }
    if v["suffix"].as_str().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::bad(
            "suffix is not supported: the models served here do not insert",
        ));
    }
    Ok(())
}

fn format(v: &Value) -> Result<Value, ApiError> {
    let rf = &v["response_format"];
    if rf.is_null() {
        return Ok(Value::Null);
    }
    match rf["type"]
        .as_str()
        .map(|s| s.trim().to_lowercase())
        .as_deref()
    {
        Some("json_object") => Ok(json!("json")),
        Some("json_schema") => Ok(rf["json_schema"]["schema"].clone()),
        Some("text") | None => Ok(Value::Null),
        Some(other) => Err(ApiError::bad(format!(
            "unknown response_format type {other:?}"
        ))),
    }
}

fn think(v: &Value) -> Result<Option<bool>, ApiError> {
    let effort = v["reasoning"]["effort"]
        .as_str()
        .or(v["reasoning_effort"].as_str())
        .unwrap_or_default();
    match effort {
        "" => Ok(None),
        "none" => Ok(Some(false)),
        "minimal" | "low" | "medium" | "high" | "xhigh" | "ultra" | "max" => Ok(Some(true)),
        other => Err(ApiError::bad(format!(
            "invalid reasoning value: {other:?} (must be \"minimal\", \"low\", \"medium\", \"high\", \"xhigh\", \"ultra\", \"max\", or \"none\")"
        ))),
    }
}

/// OpenAI messages as ollama's (`api.Message`): text parts joined, tool-call arguments decoded,
/// a tool result named after the call it answers.
fn messages(v: &Value) -> Result<Vec<Value>, ApiError> {
    let Some(list) = v["messages"].as_array() else {
        return Err(ApiError::bad("messages must be an array"));
    };
    let mut out: Vec<Value> = Vec::new();
    for m in list {
        let role = m["role"]
            .as_str()
            .ok_or_else(|| ApiError::bad("each message needs a role"))?
            .to_lowercase();
        let mut images = Vec::new();
        let content = match &m["content"] {
            Value::Null => String::new(),
            Value::String(s) => s.clone(),
            Value::Array(parts) => {
                let mut text = String::new();
                for p in parts {
                    match p["type"].as_str() {
                        Some("text") => text.push_str(
                            p["text"]
                                .as_str()
                                .ok_or_else(|| ApiError::bad("invalid message format"))?,
                        ),
                        Some("image_url") => {
                            images.push(crate::images::openai_part(p, "image_url")?)
                        }
                        Some("input_audio") => images.push(crate::images::openai_audio(p)?),
                        _ => return Err(ApiError::bad("invalid message format")),
                    }
                }
                text
            }
            other => {
                return Err(ApiError::bad(format!(
                    "invalid message content type: {other}"
                )))
            }
        };
        let mut msg = json!({"role": role, "content": content});
        if !images.is_empty() {
            msg["images"] = images.into();
        }
        if let Some(r) = m["reasoning"].as_str().or(m["reasoning_content"].as_str()) {
            msg["thinking"] = r.into();
        }
        if let Some(calls) = m["tool_calls"].as_array() {
            let mut converted = Vec::new();
            for c in calls {
                let args = match &c["function"]["arguments"] {
                    Value::String(s) => serde_json::from_str::<Value>(s)
                        .ok()
                        .filter(Value::is_object)
                        .ok_or_else(|| ApiError::bad("invalid tool call arguments"))?,
                    Value::Object(o) => Value::Object(o.clone()),
                    Value::Null => json!({}),
                    _ => return Err(ApiError::bad("invalid tool call arguments")),
                };
                converted.push(json!({
                    "id": c["id"],
                    "function": {"name": c["function"]["name"], "arguments": args},
                }));
            }
            msg["tool_calls"] = Value::Array(converted);
        }
        if let Some(id) = m["tool_call_id"].as_str() {
            msg["tool_call_id"] = id.into();
            let name = out
                .iter()
                .rev()
                .flat_map(|p| p["tool_calls"].as_array().cloned().unwrap_or_default())
                .find(|c| c["id"] == id)
                .map(|c| c["function"]["name"].clone());
            if let Some(n) = name {
                msg["tool_name"] = n;
            }
        }
        if let Some(n) = m["name"].as_str().filter(|_| role == "tool") {
            msg["tool_name"] = n.into();
        }
        out.push(msg);
    }
    Ok(out)
}

fn usage(s: &Summary) -> Value {
    json!({
        "prompt_tokens": s.prompt_eval_count,
        "completion_tokens": s.eval_count,
        "total_tokens": s.prompt_eval_count + s.eval_count,
    })
}

/// An ollama tool call as OpenAI writes it: arguments as a JSON string.
fn tool_call(c: &Value, index: usize) -> Value {
    json!({
        "index": index,
        "id": c["id"],
        "type": "function",
        "function": {
            "name": c["function"]["name"],
            "arguments": serde_json::to_string(&c["function"]["arguments"]).unwrap_or_default(),
        },
    })
}

fn logprobs(lp: &[crate::client::TokenLogprob]) -> Value {
    json!({"content": lp.iter().map(|t| json!({
        "token": t.token,
        "logprob": t.logprob,
        "bytes": t.token.as_bytes(),
        "top_logprobs": t.top_logprobs.iter().map(|x| json!({"token": x.token, "logprob": x.logprob, "bytes": x.token.as_bytes()})).collect::<Vec<_>>(),
    })).collect::<Vec<_>>()})
}

fn sse(v: &Value) -> bytes::Bytes {
    bytes::Bytes::from(format!("data: {}\n\n", v))
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Chat,
    Text,
}

async fn complete(app: Arc<App>, v: Value, kind: Kind) -> Result<Response, ApiError> {
    let model = v["model"]
        .as_str()
        .ok_or_else(|| ApiError::bad("model is required"))?
        .to_string();
    refuse_unsupported(&v)?;
    let m = pipeline::find(&app, &model)?;
    let mut input = Input {
        model: model.clone(),
        options: options(&v)?,
        format: format(&v)?,
        think: think(&v)?,
        ..Default::default()
    };
    match kind {
        Kind::Chat => {
            input.messages = messages(&v)?;
            if input.messages.is_empty() {
                return Err(ApiError::bad("messages must not be empty"));
            }
            input.tools = match (&v["tools"], v["tool_choice"].as_str()) {
                (_, Some("none")) => Vec::new(),
                (Value::Array(t), _) => t.clone(),
                (Value::Null, _) => Vec::new(),
                _ => return Err(ApiError::bad("tools must be an array")),
            };
            input.forced =
                crate::forced::from_tool_choice(&v["tool_choice"]).map_err(ApiError::bad)?;
            input.logprobs = v["logprobs"].as_bool().unwrap_or(false);
            input.top_logprobs = v["top_logprobs"].as_i64().unwrap_or(0) as i32;
            if !(0..=20).contains(&input.top_logprobs) {
                return Err(ApiError::bad("top_logprobs must be between 0 and 20"));
            }
        }
        Kind::Text => {
            let prompt = match &v["prompt"] {
                Value::String(s) => s.clone(),
                Value::Array(a) if a.len() == 1 && a[0].is_string() => {
                    a[0].as_str().unwrap_or_default().to_string()
                }
                _ => return Err(ApiError::bad("prompt must be a string")),
            };
            if prompt.is_empty() {
                return Err(ApiError::bad("prompt is required"));
            }
            input.raw = Some(prompt);
            if let Some(n) = v["logprobs"].as_i64().filter(|n| *n > 0) {
                input.logprobs = true;
                input.top_logprobs = n.min(20) as i32;
            }
        }
    }
    let stream = v["stream"].as_bool().unwrap_or(false);
    let include_usage = v["stream_options"]["include_usage"]
        .as_bool()
        .unwrap_or(false);
    let run = pipeline::start(&app, &m, input).await?;
    let (cid, created) = (
        id(if kind == Kind::Chat {
            "chatcmpl"
        } else {
            "cmpl"
        }),
        unix_now(),
    );
    let object = match (kind, stream) {
        (Kind::Chat, true) => "chat.completion.chunk",
        (Kind::Chat, false) => "chat.completion",
        (Kind::Text, _) => "text_completion",
    };
    let head = json!({"id": cid, "object": object, "created": created, "model": model, "system_fingerprint": "fp_ollama"});
    let with_choices = move |choices: Value| {
        let mut o = head.clone();
        o["choices"] = choices;
        o
    };
    if stream {
        let mut first = true;
        let mut calls_sent = 0usize;
        let mut events = run.events;
        let lines = async_stream(move |tx| async move {
            loop {
                // A client that left ends the completion now, not at the next text.
                let ev = tokio::select! {
                    _ = tx.closed() => return,
                    ev = events.next() => match ev { Some(ev) => ev, None => return },
                };
                match ev {
                    Event::Piece {
                        parsed,
                        logprobs: lp,
                    } => {
                        let choice = match kind {
                            Kind::Chat => {
                                let mut delta = json!({"content": parsed.content});
                                if first {
                                    delta["role"] = "assistant".into();
                                    first = false;
                                }
                                if !parsed.thinking.is_empty() {
                                    delta["reasoning"] = parsed.thinking.clone().into();
                                }
                                if !parsed.tool_calls.is_empty() {
                                    delta["tool_calls"] = parsed
                                        .tool_calls
                                        .iter()
                                        .enumerate()
                                        .map(|(i, c)| tool_call(c, calls_sent + i))
                                        .collect();
                                    calls_sent += parsed.tool_calls.len();
                                }
                                let mut c =
                                    json!({"index": 0, "delta": delta, "finish_reason": null});
                                if !lp.is_empty() {
                                    c["logprobs"] = logprobs(&lp);
                                }
                                c
                            }
                            Kind::Text => {
                                json!({"index": 0, "text": parsed.content, "finish_reason": null})
                            }
                        };
                        if tx.send(sse(&with_choices(json!([choice])))).await.is_err() {
                            return;
                        }
                    }
                    Event::Done(s) => {
                        let reason = if s.done_reason == "stop" && calls_sent > 0 {
                            "tool_calls"
                        } else {
                            s.done_reason
                        };
                        let choice = match kind {
                            Kind::Chat => json!({"index": 0, "delta": {}, "finish_reason": reason}),
                            Kind::Text => json!({"index": 0, "text": "", "finish_reason": reason}),
                        };
                        let _ = tx.send(sse(&with_choices(json!([choice])))).await;
                        if include_usage {
                            let mut u = with_choices(json!([]));
                            u["usage"] = usage(&s);
                            let _ = tx.send(sse(&u)).await;
                        }
                        let _ = tx.send(bytes::Bytes::from("data: [DONE]\n\n")).await;
                        return;
                    }
                    Event::Error(e) => {
                        let _ = tx
                            .send(sse(&json!({"error": {"message": e.message, "type": "api_error", "param": null, "code": null}})))
                            .await;
                        return;
                    }
                }
            }
        });
        return Ok(Response::builder()
            .header(header::CONTENT_TYPE, "text/event-stream")
            .header(header::CACHE_CONTROL, "no-cache")
            .body(Body::from_stream(
                lines.map(Ok::<_, std::convert::Infallible>),
            ))
            .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response()));
    }
    let (all, lps, s) = pipeline::collect(run.events).await?;
    let (content, thinking, calls) = (all.content, all.thinking, all.tool_calls);
    let reason = if s.done_reason == "stop" && !calls.is_empty() {
        "tool_calls"
    } else {
        s.done_reason
    };
    let mut choice = match kind {
        Kind::Chat => {
            let mut msg = json!({"role": "assistant", "content": content});
            if !thinking.is_empty() {
                msg["reasoning"] = thinking.into();
            }
            if !calls.is_empty() {
                msg["tool_calls"] = calls
                    .iter()
                    .enumerate()
                    .map(|(i, c)| tool_call(c, i))
                    .collect();
            }
            json!({"index": 0, "message": msg, "finish_reason": reason})
        }
        Kind::Text => json!({"index": 0, "text": content, "finish_reason": reason}),
    };
    choice["logprobs"] = if lps.is_empty() {
        Value::Null
    } else {
        logprobs(&lps)
    };
    let mut o = with_choices(json!([choice]));
    o["usage"] = usage(&s);
    Ok(axum::Json(o).into_response())
}

/// A stream fed by a task through a small channel: the task ends when the client goes away.
fn async_stream<F, Fut>(f: F) -> impl futures::Stream<Item = bytes::Bytes>
where
    F: FnOnce(tokio::sync::mpsc::Sender<bytes::Bytes>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    tokio::spawn(f(tx));
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

pub async fn chat(State(app): State<Arc<App>>, body: JsonBody) -> Response {
    match json_body(body) {
        Ok(v) => complete(app, v, Kind::Chat)
            .await
            .unwrap_or_else(|e| error(&e)),
        Err(e) => error(&e),
    }
}

pub async fn completions(State(app): State<Arc<App>>, body: JsonBody) -> Response {
    match json_body(body) {
        Ok(v) => complete(app, v, Kind::Text)
            .await
            .unwrap_or_else(|e| error(&e)),
        Err(e) => error(&e),
    }
}

fn model_entry(m: &crate::catalog::Model) -> Value {
    let created = m
        .modified
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default();
    json!({"id": m.display(), "object": "model", "created": created, "owned_by": m.name.namespace})
}

pub async fn models(State(app): State<Arc<App>>) -> Response {
    let data: Vec<Value> = app.catalog.list().iter().map(model_entry).collect();
    axum::Json(json!({"object": "list", "data": data})).into_response()
}

pub async fn model(State(app): State<Arc<App>>, Path(name): Path<String>) -> Response {
    match pipeline::find(&app, &name) {
        Ok(m) => axum::Json(model_entry(&m)).into_response(),
        Err(e) => error(&e),
    }
}
