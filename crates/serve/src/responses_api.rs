//! OpenAI's Responses API (`POST /v1/responses`) over the same pipeline, mapped as ollama's
//! `openai/responses.go` maps it onto a chat: `instructions` first, input items folded into
//! messages (`function_call` items into the assistant's tool calls, `function_call_output`
//! into tool messages, `reasoning` into the next assistant message's thinking), answers as
//! output items (reasoning, then the message or the function calls), streams as the API's
//! `response.*` events with sequence numbers. Where we differ from ollama (docs/SERVE.md):
//! `tool_choice` is enforced, a response cut by `max_output_tokens` is `incomplete` (as
//! OpenAI's is), and `previous_response_id` is refused (nothing is stored to continue from)
//! rather than ignored.

use crate::body::{json_body, JsonBody};
use crate::forced::Forced;
use crate::openai_api;
use crate::parse::Parsed;
use crate::pipeline::{self, ApiError, Event, Input, Summary};
use crate::sse::{self, id};
use crate::App;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use serde_json::{json, Map, Value};
use std::sync::Arc;

fn bad(message: impl Into<String>) -> ApiError {
    ApiError::bad(message)
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default()
}

/// A content list's text (`input_text`, `output_text`), or a 400 for what no model here reads.
fn content_text(content: &Value, what: &str) -> Result<String, ApiError> {
    Ok(content_parts(content, what)?.0)
}

/// A content list's text and its images (`input_image` data URLs, as base64).
fn content_parts(content: &Value, what: &str) -> Result<(String, Vec<String>), ApiError> {
    let mut images = Vec::new();
    let text =
        match content {
            Value::Null => Ok(String::new()),
            Value::String(s) => Ok(s.clone()),
            Value::Array(parts) => {
                let mut text = String::new();
                for p in parts {
                    match p["type"].as_str() {
                        Some("input_text" | "output_text" | "text") => match p["text"].as_str() {
                            Some(t) => text.push_str(t),
                            None => return Err(bad(format!("{what}: a text part needs its text"))),
                        },
                        Some("input_image") => {
                            let url = p["image_url"]
                                .as_str()
                                .or(p["image_url"]["url"].as_str())
                                .ok_or_else(|| {
                                    bad(format!("{what}: an input_image needs its image_url"))
                                })?;
                            images.push(crate::images::from_data_url(url, what)?);
                        }
                        Some("input_file" | "input_audio") => return Err(bad(
                            "files and audio are not supported: no model served here reads them",
                        )),
                        Some("refusal") => {}
                        other => {
                            return Err(bad(format!(
                                "{what}: unknown content type {}",
                                other.unwrap_or("(none)")
                            )))
                        }
                    }
                }
                Ok(text)
            }
            other => Err(bad(format!(
                "{what}: content must be a string or parts, got {other}"
            ))),
        }?;
    Ok((text, images))
}

