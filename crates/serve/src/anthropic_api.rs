//! Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`) over the
//! same pipeline as the other two APIs, mapped as ollama's `anthropic` package maps it onto a
//! chat: `system` first, content blocks folded into messages (`tool_use` into tool calls,
//! `tool_result` into tool messages, `thinking` into the message's thinking), `max_tokens` as
//! `num_predict`, answers as content blocks with `stop_reason`, streams as Anthropic's SSE
//! events. Where we differ from ollama (docs/SERVE.md): `tool_choice` is enforced (`any` and
//! `tool` force a call by grammar, `none` drops the tools), `output_config.format` is enforced
//! as a `format`, token counts are the model's own tokenizer's, and images and server tools are
//! refused rather than dropped.

use crate::body::{json_body, JsonBody};
use crate::forced::Forced;
use crate::parse::Parsed;
use crate::pipeline::{self, ApiError, Event, Input, Summary};
use crate::sse::{self, id};
use crate::App;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use serde_json::{json, Map, Value};
use std::sync::Arc;

/// An error in Anthropic's shape, its type named by the status as Anthropic names them.
pub fn error(e: &ApiError) -> Response {
    let code = StatusCode::from_u16(e.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (code, axum::Json(error_body(e))).into_response()
}

fn error_body(e: &ApiError) -> Value {
    let kind = match e.status {
        400 | 405 | 413 => "invalid_request_error",
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        408 => "timeout_error",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        _ => "api_error",
    };
    json!({"type": "error", "error": {"type": kind, "message": e.message}, "request_id": id("req")})
}

fn bad(message: impl Into<String>) -> ApiError {
    ApiError::bad(message)
}

/// A block's text field, or a 400 naming the block.
fn text_of(block: &Value, what: &str) -> Result<String, ApiError> {
    match &block["text"] {
        Value::String(s) => Ok(s.clone()),
        _ => Err(bad(format!("{what}: a text block needs a string text"))),
    }
}

/// `system`: a string or text blocks.
fn system(v: &Value) -> Result<Option<String>, ApiError> {
    match &v["system"] {
        Value::Null => Ok(None),
        Value::String(s) if s.is_empty() => Ok(None),
        Value::String(s) => Ok(Some(s.clone())),
        Value::Array(blocks) => {
            let mut text = String::new();
            for b in blocks {
                if b["type"] == "text" {
                    text.push_str(&text_of(b, "system")?);
                }
            }
            Ok((!text.is_empty()).then_some(text))
        }
        other => Err(bad(format!(
            "system: expected a string or text blocks, got {other}"
        ))),
    }
}

/// A tool result's content: a string, or text blocks joined.
fn tool_result_text(content: &Value) -> Result<String, ApiError> {
    match content {
        Value::Null => Ok(String::new()),
        Value::String(s) => Ok(s.clone()),
        Value::Array(blocks) => {
            let mut text = String::new();
            for b in blocks {
                match b["type"].as_str() {
                    Some("text") => text.push_str(&text_of(b, "tool_result")?),
                    Some("image") => return Err(bad(
                        "images in tool results are not supported: send them in the user's message",
                    )),
                    _ => {}
                }
            }
            Ok(text)
        }
        other => Err(bad(format!(
            "tool_result content must be a string or blocks, got {other}"
        ))),
    }
}

/// One Anthropic message as the chat messages it stands for (ollama's `convertMessage`): tool
/// results become tool messages, before the user's own text.
fn convert(m: &Value, history: &[Value]) -> Result<Vec<Value>, ApiError> {
    let role = match m["role"].as_str().map(str::to_lowercase).as_deref() {
        Some(r @ ("user" | "assistant")) => r.to_string(),
        Some(other) => {
            return Err(bad(format!(
                "messages: role must be \"user\" or \"assistant\", got {other:?}"
            )))
        }
        None => return Err(bad("messages: each message needs a role")),
    };
    let blocks = match &m["content"] {
        Value::String(s) => vec![json!({"type": "text", "text": s})],
        Value::Array(b) => b.clone(),
        other => {
            return Err(bad(format!(
                "messages: content must be a string or blocks, got {other}"
            )))
        }
    };
    let (mut text, mut thinking) = (String::new(), String::new());
    let (mut calls, mut results) = (Vec::new(), Vec::new());
    let mut images = Vec::new();
    for b in &blocks {
        match b["type"].as_str() {
            Some("text") => text.push_str(&text_of(b, "messages")?),
            Some("thinking") => {
                if let Some(t) = b["thinking"].as_str() {
                    thinking = t.to_string();
                }
            }
            Some("redacted_thinking") => {}
            Some("tool_use") => {
                let (Some(call_id), Some(name)) = (b["id"].as_str(), b["name"].as_str()) else {
                    return Err(bad("tool_use blocks need an id and a name"));
                };
                let input = match &b["input"] {
                    Value::Null => json!({}),
                    Value::Object(o) => Value::Object(o.clone()),
                    other => {
                        return Err(bad(format!(
                            "tool_use input must be an object, got {other}"
                        )))
                    }
                };
                calls.push(json!({"id": call_id, "function": {"name": name, "arguments": input}}));
            }
            Some("tool_result") => {
                let use_id = b["tool_use_id"].as_str().unwrap_or_default();
                let mut msg = json!({"role": "tool", "content": tool_result_text(&b["content"])?,
                    "tool_call_id": use_id});
                // The tool's name, from the call it answers.
                let name = history
                    .iter()
                    .rev()
                    .flat_map(|p| p["tool_calls"].as_array().cloned().unwrap_or_default())
                    .find(|c| c["id"] == use_id)
                    .map(|c| c["function"]["name"].clone());
                if let Some(n) = name {
                    msg["tool_name"] = n;
                }
                results.push(msg);
            }
            Some("image") => images.push(crate::images::anthropic_source(b)?),
            Some("document") => {
                return Err(bad(
                    "documents are not supported: send their text, or images of their pages",
                ))
            }
            Some(other) => return Err(bad(format!("unknown content block type {other:?}"))),
            None => return Err(bad("each content block needs a type")),
        }
    }
    let mut out = Vec::new();
    if role == "user" {
        out.append(&mut results);
    }
    if !text.is_empty() || !calls.is_empty() || !thinking.is_empty() || !images.is_empty() {
        let mut msg = json!({"role": role, "content": text});
        if !images.is_empty() {
            msg["images"] = images.into();
        }
        if !thinking.is_empty() {
            msg["thinking"] = thinking.into();
        }
        if !calls.is_empty() {
            msg["tool_calls"] = Value::Array(calls);
        }
        out.push(msg);
    }
    out.append(&mut results);
    Ok(out)
}

fn messages(v: &Value) -> Result<Vec<Value>, ApiError> {
    let Some(list) = v["messages"].as_array() else {
        return Err(bad("messages: expected an array"));
    };
    let mut out: Vec<Value> = Vec::new();
    if let Some(s) = system(v)? {
        out.push(json!({"role": "system", "content": s}));
    }
    for m in list {
        let converted = convert(m, &out)?;
        out.extend(converted);
    }
    Ok(out)
}

/// `tools`: custom tools as functions; Anthropic's server tools (web search, code execution)
/// are not ours to run.
fn tools(v: &Value) -> Result<Vec<Value>, ApiError> {
    let Some(list) = v["tools"].as_array() else {
        return match &v["tools"] {
            Value::Null => Ok(Vec::new()),
            other => Err(bad(format!("tools: expected an array, got {other}"))),
        };
    };
    let mut out = Vec::new();
    for (i, t) in list.iter().enumerate() {
        match t["type"].as_str() {
            None | Some("custom") => {}
            Some(other) => {
                return Err(bad(format!(
                    "tools.{i}: the {other:?} tool is Anthropic's to run; only custom tools are supported"
                )))
            }
        }
        let Some(name) = t["name"].as_str().filter(|n| !n.is_empty()) else {
            return Err(bad(format!("tools.{i}: a tool needs a name")));
        };
        let mut f = json!({"name": name});
        if let Some(d) = t["description"].as_str() {
            f["description"] = d.into();
        }
        match &t["input_schema"] {
            Value::Null => {}
            s @ Value::Object(_) => f["parameters"] = s.clone(),
            other => {
                return Err(bad(format!(
                    "tools.{i}: input_schema must be an object, got {other}"
                )))
            }
        }
        out.push(json!({"type": "function", "function": f}));
    }
    Ok(out)
}

/// `tool_choice`: `auto`, `any` (a call of some tool), `tool` (that one), `none`.
fn tool_choice(v: &Value) -> Result<(Option<Forced>, bool), ApiError> {
    match &v["tool_choice"] {
        Value::Null => Ok((None, false)),
        c => match c["type"].as_str() {
            Some("auto") => Ok((None, false)),
            Some("any") => Ok((Some(Forced::Any), false)),
            Some("tool") => match c["name"].as_str() {
                Some(n) => Ok((Some(Forced::Named(n.to_string())), false)),
                None => Err(bad("tool_choice of type tool needs a name")),
            },
            Some("none") => Ok((None, true)),
            _ => Err(bad(format!("invalid tool_choice {c}"))),
        },
    }
}

/// The request as a pipeline input.
fn input(v: &Value) -> Result<Input, ApiError> {
    let model = v["model"]
        .as_str()
        .filter(|m| !m.is_empty())
        .ok_or_else(|| bad("model: field required"))?
        .to_string();
    let mut options = Map::new();
    match &v["max_tokens"] {
        // 0 pre-warms the prompt cache: the prompt is evaluated (one token generated and
        // dropped), and the runner's prefix cache keeps it.
        Value::Number(n) if n.as_u64().is_some() => {
            options.insert("num_predict".into(), n.as_u64().unwrap_or(1).max(1).into());
        }
        Value::Null => return Err(bad("max_tokens: field required")),
        other => {
            return Err(bad(format!(
                "max_tokens: expected a non-negative integer, got {other}"
            )))
        }
    }
    // Current SDKs send no sampling parameters; older ones and raw HTTP do (seed is ours).
    for (key, option) in [
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("top_k", "top_k"),
        ("seed", "seed"),
    ] {
        match &v[key] {
            Value::Null => {}
            n @ Value::Number(_) => {
                options.insert(option.into(), n.clone());
            }
            other => return Err(bad(format!("{key}: expected a number, got {other}"))),
        }
    }
    match &v["stop_sequences"] {
        Value::Null => {}
        Value::Array(s) if s.iter().all(Value::is_string) => {
            if !s.is_empty() {
                options.insert("stop".into(), Value::Array(s.clone()));
            }
        }
        other => {
            return Err(bad(format!(
                "stop_sequences: expected strings, got {other}"
            )))
        }
    }
    let mut think = match v["thinking"]["type"].as_str() {
        Some("enabled" | "adaptive" | "between_tools") => Some(true),
        Some("disabled") => Some(false),
        None if v["thinking"].is_null() => None,
        _ => return Err(bad(format!("invalid thinking {}", v["thinking"]))),
    };
    let out = &v["output_config"];
    match out["effort"].as_str() {
        None => {}
        Some("low" | "medium" | "high" | "xhigh" | "max") => think = think.or(Some(true)),
        Some(other) => {
            return Err(bad(format!(
                "output_config.effort: unknown effort {other:?}"
            )))
        }
    }
    let format = match &out["format"] {
        Value::Null => Value::Null,
        f if f["type"] == "json_schema" && f["schema"].is_object() => f["schema"].clone(),
        other => {
            return Err(bad(format!(
                "output_config.format: expected {{\"type\": \"json_schema\", \"schema\": {{...}}}}, got {other}"
            )))
        }
    };
    let (forced, no_tools) = tool_choice(v)?;
    let tools = if no_tools { Vec::new() } else { tools(v)? };
    Ok(Input {
        model,
        messages: messages(v)?,
        tools,
        think,
        options,
        forced,
        format,
        ..Default::default()
    })
}

/// `done_reason` and calls as Anthropic's `stop_reason`.
fn stop_reason(s: &Summary, calls: bool) -> &'static str {
    if calls {
        "tool_use"
    } else if s.done_reason == "length" {
        "max_tokens"
    } else {
        "end_turn"
    }
}

