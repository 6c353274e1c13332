//! Talking to a runner over its protocol (docs/PROTOCOL.md), as ollama's Go parent does: the
//! request is `json.Marshal` of its `CompletionRequest` (zero options absent), the answer a stream
//! of JSON lines read until `Done`. This side owns its own copy of the wire types: it is the
//! parent, and reads the runner only through the contract.

use bytes::{Buf, Bytes, BytesMut};
use futures::{Stream, StreamExt};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde::{Deserialize, Serialize};
use std::time::Duration;

pub type HttpClient = Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>;

pub fn http_client() -> HttpClient {
    let mut connector = hyper_util::client::legacy::connect::HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(Duration::from_secs(5)));
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(30))
        .build(connector)
}

/// `POST /v1/completions`, as the parent marshals it.
#[derive(Debug, Clone, Serialize)]
pub struct CompletionRequest {
    #[serde(rename = "Prompt")]
    pub prompt: String,
    /// The images the prompt's `[img-N]` tags name (`llm.MediaData`: base64 `data`, `id`).
    #[serde(rename = "Media", skip_serializing_if = "Vec::is_empty")]
    pub media: Vec<serde_json::Value>,
    #[serde(rename = "Options")]
    pub options: serde_json::Map<String, serde_json::Value>,
    #[serde(rename = "Logprobs", skip_serializing_if = "std::ops::Not::not")]
    pub logprobs: bool,
    #[serde(rename = "TopLogprobs", skip_serializing_if = "is_zero")]
    pub top_logprobs: i32,
    #[serde(rename = "Format", skip_serializing_if = "serde_json::Value::is_null")]
    pub format: serde_json::Value,
}

fn is_zero(n: &i32) -> bool {
    *n == 0
}

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
pub struct TopLogprob {
    pub token: String,
    pub logprob: f64,
}

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
pub struct TokenLogprob {
    pub token: String,
    pub logprob: f64,
    #[serde(default)]
    pub top_logprobs: Vec<TopLogprob>,
}

/// One line of the runner's stream.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct Chunk {
    #[serde(rename = "Content")]
    pub content: String,
    #[serde(rename = "Done")]
    pub done: bool,
    #[serde(rename = "DoneReason")]
    pub done_reason: u8,
    #[serde(rename = "Logprobs")]
    pub logprobs: Option<Vec<TokenLogprob>>,
    #[serde(rename = "PromptEvalCount")]
    pub prompt_eval_count: u64,
    #[serde(rename = "PromptEvalDuration")]
    pub prompt_eval_duration: u64,
    #[serde(rename = "EvalCount")]
    pub eval_count: u64,
    #[serde(rename = "EvalDuration")]
    pub eval_duration: u64,
    #[serde(rename = "Error")]
    pub error: Option<StreamError>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct StreamError {
    #[serde(rename = "StatusCode")]
    pub status_code: u16,
    pub error: String,
}

/// What a runner said went wrong, with the HTTP status it gave (400 for a request it refused).
#[derive(Debug, Clone, thiserror::Error)]
#[error("{message}")]
pub struct RunnerError {
    pub status: u16,
    pub message: String,
    /// The request never reached the runner (its process is gone, or going).
    pub unreachable: bool,
    /// The connection to the runner was lost mid-answer (the runner did not say this).
    pub lost: bool,
}

impl RunnerError {
    fn new(status: u16, message: impl Into<String>) -> RunnerError {
        RunnerError {
            status,
            message: message.into(),
            unreachable: false,
            lost: false,
        }
    }

    fn lost(message: impl Into<String>) -> RunnerError {
        RunnerError {
            lost: true,
            ..RunnerError::new(500, message)
        }
    }
}

/// `GET /v1/status`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct Status {
    #[serde(rename = "Status")]
    pub status: Option<i32>,
    #[serde(rename = "ContextLength")]
    pub context_length: u64,
    #[serde(rename = "Memory")]
    pub memory: u64,
    /// Ours: what the runner's prefix cache may grow to hold.
    #[serde(rename = "CacheBudget")]
    pub cache_budget: u64,
    /// Ours: the runner's process id.
    #[serde(rename = "Pid")]
    pub pid: Option<u32>,
}

pub async fn status(client: &HttpClient, port: u16) -> Result<(u16, Status), String> {
    status_within(client, port, Duration::from_secs(5)).await
}

/// `GET /v1/status`, answered within `within` or an error.
pub async fn status_within(
    client: &HttpClient,
    port: u16,
    within: Duration,
) -> Result<(u16, Status), String> {
    tokio::time::timeout(within, status_answer(client, port))
        .await
        .map_err(|_| format!("no status answer within {} s", within.as_secs_f64()))?
}

async fn status_answer(client: &HttpClient, port: u16) -> Result<(u16, Status), String> {
    let uri = format!("http://127.0.0.1:{port}/v1/status");
    let req = hyper::Request::get(uri)
        .body(Full::new(Bytes::new()))
        .map_err(|e| e.to_string())?;
    let resp = client.request(req).await.map_err(|e| e.to_string())?;
    let code = resp.status().as_u16();
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    let s = serde_json::from_slice(&body).unwrap_or_default();
    Ok((code, s))
}