/// The request's input as chat messages (ollama's `FromResponsesRequest`).
fn messages(v: &Value) -> Result<Vec<Value>, ApiError> {
    let mut out: Vec<Value> = Vec::new();
    if let Some(i) = v["instructions"].as_str().filter(|i| !i.is_empty()) {
        out.push(json!({"role": "system", "content": i}));
    }
    let items = match &v["input"] {
        Value::String(s) => {
            out.push(json!({"role": "user", "content": s}));
            return Ok(out);
        }
        Value::Array(items) => items,
        Value::Null => return Err(bad("input: field required")),
        other => {
            return Err(bad(format!(
                "input: expected a string or items, got {other}"
            )))
        }
    };
    let mut thinking = String::new();
    for (i, item) in items.iter().enumerate() {
        let kind = item["type"]
            .as_str()
            .unwrap_or(if item.get("role").is_some() {
                "message"
            } else {
                ""
            });
        match kind {
            "message" => {
                let role = match item["role"].as_str() {
                    Some("user") => "user",
                    Some("assistant") => "assistant",
                    Some("system" | "developer") => "system",
                    other => {
                        return Err(bad(format!(
                            "input.{i}: unknown role {}",
                            other.unwrap_or("(none)")
                        )))
                    }
                };
                let (text, images) = content_parts(&item["content"], &format!("input.{i}"))?;
                let mut msg = json!({"role": role, "content": text});
                if !images.is_empty() {
                    msg["images"] = images.into();
                }
                if role == "assistant" && !thinking.is_empty() {
                    msg["thinking"] = std::mem::take(&mut thinking).into();
                }
                // An assistant's text after its own calls joins the message that made them.
                let after_calls = out.last().is_some_and(|l: &Value| {
                    l["role"] == "assistant" && l["tool_calls"].is_array()
                });
                if role == "assistant" && after_calls {
                    let last = out.last_mut().expect("checked");
                    let joined = format!("{}{}", last["content"].as_str().unwrap_or(""), text);
                    last["content"] = joined.into();
                } else {
                    out.push(msg);
                }
            }
            "function_call" => {
                let (Some(call_id), Some(name)) = (item["call_id"].as_str(), item["name"].as_str())
                else {
                    return Err(bad(format!(
                        "input.{i}: a function_call needs a call_id and a name"
                    )));
                };
                let args = match &item["arguments"] {
                    Value::String(s) if s.trim().is_empty() => json!({}),
                    Value::String(s) => serde_json::from_str::<Value>(s)
                        .ok()
                        .filter(Value::is_object)
                        .ok_or_else(|| {
                            bad(format!("input.{i}: arguments must be a JSON object"))
                        })?,
                    Value::Null => json!({}),
                    _ => return Err(bad(format!("input.{i}: arguments must be a string"))),
                };
                let call = json!({"id": call_id, "function": {"name": name, "arguments": args}});
                match out.last_mut() {
                    Some(last) if last["role"] == "assistant" => {
                        match last["tool_calls"].as_array_mut() {
                            Some(calls) => calls.push(call),
                            None => last["tool_calls"] = json!([call]),
                        }
                        if !thinking.is_empty() {
                            last["thinking"] = std::mem::take(&mut thinking).into();
                        }
                    }
                    _ => {
                        let mut msg =
                            json!({"role": "assistant", "content": "", "tool_calls": [call]});
                        if !thinking.is_empty() {
                            msg["thinking"] = std::mem::take(&mut thinking).into();
                        }
                        out.push(msg);
                    }
                }
            }
            "function_call_output" => {
                let call_id = item["call_id"].as_str().unwrap_or_default();
                let text = content_text(&item["output"], &format!("input.{i}"))?;
                let mut msg = json!({"role": "tool", "content": text, "tool_call_id": call_id});
                let name = out
                    .iter()
                    .rev()
                    .flat_map(|m| m["tool_calls"].as_array().cloned().unwrap_or_default())
                    .find(|c| c["id"] == call_id)
                    .map(|c| c["function"]["name"].clone());
                if let Some(n) = name {
                    msg["tool_name"] = n;
                }
                out.push(msg);
            }
            "reasoning" => {
                let summary: String = item["summary"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|s| s["text"].as_str())
                    .collect();
                thinking = item["encrypted_content"]
                    .as_str()
                    .map(String::from)
                    .unwrap_or(summary);
            }
            "item_reference" => {
                return Err(bad(format!(
                    "input.{i}: item references are not supported: nothing is stored; send the items themselves"
                )))
            }
            other => {
                return Err(bad(format!(
                    "input.{i}: the {other:?} item is not supported"
                )))
            }
        }
    }
    if !thinking.is_empty() {
        out.push(json!({"role": "assistant", "content": "", "thinking": thinking}));
    }
    Ok(out)
}

/// Function tools, flat as this API writes them, as chat tools.
fn tools(v: &Value) -> Result<Vec<Value>, ApiError> {
    let list = match &v["tools"] {
        Value::Null => return Ok(Vec::new()),
        Value::Array(l) => l,
        other => return Err(bad(format!("tools: expected an array, got {other}"))),
    };
    let mut out = Vec::new();
    for (i, t) in list.iter().enumerate() {
        if t["type"] != "function" {
            return Err(bad(format!(
                "tools.{i}: the {} tool is OpenAI's to run; only function tools are supported",
                t["type"]
            )));
        }
        let Some(name) = t["name"].as_str().filter(|n| !n.is_empty()) else {
            return Err(bad(format!("tools.{i}: a function needs a name")));
        };
        let mut f = json!({"name": name});
        if let Some(d) = t["description"].as_str() {
            f["description"] = d.into();
        }
        if t["parameters"].is_object() {
            f["parameters"] = t["parameters"].clone();
        }
        out.push(json!({"type": "function", "function": f}));
    }
    Ok(out)
}

