//! What `serve` does not do, said in each API's own error shape rather than with an empty 404:
//! embeddings (the models served here generate text; none embeds), the registry (`pull`,
//! `push`), and any path or method it does not know.

use crate::body::{json_body, JsonBody};
use crate::pipeline::{self, ApiError};
use crate::{anthropic_api, ollama_api, openai_api, App};
use axum::extract::State;
use axum::http::{Method, Uri};
use axum::response::Response;
use std::sync::Arc;

/// Why a model cannot embed: it is found (an unknown one is a 404 as anywhere), then refused.
fn embedding_refusal(app: &App, body: JsonBody) -> ApiError {
    let v = match json_body(body) {
        Ok(v) => v,
        Err(e) => return e,
    };
    let Some(name) = v["model"].as_str() else {
        return ApiError::bad("model is required");
    };
    match pipeline::find(app, name) {
        Err(e) => e,
        Ok(m) => ApiError::bad(format!(
            "{:?} does not support embeddings: it is a text generation model ({}), and mlx-runner serves no embedding models",
            name,
            if m.family.is_empty() { "unknown family" } else { m.family.as_str() }
        )),
    }
}

/// `POST /api/embed`, `POST /api/embeddings`.
pub async fn embed(State(app): State<Arc<App>>, body: JsonBody) -> Response {
    ollama_api::error(&embedding_refusal(&app, body))
}

/// `POST /v1/embeddings`.
pub async fn openai_embeddings(State(app): State<Arc<App>>, body: JsonBody) -> Response {
    openai_api::error(&embedding_refusal(&app, body))
}

/// `POST /api/pull`, `POST /api/push`.
pub async fn registry(uri: Uri) -> Response {
    let what = if uri.path().ends_with("push") {
        "pushing"
    } else {
        "pulling"
    };
    ollama_api::error(&ApiError::bad(format!(
        "{what} models is not supported: mlx-runner serve has no registry; make models with `mlx-runner create` (or POST /api/create), and models ollama has pulled are served as they are"
    )))
}

/// In the API the path belongs to: Anthropic's under `/v1/messages`, OpenAI's error object
/// under the rest of `/v1/`, ollama's elsewhere.
fn shaped(uri: &Uri, e: ApiError) -> Response {
    if uri.path().starts_with("/v1/messages") {
        anthropic_api::error(&e)
    } else if uri.path().starts_with("/v1/") {
        openai_api::error(&e)
    } else {
        ollama_api::error(&e)
    }
}

/// Any path no route serves.
pub async fn not_found(method: Method, uri: Uri) -> Response {
    let e = ApiError::new(
        404,
        format!(
            "{method} {} is not an endpoint of mlx-runner serve (docs/SERVE.md lists them)",
            uri.path()
        ),
    );
    shaped(&uri, e)
}

/// A known path with a method it does not take.
pub async fn method_not_allowed(method: Method, uri: Uri) -> Response {
    let e = ApiError::new(
        405,
        format!("{} does not take {method} requests", uri.path()),
    );
    shaped(&uri, e)
}
