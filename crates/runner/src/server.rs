//! The HTTP side (docs/PROTOCOL.md): small handlers that validate, tokenize and hand over to the
//! engine, then turn its token events into NDJSON off the engine thread. One error type maps
//! every failure to a status and a `{"error": "..."}` body.

use crate::engine::{CompletionJob, Job, Shared};
use crate::generation::{Event, GenerationParams, PromptMedia};
use crate::text::{TextPiece, TextStream};
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use base::listen::{read_body, refuse_oversized, HttpLimits};
use base::protocol::{
    CompletionChunk, CompletionRequest, DoneReason, StreamError, StreamErrorBody,
};
use models::Tokenizer;
use serde_json::json;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Sender;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

pub use base::MAX_BODY;

#[derive(Clone)]
pub struct AppState {
    pub limits: HttpLimits,
    /// The tokenization budget ([`TOKENIZE_UNITS`]).
    pub tokenize_slots: Arc<tokio::sync::Semaphore>,
    pub jobs: Sender<Job>,
    pub shared: Arc<Shared>,
    pub prefill_chunk: usize,
}

/// Every failure a handler can answer with. On the routes of ollama's protocol the body is the
/// message as plain text, as its runner answers (Go's `http.Error`): the parent shows a non-200
/// body to the user verbatim, so JSON there would reach them as JSON. Routes that are ours
/// alone answer `{"error": "..."}`.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    message: String,
    json: bool,
}

impl ApiError {
    fn new(status: StatusCode, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            json: false,
        }
    }

    fn bad_request(message: impl Into<String>) -> ApiError {
        Self::new(StatusCode::BAD_REQUEST, message)
    }

    /// The same error with a JSON body (for our own routes).
    fn json(mut self) -> ApiError {
        self.json = true;
        self
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if self.json {
            return (self.status, Json(json!({ "error": self.message }))).into_response();
        }
        (
            self.status,
            [
                (header::CONTENT_TYPE, "text/plain; charset=utf-8"),
                (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            ],
            format!("{}\n", self.message),
        )
            .into_response()
    }
}

impl From<(StatusCode, String)> for ApiError {
    fn from((status, message): (StatusCode, String)) -> ApiError {
        ApiError::new(status, message)
    }
}

pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/v1/status", get(status))
        .route("/health", get(status))
        .route("/v1/completions", post(completions))
        .route("/completion", post(completions))
        .route("/v1/tokenize", post(tokenize))
        .route("/v1/detokenize", post(detokenize))
        .route("/v1/models", get(models_route).post(models_route))
        .route("/load", post(models_route))
        .route("/metrics", get(metrics))
        .fallback(|| async { ApiError::new(StatusCode::NOT_FOUND, "404 page not found") })
        .layer(axum::middleware::from_fn_with_state(
            state.limits,
            refuse_oversized,
        ))
        .with_state(state)
}

async fn status(State(app): State<AppState>) -> Response {
    let ready = app.shared.ready();
    let body = json!({
        "Status": if ready { 0 } else { 1 },
        "Progress": if ready { 100 } else { 0 },
        "ContextLength": app.shared.context_length.load(Ordering::Relaxed),
        "Memory": app.shared.memory.load(Ordering::Relaxed),
        // Ours: the memory plan made at start (docs/PROTOCOL.md, "Memory").
        "MemoryAvailable": app.shared.memory_available.load(Ordering::Relaxed),
        "CacheBudget": app.shared.cache_budget.load(Ordering::Relaxed),
        "CacheDiskBudget": app.shared.disk.get().map_or(0, |d| d.1),
        // Ours: a parent that chose the port can check it is talking to its own child.
        "Pid": std::process::id(),
    });
    let code = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (code, Json(body)).into_response()
}

/// The model is loaded when the process starts, so loading is a no-op that succeeds (as
/// ollama's runner answers `/v1/models` and `/load`).
async fn models_route() -> Response {
    Json(json!({ "Success": true })).into_response()
}

async fn metrics(State(app): State<AppState>) -> Response {
    let s = &app.shared;
    let text = s.metrics.render(
        s.memory.load(Ordering::Relaxed),
        s.cache_memory.load(Ordering::Relaxed),
        s.cache_budget.load(Ordering::Relaxed),
        s.disk.get(),
    );
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

fn tokenizer(app: &AppState) -> Result<Arc<Tokenizer>, ApiError> {
    app.shared.tokenizer.get().cloned().ok_or_else(|| {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "the model is still loading",
        )
    })
}