fn tool_use(call: &Value) -> Value {
    json!({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
        "input": call["function"]["arguments"]})
}

fn usage(s: &Summary) -> Value {
    json!({"input_tokens": s.prompt_eval_count, "output_tokens": s.eval_count})
}

/// `POST /v1/messages`.
pub async fn messages_route(State(app): State<Arc<App>>, body: JsonBody) -> Response {
    let run = async {
        let v = json_body(body)?;
        let input = input(&v)?;
        let stream = match &v["stream"] {
            Value::Null => false,
            Value::Bool(b) => *b,
            other => return Err(bad(format!("stream: expected a boolean, got {other}"))),
        };
        let m = pipeline::find(&app, &input.model)?;
        let model = input.model.clone();
        let run = pipeline::start(&app, &m, input).await?;
        let message_id = id("msg");
        if stream {
            return Ok(streamed(run.events, message_id, model));
        }
        let (all, _, s) = pipeline::collect(run.events).await?;
        let mut content = Vec::new();
        if !all.thinking.is_empty() {
            content.push(json!({"type": "thinking", "thinking": all.thinking, "signature": ""}));
        }
        if !all.content.is_empty() {
            content.push(json!({"type": "text", "text": all.content}));
        }
        content.extend(all.tool_calls.iter().map(tool_use));
        Ok(axum::Json(json!({
            "id": message_id, "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": stop_reason(&s, !all.tool_calls.is_empty()),
            "stop_sequence": null, "usage": usage(&s),
        }))
        .into_response())
    };
    run.await.unwrap_or_else(|e| error(&e))
}