/// `POST` of `body` to the runner's `path`: its answer when 200, else the runner's refusal (or
/// an unreachable runner) as an error.
async fn post(
    client: &HttpClient,
    port: u16,
    path: &str,
    body: Vec<u8>,
) -> Result<hyper::Response<hyper::body::Incoming>, RunnerError> {
    let http = hyper::Request::post(format!("http://127.0.0.1:{port}{path}"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .map_err(|e| RunnerError::new(500, e.to_string()))?;
    let resp = client.request(http).await.map_err(|e| RunnerError {
        unreachable: true,
        ..RunnerError::new(500, format!("the runner did not answer: {e}"))
    })?;
    let code = resp.status().as_u16();
    if code == 200 {
        return Ok(resp);
    }
    let body = resp
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    Err(RunnerError::new(
        code,
        String::from_utf8_lossy(&body).trim().to_string(),
    ))
}

/// `POST /v1/tokenize`: the ids of `text` by the runner's tokenizer.
pub async fn tokenize(client: &HttpClient, port: u16, text: &str) -> Result<Vec<u32>, RunnerError> {
    let resp = post(client, port, "/v1/tokenize", text.as_bytes().to_vec()).await?;
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| RunnerError::lost(format!("the runner stopped mid-answer: {e}")))?
        .to_bytes();
    serde_json::from_slice(&body)
        .map_err(|e| RunnerError::new(500, format!("unreadable token ids from the runner: {e}")))
}

/// Starts a completion; the stream yields the runner's chunks up to and including the one with
/// `Done`, or an error (a refused request, an in-stream error, or a runner that went away).
pub async fn complete(
    client: &HttpClient,
    port: u16,
    req: &CompletionRequest,
) -> Result<impl Stream<Item = Result<Chunk, RunnerError>> + Send + 'static, RunnerError> {
    let body = serde_json::to_vec(req).map_err(|e| RunnerError::new(500, e.to_string()))?;
    if body.len() > base::MAX_BODY {
        return Err(RunnerError::new(
            400,
            format!(
                "the request is too large for a runner: {} bytes as JSON, over its limit of {} bytes",
                body.len(),
                base::MAX_BODY
            ),
        ));
    }
    let resp = post(client, port, "/v1/completions", body).await?;
    Ok(lines(resp.into_body().into_data_stream()))
}

/// Splits the body into JSON lines and reads each; ends after `Done` or the first error. A body
/// that ends before `Done` is an error: the runner died mid-answer.
fn lines<S, E>(frames: S) -> impl Stream<Item = Result<Chunk, RunnerError>> + Send + 'static
where
    S: Stream<Item = Result<Bytes, E>> + Send + Unpin + 'static,
    E: std::fmt::Display,
{
    struct St<S> {
        frames: S,
        buf: BytesMut,
        finished: bool,
    }
    futures::stream::unfold(
        St {
            frames,
            buf: BytesMut::new(),
            finished: false,
        },
        |mut st| async move {
            if st.finished {
                return None;
            }
            loop {
                if let Some(nl) = st.buf.iter().position(|&b| b == b'\n') {
                    let line = st.buf.split_to(nl + 1);
                    let line = &line[..nl];
                    if line.iter().all(u8::is_ascii_whitespace) {
                        continue;
                    }
                    let item = match serde_json::from_slice::<Chunk>(line) {
                        Ok(c) => match c.error {
                            Some(e) => Err(RunnerError::new(
                                if e.status_code == 0 {
                                    500
                                } else {
                                    e.status_code
                                },
                                e.error,
                            )),
                            None => Ok(c),
                        },
                        Err(e) => Err(RunnerError::new(
                            500,
                            format!("unreadable line from the runner: {e}"),
                        )),
                    };
                    st.finished = !matches!(&item, Ok(c) if !c.done);
                    return Some((item, st));
                }
                match st.frames.next().await {
                    Some(Ok(b)) => st.buf.extend_from_slice(b.chunk()),
                    Some(Err(e)) => {
                        st.finished = true;
                        return Some((
                            Err(RunnerError::lost(format!(
                                "the runner stopped mid-answer: {e}"
                            ))),
                            st,
                        ));
                    }
                    None => {
                        st.finished = true;
                        return Some((
                            Err(RunnerError::lost(
                                "the runner stopped before the completion ended",
                            )),
                            st,
                        ));
                    }
                }
            }
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunks(parts: &[&str]) -> Vec<Result<Chunk, RunnerError>> {
        let frames: Vec<Result<Bytes, std::io::Error>> = parts
            .iter()
            .map(|p| Ok(Bytes::from(p.to_string())))
            .collect();
        futures::executor::block_on(lines(futures::stream::iter(frames)).collect())
    }

    #[test]
    fn lines_split_across_frames_are_joined() {
        let out = chunks(&[
            "{\"Content\":\"he",
            "llo\"}\n{\"Content\":\" w\"}\n",
            "{\"Content\":\"\",\"Done\":true,\"DoneReason\":1,\"EvalCount\":3}\n",
        ]);
        let texts: Vec<_> = out
            .iter()
            .map(|c| c.as_ref().unwrap().content.clone())
            .collect();
        assert_eq!(texts, ["hello", " w", ""]);
        let last = out.last().unwrap().as_ref().unwrap();
        assert!(last.done);
        assert_eq!((last.done_reason, last.eval_count), (1, 3));
    }

    #[test]
    fn a_stream_cut_short_is_an_error() {
        let out = chunks(&["{\"Content\":\"a\"}\n{\"Content\":\"b"]);
        assert_eq!(out.len(), 2);
        assert!(out[1]
            .as_ref()
            .unwrap_err()
            .message
            .contains("before the completion ended"));
    }

    #[test]
    fn an_in_stream_error_ends_the_stream() {
        let out = chunks(&[
            "{\"Content\":\"a\"}\n{\"Error\":{\"StatusCode\":500,\"error\":\"boom\"}}\n{\"Content\":\"x\"}\n",
        ]);
        assert_eq!(out.len(), 2);
        assert_eq!(out[1].as_ref().unwrap_err().message, "boom");
    }
}