fn bad(app: &AppState, e: ApiError) -> ApiError {
    if e.status.is_client_error() {
        app.shared
            .metrics
            .bad_requests
            .fetch_add(1, Ordering::Relaxed);
    }
    e
}

async fn tokenize(State(app): State<AppState>, body: Body) -> Result<Response, ApiError> {
    let run = async {
        let body = read_body(body, &app.limits).await?;
        let text = std::str::from_utf8(&body)
            .map_err(|_| ApiError::bad_request("body is not UTF-8 text"))?;
        let tok = tokenizer(&app)?;
        let large = text.len() > LARGE_TEXT;
        let ids = encode(&app, tok, text.to_string()).await?;
        let resp = Json(ids).into_response();
        // The ids' JSON is as large as the tokenization was: handed back once it is sent.
        Ok(if large {
            base::signals::release_after(resp)
        } else {
            resp
        })
    };
    run.await.map_err(|e| bad(&app, e))
}

async fn detokenize(State(app): State<AppState>, body: Body) -> Result<Response, ApiError> {
    let run = async {
        let body = read_body(body, &app.limits).await?;
        let ids: Vec<u32> = serde_json::from_slice(&body).map_err(|e| {
            ApiError::bad_request(format!("body must be a JSON array of token ids: {e}"))
        })?;
        let tok = tokenizer(&app)?;
        let vocab = tok.vocab_size();
        if let Some(bad) = ids.iter().find(|&&i| i as usize >= vocab) {
            return Err(ApiError::bad_request(format!(
                "token id {bad} is outside the vocabulary of {vocab}"
            )));
        }
        let text = tok
            .decode(&ids)
            .map_err(|e| ApiError::bad_request(e.to_string()))?;
        Ok(Json(json!({ "Content": text })).into_response())
    };
    run.await.map_err(|e| bad(&app, e).json())
}

/// Tokenizations at once, in units: a small text takes one, a large one all of them, so that
/// large texts (gigabytes of tokenizer state for tens of megabytes of text) run one at a time.
pub const TOKENIZE_UNITS: u32 = 4;
/// Texts past this size are large.
const LARGE_TEXT: usize = 1 << 20;

/// Tokenizes off the async threads, within the tokenization budget; a large text's memory is
/// handed back to the system afterwards instead of staying in the allocator's free lists.
async fn encode(app: &AppState, tok: Arc<Tokenizer>, text: String) -> Result<Vec<u32>, ApiError> {
    let large = text.len() > LARGE_TEXT;
    let units = if large { TOKENIZE_UNITS } else { 1 };
    let _permit = app
        .tokenize_slots
        .acquire_many(units)
        .await
        .map_err(|_| ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "shutting down"))?;
    tokio::task::spawn_blocking(move || {
        let ids = tok.encode(&text);
        drop(text);
        if large {
            base::signals::release_free_memory();
        }
        ids
    })
    .await
    .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?
    .map_err(|e| ApiError::bad_request(e.to_string()))
}

/// Sets the engine's cancel flag when the response stream is dropped (the client went away).
struct CancelOnDrop(Arc<AtomicBool>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

async fn completions(State(app): State<AppState>, body: Body) -> Result<Response, ApiError> {
    let received = Instant::now();
    let prepared = prepare(&app, body).await.map_err(|e| bad(&app, e))?;
    let Prepared {
        req,
        prompt,
        media,
        num_ctx,
        tok,
    } = prepared;
    let constraint = constrain(&app, &req, &tok)
        .await
        .map_err(|e| bad(&app, e))?;
    let params = GenerationParams {
        prompt,
        options: req.sampler_options(),
        num_predict: req.num_predict(),
        num_ctx,
        prefill_chunk: app.prefill_chunk,
        eos: tok.eos_ids().to_vec(),
        checkpoints: Vec::new(),
        snapshot_every: None,
        constraint,
        media,
    };
    let (tx, mut rx) = unbounded_channel();
    let cancel = Arc::new(AtomicBool::new(false));
    let job = CompletionJob {
        params,
        events: tx,
        cancel: Arc::clone(&cancel),
        received,
    };
    app.jobs
        .send(Job::Complete(Box::new(job)))
        .map_err(|_| ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "the engine has stopped"))?;
    app.shared.metrics.requests.fetch_add(1, Ordering::Relaxed);

    // A request the engine refuses before producing anything still gets a plain 400.
    let first = rx.recv().await;
    if let Some(Event::Rejected(m)) = &first {
        return Err(ApiError::bad_request(m.clone()));
    }
    let stream = NdjsonStream {
        rx,
        first,
        text: TextStream::new(&req.options.stop),
        logprobs: req.logprobs,
        tok,
        guard: CancelOnDrop(cancel),
        stopped: false,
        ended: false,
        queued: None,
    };
    let body = Body::from_stream(futures::stream::unfold(stream, |mut s| async move {
        s.next_line()
            .await
            .map(|line| (Ok::<_, std::convert::Infallible>(line), s))
    }));
    Ok(Response::builder()
        .header(header::CONTENT_TYPE, STREAM_CONTENT_TYPE)
        .body(body)
        .unwrap_or_else(|_| {
            ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "response").into_response()
        }))
}