/// Content blocks as Anthropic streams them: each opened, grown by deltas, closed; thinking,
/// then text, then each tool call whole.
#[derive(Default)]
struct Blocks {
    index: usize,
    /// The open block: "thinking" or "text".
    open: Option<&'static str>,
    calls: usize,
}

impl Blocks {
    fn close(&mut self, out: &mut Vec<bytes::Bytes>) {
        if self.open.take().is_some() {
            out.push(sse::event(
                "content_block_stop",
                &json!({"type": "content_block_stop", "index": self.index}),
            ));
            self.index += 1;
        }
    }

    fn delta(&mut self, kind: &'static str, text: &str, out: &mut Vec<bytes::Bytes>) {
        if text.is_empty() {
            return;
        }
        if self.open != Some(kind) {
            self.close(out);
            let block = match kind {
                "thinking" => json!({"type": "thinking", "thinking": "", "signature": ""}),
                _ => json!({"type": "text", "text": ""}),
            };
            out.push(sse::event(
                "content_block_start",
                &json!({"type": "content_block_start", "index": self.index, "content_block": block}),
            ));
            self.open = Some(kind);
        }
        let delta = match kind {
            "thinking" => json!({"type": "thinking_delta", "thinking": text}),
            _ => json!({"type": "text_delta", "text": text}),
        };
        out.push(sse::event(
            "content_block_delta",
            &json!({"type": "content_block_delta", "index": self.index, "delta": delta}),
        ));
    }

