//! Request bodies: read within the body deadline and size limit (a slow or endless sender gets
//! a 408 or 413, never a held connection), then parsed as a JSON object; a refusal says why.

use crate::pipeline::ApiError;
use axum::extract::{FromRequest, Request};
use axum::middleware::Next;
use axum::response::Response;
use serde_json::Value;

/// A request body past this is large: the memory its parsing and rendering took is handed back
/// to the system once its answer is sent, rather than held by the allocator while serve idles.
const LARGE_REQUEST: u64 = 1 << 20;

/// Hands free memory back after a large request's answer has been sent (or dropped).
pub async fn release_after_large(req: Request, next: Next) -> Response {
    let large = req
        .headers()
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .is_some_and(|n| n > LARGE_REQUEST);
    let resp = next.run(req).await;
    if large {
        base::signals::release_after(resp)
    } else {
        resp
    }
}

/// The largest request body (a long conversation with tool results fits; a blob upload has its
/// own route).
pub const MAX_BODY: usize = 32 << 20;

/// A JSON object body, or why there is none.
pub struct JsonBody(Result<Value, ApiError>);

impl<S: Send + Sync> FromRequest<S> for JsonBody {
    type Rejection = std::convert::Infallible;

    async fn from_request(req: Request, _: &S) -> Result<Self, Self::Rejection> {
        let limits = crate::http_limits();
        let bytes = match base::listen::read_body(req.into_body(), &limits).await {
            Ok(b) => b,
            Err((code, msg)) => return Ok(JsonBody(Err(ApiError::new(code.as_u16(), msg)))),
        };
        Ok(JsonBody(parse(&bytes)))
    }
}

fn parse(bytes: &[u8]) -> Result<Value, ApiError> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Err(ApiError::bad("missing request body"));
    }
    let v: Value = serde_json::from_slice(bytes)
        .map_err(|e| ApiError::bad(format!("invalid JSON in the request body: {e}")))?;
    if !v.is_object() {
        return Err(ApiError::bad("the request body must be a JSON object"));
    }
    Ok(v)
}

pub fn json_body(body: JsonBody) -> Result<Value, ApiError> {
    body.0
}