/// The completion stream's content type, as ollama's runner sends it.
pub const STREAM_CONTENT_TYPE: &str = "application/jsonl";

/// Parses, validates and tokenizes a completion request.
/// The request's structured-output constraint, compiled before anything is queued: an invalid
/// schema or grammar is a 400 naming the problem. The vocabulary's token trie is built on the
/// first such request (a moment for a large vocabulary) and kept.
async fn constrain(
    app: &AppState,
    req: &CompletionRequest,
    tok: &Arc<Tokenizer>,
) -> Result<Option<Box<grammar::Constraint>>, ApiError> {
    let format = grammar::Format::from_request(&req.format)
        .map_err(|e| ApiError::bad_request(e.to_string()))?;
    let Some(format) = format else {
        return Ok(None);
    };
    let shared = Arc::clone(&app.shared);
    let tok = Arc::clone(tok);
    let compiled = tokio::task::spawn_blocking(move || {
        let vocab = shared
            .grammar
            .get_or_init(|| {
                let json = std::fs::read(tok.path())
                    .map_err(|e| e.to_string())
                    .and_then(|b| serde_json::from_slice(&b).map_err(|e| e.to_string()))?;
                let size = shared.vocab_size.load(Ordering::Relaxed);
                grammar::Vocabulary::new(&json, size, tok.eos_ids())
                    .map(Arc::new)
                    .map_err(|e| e.to_string())
            })
            .clone()
            .map_err(|e| format!("structured output is unavailable for this model: {e}"))?;
        vocab.constrain(&format).map_err(|e| e.to_string())
    })
    .await
    .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
    compiled
        .map(|c| Some(Box::new(c)))
        .map_err(ApiError::bad_request)
}

/// A completion request, checked and tokenized.
struct Prepared {
    req: CompletionRequest,
    prompt: Vec<u32>,
    media: Vec<PromptMedia>,
    num_ctx: usize,
    tok: Arc<Tokenizer>,
}

/// The prompt of a request with media: its images and clips prepared (decoded, cut into
/// patches or log-mel frames) and its tags expanded, off the async threads and within the
/// tokenization budget.
async fn prepare_media(
    app: &AppState,
    req: &CompletionRequest,
    tok: &Arc<Tokenizer>,
) -> Result<(Vec<u32>, Vec<PromptMedia>), ApiError> {
    let Some(media) = app.shared.media.get().filter(|m| m.any()).cloned() else {
        return Err(ApiError::bad_request(format!(
            "this model does not support images or audio, but the request carries {} media item(s)",
            req.media.len()
        )));
    };
    let items = req.media_items().map_err(ApiError::bad_request)?;
    let _permit = app
        .tokenize_slots
        .acquire_many(TOKENIZE_UNITS)
        .await
        .map_err(|_| ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "shutting down"))?;
    let (tok, prompt) = (Arc::clone(tok), req.prompt.clone());
    tokio::task::spawn_blocking(move || crate::media::prepare(&tok, &media, &prompt, &items))
        .await
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?
        .map_err(ApiError::bad_request)
}