    fn piece(&mut self, p: &Parsed) -> Vec<bytes::Bytes> {
        let mut out = Vec::new();
        self.delta("thinking", &p.thinking, &mut out);
        self.delta("text", &p.content, &mut out);
        for call in &p.tool_calls {
            self.close(&mut out);
            let mut start = tool_use(call);
            start["input"] = json!({});
            out.push(sse::event(
                "content_block_start",
                &json!({"type": "content_block_start", "index": self.index, "content_block": start}),
            ));
            out.push(sse::event(
                "content_block_delta",
                &json!({"type": "content_block_delta", "index": self.index,
                    "delta": {"type": "input_json_delta",
                        "partial_json": call["function"]["arguments"].to_string()}}),
            ));
            out.push(sse::event(
                "content_block_stop",
                &json!({"type": "content_block_stop", "index": self.index}),
            ));
            self.index += 1;
            self.calls += 1;
        }
        out
    }
}

fn streamed(
    mut events: std::pin::Pin<Box<dyn futures::Stream<Item = Event> + Send>>,
    message_id: String,
    model: String,
) -> Response {
    let (tx, rx) = tokio::sync::mpsc::channel::<bytes::Bytes>(16);
    tokio::spawn(async move {
        let mut blocks = Blocks::default();
        let mut started = false;
        loop {
            // A client that left ends the completion now, not at the next text.
            let ev = tokio::select! {
                _ = tx.closed() => return,
                ev = events.next() => match ev { Some(ev) => ev, None => return },
            };
            let mut out = Vec::new();
            if !started {
                started = true;
                out.push(sse::event(
                    "message_start",
                    &json!({"type": "message_start", "message": {
                    "id": message_id, "type": "message", "role": "assistant", "model": model,
                    "content": [], "stop_reason": null, "stop_sequence": null,
                    "usage": {"input_tokens": 0, "output_tokens": 0}}}),
                ));
                out.push(sse::event("ping", &json!({"type": "ping"})));
            }
            let last = match ev {
                Event::Piece { parsed, .. } => {
                    out.extend(blocks.piece(&parsed));
                    false
                }
                Event::Done(s) => {
                    blocks.close(&mut out);
                    out.push(sse::event("message_delta", &json!({"type": "message_delta",
                        "delta": {"stop_reason": stop_reason(&s, blocks.calls > 0), "stop_sequence": null},
                        "usage": usage(&s)})));
                    out.push(sse::event("message_stop", &json!({"type": "message_stop"})));
                    true
                }
                Event::Error(e) => {
                    out.push(sse::event("error", &error_body(&e)));
                    true
                }
            };
            for b in out {
                if tx.send(b).await.is_err() {
                    return;
                }
            }
            if last {
                return;
            }
        }
    });
    sse::response(rx)
}

