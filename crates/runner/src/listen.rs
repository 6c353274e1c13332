//! Serving HTTP with every resource bounded. A client that connects and sends nothing, sends
//! headers one byte at a time, announces a body it never sends, or holds thousands of sockets
//! open must not hold the runner's descriptors or memory: headers must arrive within a deadline
//! (idle keep-alive connections included, since hyper times the wait for the next request's
//! headers the same way), bodies within another (see [`read_body`]), and connections past a cap
//! get an immediate 503 instead of a socket that hangs.

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, Request, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Router;
use http_body_util::BodyExt;
use hyper_util::rt::{TokioIo, TokioTimer};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

/// The bounds of the HTTP side.
#[derive(Debug, Clone, Copy)]
pub struct HttpLimits {
    /// A request's headers (and, on a kept-alive connection, the wait for the next request)
    /// must arrive within this.
    pub header_timeout: Duration,
    /// A request's whole body must arrive within this.
    pub body_timeout: Duration,
    /// Connections served at once; more get a 503 and are closed.
    pub max_connections: usize,
    /// Largest request body.
    pub max_body: usize,
}

impl Default for HttpLimits {
    fn default() -> Self {
        HttpLimits {
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(60),
            max_connections: 512,
            max_body: crate::server::MAX_BODY,
        }
    }
}

/// Reads a request body whole, within the body deadline and size limit: 413 past the limit,
/// 408 past the deadline (a partial body is never waited on forever).
pub async fn read_body(body: Body, limits: &HttpLimits) -> Result<Bytes, (StatusCode, String)> {
    let limited = http_body_util::Limited::new(body, limits.max_body);
    match tokio::time::timeout(limits.body_timeout, limited.collect()).await {
        Err(_) => Err((
            StatusCode::REQUEST_TIMEOUT,
            format!(
                "the request body did not arrive within {} s",
                limits.body_timeout.as_secs_f64()
            ),
        )),
        Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => Err(too_large(limits)),
        Ok(Err(e)) => Err((
            StatusCode::BAD_REQUEST,
            format!("reading the request body: {e}"),
        )),
        Ok(Ok(c)) => Ok(c.to_bytes()),
    }
}

fn too_large(limits: &HttpLimits) -> (StatusCode, String) {
    (
        StatusCode::PAYLOAD_TOO_LARGE,
        format!("request body is larger than {} bytes", limits.max_body),
    )
}

/// Refuses a body announced larger than the limit before reading any of it.
pub async fn refuse_oversized(
    State(limits): State<HttpLimits>,
    req: Request<Body>,
    next: Next,
) -> Response {
    let announced = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if announced.is_some_and(|n| n > limits.max_body as u64) {
        let (code, msg) = too_large(&limits);
        let mut r = (code, format!("{msg}\n")).into_response();
        // The rest of that body is not going to be read: the connection cannot be reused.
        r.headers_mut().insert(
            header::CONNECTION,
            header::HeaderValue::from_static("close"),
        );
        return r;
    }
    next.run(req).await
}

/// Serves `app` on `listener` until `shutdown` resolves; then stops accepting and lets open
/// connections finish (the caller bounds how long).
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: HttpLimits,
    shutdown: impl Future<Output = ()>,
) {
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .keep_alive(true);
    tokio::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            _ = &mut shutdown => break,
            r = listener.accept() => match r {
                Ok((s, _)) => s,
                Err(e) => {
                    // Out of descriptors, most likely: wait for some to be given back rather
                    // than spin.
                    tracing::warn!("accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        // Streams are many small writes, each wanted at once (Nagle would hold one back while
        // the previous is unacknowledged).
        let _ = stream.set_nodelay(true);
        let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
            tokio::spawn(refuse(stream));
            continue;
        };
        let svc = hyper_util::service::TowerToHyperService::new(app.clone());
        let conn = http.serve_connection(TokioIo::new(stream), svc);
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            let _ = conn.await;
            drop(slot);
        });
    }
    graceful.shutdown().await;
}

/// A connection past the cap: a short, complete answer, then the socket is closed.
async fn refuse(mut stream: TcpStream) {
    const BODY: &str = "the runner is serving as many connections as it allows; retry later\n";
    let answer = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: {}\r\nretry-after: 1\r\nconnection: close\r\n\r\n{BODY}",
        BODY.len()
    );
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        let _ = stream.write_all(answer.as_bytes()).await;
        let _ = stream.shutdown().await;
    })
    .await;
}
