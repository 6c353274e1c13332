//! Request bodies: read within the body deadline and size limit (a slow or endless sender gets
//! a 408 or 413, never a held connection), then parsed as a JSON object; a refusal says why.

use crate::pipeline::ApiError;
use axum::extract::{FromRequest, Request};
use serde_json::Value;

/// The largest request body (a long conversation with tool results fits; a blob upload has its
/// own route).
pub const MAX_BODY: usize = 32 << 20;

/// A JSON object body, or why there is none.
pub struct JsonBody(Result<Value, ApiError>);

impl<S: Send + Sync> FromRequest<S> for JsonBody {
    type Rejection = std::convert::Infallible;

    async fn from_request(req: Request, _: &S) -> Result<Self, Self::Rejection> {
        let limits = crate::http_limits();
        let bytes = match runner::listen::read_body(req.into_body(), &limits).await {
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