/// `POST /v1/messages/count_tokens`: the rendered prompt's tokens, by the model's own
/// tokenizer (its runner is loaded for it, as the request that follows will need it).
pub async fn count_tokens(State(app): State<Arc<App>>, body: JsonBody) -> Response {
    let run = async {
        let mut v = json_body(body)?;
        // Counting needs no budget; the field is required only to generate.
        if v["max_tokens"].is_null() {
            v["max_tokens"] = 1.into();
        }
        let input = input(&v)?;
        let m = pipeline::find(&app, &input.model)?;
        let n = pipeline::count_tokens(&app, &m, input).await?;
        Ok(axum::Json(json!({"input_tokens": n})).into_response())
    };
    run.await.unwrap_or_else(|e| error(&e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_map_onto_a_chat_as_ollama_maps_them() {
        let v = json!({"model": "m", "max_tokens": 64, "system": [{"type": "text", "text": "Be brief."}],
            "temperature": 0.5, "stop_sequences": ["END"],
            "tools": [{"name": "get_weather", "description": "Weather", "input_schema": {"type": "object",
                "properties": {"city": {"type": "string"}}, "required": ["city"]}}],
            "tool_choice": {"type": "tool", "name": "get_weather"},
            "thinking": {"type": "disabled"},
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "use the tool", "signature": "x"},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "18C"}]},
                    {"type": "text", "text": "And tomorrow?"}]}]});
        let i = input(&v).unwrap();
        assert_eq!(i.options["num_predict"], 64);
        assert_eq!(i.options["temperature"], 0.5);
        assert_eq!(i.options["stop"], json!(["END"]));
        assert_eq!(i.think, Some(false));
        assert_eq!(i.forced, Some(Forced::Named("get_weather".into())));
        assert_eq!(
            i.tools[0]["function"]["parameters"]["required"],
            json!(["city"])
        );
        assert_eq!(
            i.messages,
            vec![
                json!({"role": "system", "content": "Be brief."}),
                json!({"role": "user", "content": "Weather in Paris?"}),
                json!({"role": "assistant", "content": "Checking.", "thinking": "use the tool",
                    "tool_calls": [{"id": "toolu_1", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}),
                json!({"role": "tool", "content": "18C", "tool_call_id": "toolu_1", "tool_name": "get_weather"}),
                json!({"role": "user", "content": "And tomorrow?"}),
            ]
        );
    }

    #[test]
    fn what_is_not_served_is_refused() {
        let base =
            json!({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]});
        let with = |k: &str, val: Value| {
            let mut v = base.clone();
            v[k] = val;
            input(&v).unwrap_err().message
        };
        let mut no_max = base.clone();
        no_max.as_object_mut().unwrap().remove("max_tokens");
        assert!(input(&no_max).unwrap_err().message.contains("max_tokens"));
        assert!(with("max_tokens", json!(-1)).contains("non-negative"));
        assert!(with("output_config", json!({"format": {"type": "regex"}})).contains("json_schema"));
        assert!(with(
            "tools",
            json!([{"type": "web_search_20250305", "name": "web_search"}])
        )
        .contains("only custom tools"));
        assert!(with(
            "messages",
            json!([{"role": "user", "content": [{"type": "image",
            "source": {"type": "url", "url": "https://example.com/a.png"}}]}])
        )
        .contains("image URLs are not currently supported"));
        assert!(with(
            "messages",
            json!([{"role": "user", "content": [{"type": "image",
            "source": {"type": "base64", "media_type": "image/tiff", "data": "aGk="}}]}])
        )
        .contains("media_type"));
        assert!(with("messages", json!([{"role": "robot", "content": "x"}])).contains("role"));
        assert!(with("tool_choice", json!({"type": "tool"})).contains("name"));
        let e = error_body(&ApiError::new(404, "nope"));
        assert_eq!(e["type"], "error");
        assert_eq!(e["error"]["type"], "not_found_error");
    }

    #[test]
    fn a_stream_is_blocks_opened_grown_and_closed() {
        let mut b = Blocks::default();
        let text = |chunks: Vec<bytes::Bytes>| {
            chunks
                .iter()
                .map(|c| String::from_utf8_lossy(c).into_owned())
                .collect::<String>()
        };
        let t = text(b.piece(&Parsed {
            thinking: "hm".into(),
            ..Default::default()
        }));
        assert!(
            t.contains("event: content_block_start") && t.contains("thinking_delta"),
            "{t}"
        );
        let t = text(b.piece(&Parsed {
            content: "Hi".into(),
            ..Default::default()
        }));
        assert!(
            t.starts_with("event: content_block_stop\n") && t.contains("\"index\":0"),
            "{t}"
        );
        assert!(t.contains("\"index\":1") && t.contains("text_delta"), "{t}");
        let t = text(b.piece(&Parsed {
            tool_calls: vec![
                json!({"id": "call_1", "function": {"name": "f", "arguments": {"a": 1}}}),
            ],
            ..Default::default()
        }));
        assert!(t.contains("\"partial_json\":\"{\\\"a\\\":1}\""), "{t}");
        assert!(t.contains("\"index\":2"), "{t}");
        assert_eq!(b.calls, 1);
    }
}
