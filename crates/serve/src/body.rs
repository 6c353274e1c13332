//! Request bodies: bounded in size (axum's limit layer) and read as JSON objects, with the
//! reason for a refusal in the answer.

use crate::pipeline::ApiError;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use serde_json::Value;

pub type JsonBody = Result<Bytes, BytesRejection>;

/// The largest request body (a long conversation with tool results fits; a blob upload has its
/// own route).
pub const MAX_BODY: usize = 32 << 20;

pub fn json_body(body: JsonBody) -> Result<Value, ApiError> {
    let bytes = body.map_err(|e| ApiError::new(e.status().as_u16(), e.body_text()))?;
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Err(ApiError::bad("missing request body"));
    }
    let v: Value = serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::bad(format!("invalid JSON in the request body: {e}")))?;
    if !v.is_object() {
        return Err(ApiError::bad("the request body must be a JSON object"));
    }
    Ok(v)
}