fn tool_choice(v: &Value) -> Result<(Option<Forced>, bool), ApiError> {
    match &v["tool_choice"] {
        Value::Null => Ok((None, false)),
        Value::String(s) => match s.as_str() {
            "auto" => Ok((None, false)),
            "required" => Ok((Some(Forced::Any), false)),
            "none" => Ok((None, true)),
            other => Err(bad(format!("unknown tool_choice {other:?}"))),
        },
        c if c["type"] == "function" => match c["name"].as_str() {
            Some(n) => Ok((Some(Forced::Named(n.to_string())), false)),
            None => Err(bad("tool_choice of type function needs a name")),
        },
        other => Err(bad(format!("invalid tool_choice {other}"))),
    }
}

fn input(v: &Value) -> Result<Input, ApiError> {
    let model = v["model"]
        .as_str()
        .filter(|m| !m.is_empty())
        .ok_or_else(|| bad("model is required"))?
        .to_string();
    if v["previous_response_id"].as_str().is_some() || !v["conversation"].is_null() {
        return Err(bad(
            "previous_response_id and conversation are not supported: responses are not stored; send the whole conversation in input",
        ));
    }
    if v["background"] == true {
        return Err(bad("background responses are not supported"));
    }
    let mut options = Map::new();
    // ollama's default: temperature 1 when the request sets none.
    options.insert("temperature".into(), json!(1.0));
    for (key, option) in [
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("max_output_tokens", "num_predict"),
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
    let think = match v["reasoning"]["effort"].as_str() {
        None => None,
        Some("none") => Some(false),
        Some("minimal" | "low" | "medium" | "high" | "xhigh") => Some(true),
        Some(other) => return Err(bad(format!("reasoning.effort: unknown effort {other:?}"))),
    };
    let f = &v["text"]["format"];
    let format = match f["type"].as_str() {
        None | Some("text") => Value::Null,
        Some("json_object") => json!("json"),
        Some("json_schema") if f["schema"].is_object() => f["schema"].clone(),
        _ => return Err(bad(format!("text.format: unsupported format {f}"))),
    };
    let (forced, no_tools) = tool_choice(v)?;
    Ok(Input {
        model,
        messages: messages(v)?,
        tools: if no_tools { Vec::new() } else { tools(v)? },
        think,
        options,
        format,
        forced,
        ..Default::default()
    })
}

/// The parts of a response object that echo the request.
fn envelope(v: &Value, response_id: &str, model: &str) -> Value {
    let format = match v["text"]["format"].clone() {
        Value::Null => json!({"type": "text"}),
        f => f,
    };
    json!({
        "id": response_id, "object": "response", "created_at": unix_now(), "completed_at": null,
        "status": "in_progress", "incomplete_details": null, "model": model,
        "previous_response_id": null, "instructions": v["instructions"], "output": [],
        "error": null, "tools": v["tools"].as_array().cloned().unwrap_or_default(),
        "tool_choice": if v["tool_choice"].is_null() { json!("auto") } else { v["tool_choice"].clone() },
        "truncation": "disabled", "parallel_tool_calls": true, "text": {"format": format},
        "top_p": v["top_p"].as_f64().unwrap_or(1.0), "presence_penalty": 0, "frequency_penalty": 0,
        "top_logprobs": 0, "temperature": v["temperature"].as_f64().unwrap_or(1.0),
        "reasoning": if v["reasoning"].is_object() { v["reasoning"].clone() } else { Value::Null },
        "usage": null, "max_output_tokens": v["max_output_tokens"], "max_tool_calls": null,
        "store": false, "background": false, "service_tier": "default", "metadata": {},
        "safety_identifier": null, "prompt_cache_key": null,
    })
}

fn usage(s: &Summary) -> Value {
    json!({"input_tokens": s.prompt_eval_count, "output_tokens": s.eval_count,
        "total_tokens": s.prompt_eval_count + s.eval_count,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens_details": {"reasoning_tokens": 0}})
}

/// Completed, or incomplete when `max_output_tokens` cut it.
fn finish(mut r: Value, s: &Summary, output: Vec<Value>) -> Value {
    r["output"] = Value::Array(output);
    r["usage"] = usage(s);
    r["completed_at"] = unix_now().into();
    if s.done_reason == "length" {
        r["status"] = "incomplete".into();
        r["incomplete_details"] = json!({"reason": "max_output_tokens"});
    } else {
        r["status"] = "completed".into();
    }
    r
}

fn text_part(text: &str) -> Value {
    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []})
}

fn reasoning_item(item_id: &str, thinking: &str) -> Value {
    json!({"id": item_id, "type": "reasoning",
        "summary": [{"type": "summary_text", "text": thinking}], "encrypted_content": thinking})
}

fn message_item(item_id: &str, text: &str, status: &str) -> Value {
    json!({"id": item_id, "type": "message", "status": status, "role": "assistant",
        "content": [text_part(text)]})
}

fn call_item(item_id: &str, call: &Value, status: &str, arguments: &str) -> Value {
    json!({"id": item_id, "type": "function_call", "status": status, "call_id": call["id"],
        "name": call["function"]["name"], "arguments": arguments})
}

/// `POST /v1/responses`.
pub async fn responses(State(app): State<Arc<App>>, body: JsonBody) -> Response {
    let run = async {
        let v = json_body(body)?;
        let input = input(&v)?;
        let stream = v["stream"].as_bool().unwrap_or(false);
        let m = pipeline::find(&app, &input.model)?;
        let model = input.model.clone();
        let run = pipeline::start(&app, &m, input).await?;
        let response_id = id("resp");
        let head = envelope(&v, &response_id, &model);
        if stream {
            return Ok(streamed(run.events, head));
        }
        let (all, _, s) = pipeline::collect(run.events).await?;
        let mut output = Vec::new();
        if !all.thinking.is_empty() {
            output.push(reasoning_item(&id("rs"), &all.thinking));
        }
        if all.tool_calls.is_empty() {
            output.push(message_item(&id("msg"), &all.content, "completed"));
        }
        for call in &all.tool_calls {
            let args = call["function"]["arguments"].to_string();
            output.push(call_item(&id("fc"), call, "completed", &args));
        }
        Ok(axum::Json(finish(head, &s, output)).into_response())
    };
    run.await.unwrap_or_else(|e| openai_api::error(&e))
}

/// The stream's state: items open, completed, and the next sequence number.
struct Stream {
    head: Value,
    sequence: u64,
    index: usize,
    done: Vec<Value>,
    reasoning: Option<(String, String)>,
    message: Option<(String, String)>,
    calls: usize,
}

impl Stream {
    fn event(&mut self, kind: &str, mut data: Value) -> bytes::Bytes {
        data["type"] = kind.into();
        data["sequence_number"] = self.sequence.into();
        self.sequence += 1;
        sse::event(kind, &data)
    }

    fn response(&self, status: &str) -> Value {
        let mut r = self.head.clone();
        r["status"] = status.into();
        r
    }

    fn end_reasoning(&mut self, out: &mut Vec<bytes::Bytes>) {
        let Some((item_id, text)) = self.reasoning.take() else {
            return;
        };
        let item = reasoning_item(&item_id, &text);
        let index = self.index;
        out.push(self.event(
            "response.reasoning_summary_text.done",
            json!({"item_id": item_id, "output_index": index, "summary_index": 0, "text": text}),
        ));
        out.push(self.event(
            "response.output_item.done",
            json!({"output_index": index, "item": item}),
        ));
        self.done.push(item);
        self.index += 1;
    }

    fn end_message(&mut self, out: &mut Vec<bytes::Bytes>) {
        let Some((item_id, text)) = self.message.take() else {
            return;
        };
        let index = self.index;
        let item = message_item(&item_id, &text, "completed");
        out.push(self.event(
            "response.output_text.done",
            json!({"item_id": item_id, "output_index": index, "content_index": 0, "text": text, "logprobs": []}),
        ));
        out.push(self.event(
            "response.content_part.done",
            json!({"item_id": item_id, "output_index": index, "content_index": 0, "part": text_part(&text)}),
        ));
        out.push(self.event(
            "response.output_item.done",
            json!({"output_index": index, "item": item}),
        ));
        self.done.push(item);
        self.index += 1;
    }

    fn piece(&mut self, p: &Parsed) -> Vec<bytes::Bytes> {
        let mut out = Vec::new();
        if !p.thinking.is_empty() {
            if self.reasoning.is_none() {
                let item_id = id("rs");
                let index = self.index;
                out.push(self.event(
                    "response.output_item.added",
                    json!({"output_index": index, "item": {"id": item_id, "type": "reasoning", "summary": []}}),
                ));
                self.reasoning = Some((item_id, String::new()));
            }
            let index = self.index;
            let (item_id, text) = self.reasoning.as_mut().expect("opened");
            text.push_str(&p.thinking);
            let item_id = item_id.clone();
            out.push(self.event(
                "response.reasoning_summary_text.delta",
                json!({"item_id": item_id, "output_index": index, "summary_index": 0, "delta": p.thinking}),
            ));
        }
        if !p.content.is_empty() && self.calls == 0 {
            self.end_reasoning(&mut out);
            if self.message.is_none() {
                let item_id = id("msg");
                let index = self.index;
                out.push(self.event(
                    "response.output_item.added",
                    json!({"output_index": index, "item": {"id": item_id, "type": "message",
                        "status": "in_progress", "role": "assistant", "content": []}}),
                ));
                out.push(self.event(
                    "response.content_part.added",
                    json!({"item_id": item_id, "output_index": index, "content_index": 0, "part": text_part("")}),
                ));
                self.message = Some((item_id, String::new()));
            }
            let index = self.index;
            let (item_id, text) = self.message.as_mut().expect("opened");
            text.push_str(&p.content);
            let item_id = item_id.clone();
            out.push(self.event(
                "response.output_text.delta",
                json!({"item_id": item_id, "output_index": index, "content_index": 0, "delta": p.content, "logprobs": []}),
            ));
        }
        for call in &p.tool_calls {
            self.end_reasoning(&mut out);
            self.end_message(&mut out);
            let item_id = id("fc");
            let index = self.index;
            let args = call["function"]["arguments"].to_string();
            out.push(self.event(
                "response.output_item.added",
                json!({"output_index": index, "item": call_item(&item_id, call, "in_progress", "")}),
            ));
            out.push(self.event(
                "response.function_call_arguments.delta",
                json!({"item_id": item_id, "output_index": index, "delta": args}),
            ));
            out.push(self.event(
                "response.function_call_arguments.done",
                json!({"item_id": item_id, "output_index": index, "arguments": args}),
            ));
            let item = call_item(&item_id, call, "completed", &args);
            out.push(self.event(
                "response.output_item.done",
                json!({"output_index": index, "item": item}),
            ));
            self.done.push(item);
            self.index += 1;
            self.calls += 1;
        }
        out
    }

    fn end(&mut self, s: &Summary) -> Vec<bytes::Bytes> {
        let mut out = Vec::new();
        self.end_reasoning(&mut out);
        self.end_message(&mut out);
        let r = finish(self.head.clone(), s, std::mem::take(&mut self.done));
        let kind = if r["status"] == "incomplete" {
            "response.incomplete"
        } else {
            "response.completed"
        };
        out.push(self.event(kind, json!({"response": r})));
        out
    }
}

fn streamed(
    mut events: std::pin::Pin<Box<dyn futures::Stream<Item = Event> + Send>>,
    head: Value,
) -> Response {
    let (tx, rx) = tokio::sync::mpsc::channel::<bytes::Bytes>(16);
    tokio::spawn(async move {
        let mut st = Stream {
            head,
            sequence: 0,
            index: 0,
            done: Vec::new(),
            reasoning: None,
            message: None,
            calls: 0,
        };
        let mut out = Vec::new();
        let created = st.response("in_progress");
        out.push(st.event("response.created", json!({"response": created.clone()})));
        out.push(st.event("response.in_progress", json!({"response": created})));
        loop {
            for b in out.drain(..) {
                if tx.send(b).await.is_err() {
                    return;
                }
            }
            let ev = tokio::select! {
                _ = tx.closed() => return,
                ev = events.next() => match ev { Some(ev) => ev, None => return },
            };
            match ev {
                Event::Piece { parsed, .. } => out = st.piece(&parsed),
                Event::Done(s) => {
                    for b in st.end(&s) {
                        if tx.send(b).await.is_err() {
                            return;
                        }
                    }
                    return;
                }
                Event::Error(e) => {
                    let mut r = st.response("failed");
                    r["error"] = json!({"code": "server_error", "message": e.message});
                    let _ = tx
                        .send(st.event("response.failed", json!({"response": r})))
                        .await;
                    return;
                }
            }
        }
    });
    sse::response(rx)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn input_items_map_onto_a_chat_as_ollama_maps_them() {
        let v = json!({"model": "m", "instructions": "Be brief.", "max_output_tokens": 32,
            "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object",
                "properties": {"city": {"type": "string"}}, "required": ["city"]}}],
            "tool_choice": "required", "reasoning": {"effort": "low"},
            "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
            "input": [
                {"role": "user", "content": "Weather in Paris?"},
                {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "call it"}]},
                {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\":\"Paris\"}"},
                {"type": "function_call_output", "call_id": "call_1", "output": "18C"},
                {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Answer now."}]}]});
        let i = input(&v).unwrap();
        assert_eq!(i.options["num_predict"], 32);
        assert_eq!(i.options["temperature"], 1.0);
        assert_eq!(i.think, Some(true));
        assert_eq!(i.forced, Some(Forced::Any));
        assert_eq!(i.format, json!({"type": "object"}));
        assert_eq!(i.tools[0]["function"]["name"], "get_weather");
        assert_eq!(
            i.messages,
            vec![
                json!({"role": "system", "content": "Be brief."}),
                json!({"role": "user", "content": "Weather in Paris?"}),
                json!({"role": "assistant", "content": "", "thinking": "call it",
                    "tool_calls": [{"id": "call_1", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}),
                json!({"role": "tool", "content": "18C", "tool_call_id": "call_1", "tool_name": "get_weather"}),
                json!({"role": "system", "content": "Answer now."}),
            ]
        );
    }

    #[test]
    fn what_is_not_served_is_refused() {
        let base = json!({"model": "m", "input": "hi"});
        let with = |k: &str, val: Value| {
            let mut v = base.clone();
            v[k] = val;
            input(&v).unwrap_err().message
        };
        assert!(with("previous_response_id", json!("resp_1")).contains("not stored"));
        assert!(with("tools", json!([{"type": "web_search"}])).contains("only function tools"));
        assert!(with(
            "input",
            json!([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}])
        )
        .contains("invalid image input"));
        assert!(with(
            "input",
            json!([{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}])
        )
        .contains("not supported"));
        assert!(with("input", json!([{"type": "item_reference", "id": "x"}])).contains("stored"));
        assert!(with("text", json!({"format": {"type": "grammar"}})).contains("text.format"));
    }

    #[test]
    fn a_stream_numbers_its_events_and_closes_each_item() {
        let mut st = Stream {
            head: json!({"id": "resp_1"}),
            sequence: 2,
            index: 0,
            done: Vec::new(),
            reasoning: None,
            message: None,
            calls: 0,
        };
        let text = |b: Vec<bytes::Bytes>| {
            b.iter()
                .map(|c| String::from_utf8_lossy(c).into_owned())
                .collect::<String>()
        };
        let t = text(st.piece(&Parsed {
            thinking: "hm".into(),
            content: "Hi".into(),
            ..Default::default()
        }));
        for kind in [
            "response.output_item.added",
            "response.reasoning_summary_text.delta",
            "response.reasoning_summary_text.done",
            "response.output_text.delta",
        ] {
            assert!(t.contains(&format!("event: {kind}\n")), "{kind}: {t}");
        }
        assert!(t.contains("\"sequence_number\":2"), "{t}");
        let s = Summary {
            done_reason: "length",
            ..Default::default()
        };
        let t = text(st.end(&s));
        assert!(t.contains("event: response.output_text.done"), "{t}");
        assert!(t.contains("event: response.incomplete"), "{t}");
        assert!(t.contains("\"reason\":\"max_output_tokens\""), "{t}");
        assert_eq!(st.index, 2);
    }
}
