//! Server-sent events as the Anthropic and Responses APIs stream them: named events, each a JSON
//! object, from a task that feeds a channel (the stream ends when the task drops its sender,
//! and the task sees a client that left as a closed channel).

use axum::body::Body;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use serde_json::Value;

/// One named event.
pub fn event(kind: &str, data: &Value) -> bytes::Bytes {
    bytes::Bytes::from(format!("event: {kind}\ndata: {data}\n\n"))
}

/// The response streaming what arrives on `rx`.
pub fn response(rx: tokio::sync::mpsc::Receiver<bytes::Bytes>) -> Response {
    let body =
        tokio_stream::wrappers::ReceiverStream::new(rx).map(Ok::<_, std::convert::Infallible>);
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(body))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

/// An id as these APIs write them: a prefix and 24 hex digits (`msg_…`, `resp_…`).
pub fn id(prefix: &str) -> String {
    let bytes: [u8; 12] = rand::random();
    format!("{prefix}_{}", hex::encode(bytes))
}
