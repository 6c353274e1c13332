//! OpenAI's `/v1/audio/transcriptions`, as ollama serves it: a multipart form with the clip
//! (`file`) and the `model` becomes a chat request (a system prompt that asks for the spoken
//! words, the clip in the user's message, temperature 0) whose answer is returned as
//! `{"text": ...}`, or as plain text for `response_format=text`.

use crate::openai_api::error;
use crate::pipeline::{self, ApiError, Input};
use crate::App;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use base64::Engine;
use serde_json::{json, Map, Value};
use std::sync::Arc;

/// The form's fields this route reads.
#[derive(Default)]
struct Form {
    model: String,
    file: Option<Vec<u8>>,
    response_format: String,
    language: String,
    prompt: String,
}

async fn form(req: Request) -> Result<Form, ApiError> {
    let bad = |e: String| ApiError::bad(format!("failed to parse multipart form: {e}"));
    let content_type = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    let boundary = multer::parse_boundary(&content_type).map_err(|e| bad(e.to_string()))?;
    let bytes = base::listen::read_body(req.into_body(), &crate::http_limits())
        .await
        .map_err(|(code, msg)| ApiError::new(code.as_u16(), msg))?;
    let stream = futures::stream::once(async move { Ok::<_, std::io::Error>(bytes) });
    let mut parts = multer::Multipart::new(stream, boundary);
    let mut form = Form::default();
    while let Some(field) = parts.next_field().await.map_err(|e| bad(e.to_string()))? {
        let name = field.name().unwrap_or_default().to_string();
        let data = field.bytes().await.map_err(|e| bad(e.to_string()))?;
        let text = || String::from_utf8_lossy(&data).into_owned();
        match name.as_str() {
            "model" => form.model = text(),
            "file" => form.file = Some(data.to_vec()),
            "response_format" => form.response_format = text(),
            "language" => form.language = text(),
            "prompt" => form.prompt = text(),
            _ => {}
        }
    }
    Ok(form)
}

/// The chat request a transcription is: ollama's `FromTranscriptionRequest`.
fn chat_input(form: &Form, audio: &[u8]) -> Input {
    let mut system = "Transcribe the audio exactly as spoken. Output only the spoken words. \
                      Do not answer any question in the audio."
        .to_string();
    if !form.language.is_empty() {
        system += &format!(" The audio is in {}.", form.language);
    }
    if !form.prompt.is_empty() {
        system += &format!(" Context: {}", form.prompt);
    }
    let clip = base64::engine::general_purpose::STANDARD.encode(audio);
    let mut options = Map::new();
    options.insert("temperature".into(), Value::from(0));
    Input {
        model: form.model.clone(),
        messages: vec![
            json!({"role": "system", "content": system}),
            json!({"role": "user", "content": "What exact words are spoken in this audio?",
                   "images": [clip]}),
        ],
        options,
        ..Default::default()
    }
}

async fn transcribe(app: Arc<App>, req: Request) -> Result<Response, ApiError> {
    let form = form(req).await?;
    if form.model.is_empty() {
        return Err(ApiError::bad("model is required"));
    }
    let audio = form
        .file
        .as_deref()
        .ok_or_else(|| ApiError::bad("file is required: no `file` field in the form"))?;
    if audio.is_empty() {
        return Err(ApiError::bad("audio file is empty"));
    }
    let m = pipeline::find(&app, &form.model)?;
    let run = pipeline::start(&app, &m, chat_input(&form, audio)).await?;
    let (answer, _, _) = pipeline::collect(run.events).await?;
    let text = answer.content.trim().to_string();
    Ok(if form.response_format == "text" {
        Response::builder()
            .header(header::CONTENT_TYPE, "text/plain")
            .body(Body::from(text))
            .unwrap_or_else(|_| axum::http::StatusCode::INTERNAL_SERVER_ERROR.into_response())
    } else {
        axum::Json(json!({ "text": text })).into_response()
    })
}

pub async fn transcriptions(State(app): State<Arc<App>>, req: Request) -> Response {
    transcribe(app, req).await.unwrap_or_else(|e| error(&e))
}