async fn prepare(app: &AppState, body: Body) -> Result<Prepared, ApiError> {
    let body = read_body(body, &app.limits).await?;
    let req = CompletionRequest::parse(&body).map_err(ApiError::bad_request)?;
    req.validate().map_err(ApiError::bad_request)?;
    let tok = tokenizer(app)?;
    let num_ctx = req.num_ctx(app.shared.context_length.load(Ordering::Relaxed));
    // A text that cannot fit is refused before it costs anything to tokenize.
    if req.prompt.len() > tok.max_text_bytes(num_ctx) {
        return Err(ApiError::bad_request(format!(
            "prompt is too long: {} bytes of text cannot fit the context of {num_ctx} tokens",
            req.prompt.len()
        )));
    }
    let (prompt, media) = if req.media.is_empty() {
        (
            encode(app, Arc::clone(&tok), req.prompt.clone()).await?,
            Vec::new(),
        )
    } else {
        prepare_media(app, &req, &tok).await?
    };
    if prompt.is_empty() {
        return Err(ApiError::bad_request("prompt tokenizes to nothing"));
    }
    if prompt.len() >= num_ctx {
        return Err(ApiError::bad_request(format!(
            "prompt is too long: {} tokens do not fit the context of {num_ctx} tokens",
            prompt.len()
        )));
    }
    Ok(Prepared {
        req,
        prompt,
        media,
        num_ctx,
        tok,
    })
}

struct NdjsonStream {
    rx: UnboundedReceiver<Event>,
    first: Option<Event>,
    text: TextStream,
    /// The request asked for logprobs (`Logprobs: true`).
    logprobs: bool,
    tok: Arc<Tokenizer>,
    guard: CancelOnDrop,
    /// A stop string ended the text; waiting for the engine to confirm.
    stopped: bool,
    ended: bool,
    /// A line to send before reading the next event (the final chunk, after the text that
    /// was still held back).
    queued: Option<Bytes>,
}

fn line<T: serde::Serialize>(v: &T) -> Bytes {
    let mut s = serde_json::to_vec(v).unwrap_or_else(|_| b"{}".to_vec());
    s.push(b'\n');
    Bytes::from(s)
}

fn error_line(message: String) -> Bytes {
    line(&StreamError {
        error: StreamErrorBody {
            status_code: 500,
            error: message,
        },
    })
}

impl NdjsonStream {
    /// A content chunk for `piece`, or nothing when it carries no text (logprob entries only
    /// ever travel with text).
    fn content_line(&self, piece: TextPiece) -> Option<Bytes> {
        if piece.text.is_empty() {
            return None;
        }
        let logprobs = (self.logprobs && !piece.logprobs.is_empty()).then_some(piece.logprobs);
        Some(line(&CompletionChunk::content(piece.text, logprobs)))
    }

    async fn next_line(&mut self) -> Option<Bytes> {
        loop {
            if let Some(l) = self.queued.take() {
                return Some(l);
            }
            if self.ended {
                return None;
            }
            let ev = match self.first.take() {
                Some(e) => Some(e),
                None => self.rx.recv().await,
            };
            let Some(ev) = ev else {
                self.ended = true;
                return Some(error_line(
                    "the engine stopped before the completion ended".into(),
                ));
            };
            match ev {
                Event::Token { .. } if self.stopped => continue,
                Event::Token { id, logprob } => {
                    let logprob = logprob.filter(|_| self.logprobs);
                    let piece = match self.text.push(&self.tok, id, logprob.as_ref()) {
                        Ok(p) => p,
                        Err(e) => {
                            self.ended = true;
                            self.guard.0.store(true, Ordering::Relaxed);
                            return Some(error_line(e.to_string()));
                        }
                    };
                    if piece.stopped {
                        // End the sequence on the engine; its Done carries the statistics.
                        self.stopped = true;
                        self.guard.0.store(true, Ordering::Relaxed);
                    }
                    if let Some(l) = self.content_line(piece) {
                        return Some(l);
                    }
                }
                Event::Done { reason, stats } => {
                    self.ended = true;
                    let reason = if self.stopped {
                        DoneReason::Stop
                    } else {
                        reason
                    };
                    let done = line(&CompletionChunk::done(reason, String::new(), &stats));
                    let tail = if self.stopped {
                        None
                    } else {
                        match self.text.finish(&self.tok) {
                            Ok(piece) => self.content_line(piece),
                            Err(e) => return Some(error_line(e.to_string())),
                        }
                    };
                    return match tail {
                        Some(t) => {
                            self.queued = Some(done);
                            Some(t)
                        }
                        None => Some(done),
                    };
                }
                Event::Rejected(m) | Event::Error(m) => {
                    self.ended = true;
                    return Some(error_line(m));
                }
            }
        }
    }
}
