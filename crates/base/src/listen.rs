//! Serving HTTP with every resource bounded. A client that connects and sends nothing, sends
//! headers one byte at a time, announces a body it never sends, or holds thousands of sockets
//! open must not hold the runner's descriptors or memory: headers must arrive within a deadline
//! (idle keep-alive connections included, since hyper times the wait for the next request's
//! headers the same way), bodies within another (see [`read_body`]).
//!
//! Connections are capped, and at the cap a new one takes the place of one that is not being
//! served: a connection still sending its request (head or body), or an idle kept-alive one,
//! the ones that never completed a request first and then the longest idle. So a crowd of
//! half-sent requests cannot lock a complete one out; only when every connection is busy with a
//! request it sent whole does a new one get an immediate 503 instead of a socket that hangs.

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, Request, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Router;
use http_body_util::BodyExt;
use hyper_util::rt::{TokioIo, TokioTimer};
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, Semaphore};

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
            max_body: crate::MAX_BODY,
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
    let open = Arc::new(Connections::default());
    let graceful = Arc::new(hyper_util::server::graceful::GracefulShutdown::new());
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
        // A slot, or the promise of one: at the cap, a connection not being served is closed
        // for this one.
        let slot = match Arc::clone(&slots).try_acquire_owned() {
            Ok(slot) => Slot::Now(slot),
            Err(_) => match open.evict() {
                // The evicted connection hands its slot over as soon as its task sees it.
                Some(handoff) => Slot::Soon(handoff, Arc::clone(&slots)),
                None => {
                    tokio::spawn(refuse(stream));
                    continue;
                }
            },
        };
        let conn = open.add();
        let (app, tracked) = (app.clone(), Arc::clone(&conn));
        let svc =
            hyper::service::service_fn(move |req| handle(app.clone(), Arc::clone(&tracked), req));
        let served = http.serve_connection(TokioIo::new(stream), svc);
        let served = graceful.watch(served);
        let open = Arc::clone(&open);
        tokio::spawn(async move {
            let slot = match slot {
                Slot::Now(s) => s,
                Slot::Soon(handoff, slots) => match receive(handoff, &slots).await {
                    Some(s) => s,
                    None => {
                        open.remove(&conn);
                        return;
                    }
                },
            };
            conn.seated.store(true, Ordering::SeqCst);
            tokio::select! {
                _ = served => {}
                _ = conn.evicted.notified() => {}
            }
            open.remove(&conn);
            // Evicted: the slot goes straight to the connection it was closed for (released to
            // the pool, another accept could take it first and leave that one waiting).
            let taker = conn.handoff.lock().unwrap().take();
            if let Some(taker) = taker {
                let _ = taker.send(slot);
            }
        });
    }
    if let Ok(graceful) = Arc::try_unwrap(graceful) {
        graceful.shutdown().await;
    }
}

type Permit = tokio::sync::OwnedSemaphorePermit;

enum Slot {
    Now(Permit),
    /// The slot of a connection being evicted for this one, handed over by its task.
    Soon(tokio::sync::oneshot::Receiver<Permit>, Arc<Semaphore>),
}

/// The evicted connection's slot; should its task have ended on its own before it could hand
/// the slot over (its permit went back to the pool), one from the pool.
async fn receive(
    handoff: tokio::sync::oneshot::Receiver<Permit>,
    slots: &Arc<Semaphore>,
) -> Option<Permit> {
    // A loaded machine may take a moment to run the evicted connection's task.
    match tokio::time::timeout(Duration::from_secs(3), handoff).await {
        Ok(Ok(permit)) => Some(permit),
        Ok(Err(_)) => {
            tokio::time::timeout(Duration::from_secs(1), Arc::clone(slots).acquire_owned())
                .await
                .ok()
                .and_then(Result::ok)
        }
        Err(_) => None,
    }
}

/// One open connection, as eviction sees it.
struct Connection {
    id: u64,
    /// Requests received whole whose answers are not finished.
    serving: AtomicUsize,
    /// It has sent at least one request whole.
    completed: AtomicBool,
    /// When it last stopped being served (opened, or its last answer ended).
    idle_since: Mutex<Instant>,
    /// It holds a slot (a connection still waiting for the slot of one it evicted has none
    /// to give back).
    seated: AtomicBool,
    evicted: Notify,
    /// Where its slot goes when it is evicted.
    handoff: Mutex<Option<tokio::sync::oneshot::Sender<Permit>>>,
}

#[derive(Default)]
struct Connections {
    next: AtomicU64,
    all: Mutex<Vec<Arc<Connection>>>,
}

impl Connections {
    fn add(&self) -> Arc<Connection> {
        let c = Arc::new(Connection {
            id: self.next.fetch_add(1, Ordering::Relaxed),
            serving: AtomicUsize::new(0),
            completed: AtomicBool::new(false),
            idle_since: Mutex::new(Instant::now()),
            seated: AtomicBool::new(false),
            evicted: Notify::new(),
            handoff: Mutex::new(None),
        });
        self.all.lock().unwrap().push(Arc::clone(&c));
        c
    }

    fn remove(&self, c: &Connection) {
        self.all.lock().unwrap().retain(|o| o.id != c.id);
    }

    /// Closes the connection that is least a loss: not being served, never having completed a
    /// request before one that has, the longest idle first; its slot comes through the
    /// receiver. None when every one is busy.
    fn evict(&self) -> Option<tokio::sync::oneshot::Receiver<Permit>> {
        let mut all = self.all.lock().unwrap();
        let victim = all
            .iter()
            .enumerate()
            .filter(|(_, c)| {
                c.seated.load(Ordering::SeqCst) && c.serving.load(Ordering::SeqCst) == 0
            })
            .min_by_key(|(_, c)| {
                (
                    c.completed.load(Ordering::SeqCst),
                    *c.idle_since.lock().unwrap(),
                )
            })
            .map(|(i, _)| i);
        let c = all.swap_remove(victim?);
        let (tx, rx) = tokio::sync::oneshot::channel();
        *c.handoff.lock().unwrap() = Some(tx);
        c.evicted.notify_one();
        Some(rx)
    }
}

/// One request on a connection: counted as being served from the moment its body has arrived
/// whole until its answer is finished or dropped.
struct InFlight {
    conn: Arc<Connection>,
    counted: AtomicBool,
}

impl InFlight {
    fn received(&self) {
        if !self.counted.swap(true, Ordering::SeqCst) {
            self.conn.serving.fetch_add(1, Ordering::SeqCst);
            self.conn.completed.store(true, Ordering::SeqCst);
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if self.counted.load(Ordering::SeqCst) {
            self.conn.serving.fetch_sub(1, Ordering::SeqCst);
            *self.conn.idle_since.lock().unwrap() = Instant::now();
        }
    }
}

/// A request body that tells its [`InFlight`] when it has all arrived.
struct Received {
    inner: Body,
    req: Option<Arc<InFlight>>,
}

impl http_body::Body for Received {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, axum::Error>>> {
        let this = &mut *self;
        let polled = std::pin::Pin::new(&mut this.inner).poll_frame(cx);
        if matches!(polled, std::task::Poll::Ready(None)) || this.inner.is_end_stream() {
            if let Some(req) = this.req.take() {
                req.received();
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// One request of a connection, tracked as [`InFlight`] from the end of its body to the end of
/// its answer.
async fn handle(
    app: Router,
    conn: Arc<Connection>,
    req: Request<hyper::body::Incoming>,
) -> Result<Response, std::convert::Infallible> {
    use hyper::service::Service;
    let flight = Arc::new(InFlight {
        conn,
        counted: AtomicBool::new(false),
    });
    let (parts, body) = req.into_parts();
    let body = Body::new(body);
    if http_body::Body::is_end_stream(&body) {
        flight.received();
    }
    let body = Body::new(Received {
        inner: body,
        req: Some(Arc::clone(&flight)),
    });
    let svc = hyper_util::service::TowerToHyperService::new(app);
    let resp = svc.call(Request::from_parts(parts, body)).await?;
    // The answer holds the request's count until hyper has sent (or dropped) all of it.
    Ok(holding(resp, flight))
}

/// `resp` with its body holding `held` until the body has been sent or dropped.
pub fn holding<T: Send + Sync + 'static>(resp: Response, held: T) -> Response {
    resp.map(|b| {
        Body::new(b.map_frame(move |f| {
            let _held = &held;
            f
        }))
    })
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

#[cfg(test)]
mod tests {
    use super::*;
    use axum::routing::get;
    use tokio::io::AsyncReadExt;

    /// A server with `cap` connections; `/slow` answers when `release` is notified.
    async fn server(cap: usize, release: Arc<Notify>) -> u16 {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let app = Router::new()
            .route("/fast", get(|| async { "fast" }))
            .route("/echo", axum::routing::post(|b: Bytes| async move { b }))
            .route(
                "/slow",
                get(move || {
                    let release = Arc::clone(&release);
                    async move {
                        release.notified().await;
                        "slow"
                    }
                }),
            );
        let limits = HttpLimits {
            header_timeout: Duration::from_secs(30),
            max_connections: cap,
            ..HttpLimits::default()
        };
        tokio::spawn(serve(listener, app, limits, std::future::pending()));
        port
    }

    async fn send(port: u16, head: &[u8]) -> TcpStream {
        let mut s = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
        s.write_all(head).await.unwrap();
        s
    }

    async fn answer(mut s: TcpStream) -> String {
        let mut out = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut out)).await;
        assert!(read.is_ok(), "no answer within 5 s");
        String::from_utf8_lossy(&out).into_owned()
    }

    const FAST: &[u8] = b"GET /fast HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n";

    #[tokio::test]
    async fn half_sent_requests_make_room_for_whole_ones() {
        let release = Arc::new(Notify::new());
        let port = server(4, Arc::clone(&release)).await;
        // Every slot held: request heads that never end, and a body that never ends.
        let mut held = Vec::new();
        for _ in 0..3 {
            held.push(send(port, b"GET /fast HTTP/1.1\r\nhost: x\r\n").await);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        held.push(
            send(
                port,
                b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{",
            )
            .await,
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
        for i in 0..20 {
            let a = answer(send(port, FAST).await).await;
            assert!(a.starts_with("HTTP/1.1 200"), "{i}: {a}");
            assert!(a.ends_with("fast"), "{a}");
        }
        // The oldest half-sent one made that room.
        let mut held = held.into_iter();
        assert_eq!(answer(held.next().unwrap()).await, "");
        // Four whole requests being served at once take the free slot and the other three.
        let slow = b"GET /slow HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n";
        let mut busy = Vec::new();
        for _ in 0..4 {
            busy.push(send(port, slow).await);
        }
        for s in held {
            assert_eq!(answer(s).await, "");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        release.notify_waiters();
        for s in busy {
            assert!(answer(s).await.ends_with("slow"));
        }
    }

    #[tokio::test]
    async fn when_every_connection_is_being_served_a_new_one_gets_503() {
        let release = Arc::new(Notify::new());
        let port = server(2, Arc::clone(&release)).await;
        let slow = b"GET /slow HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n";
        let busy = [send(port, slow).await, send(port, slow).await];
        tokio::time::sleep(Duration::from_millis(100)).await;
        let a = answer(send(port, FAST).await).await;
        assert!(a.starts_with("HTTP/1.1 503"), "{a}");
        assert!(a.contains("retry later"), "{a}");
        release.notify_waiters();
        for s in busy {
            assert!(answer(s).await.ends_with("slow"));
        }
        let a = answer(send(port, FAST).await).await;
        assert!(a.starts_with("HTTP/1.1 200"), "{a}");
    }

    #[tokio::test]
    async fn an_idle_kept_alive_connection_gives_way_after_the_never_served() {
        let port = server(2, Arc::new(Notify::new())).await;
        // A client that completed a request and keeps its connection open...
        let mut kept = send(port, b"GET /fast HTTP/1.1\r\nhost: x\r\n\r\n").await;
        let mut buf = [0u8; 256];
        let n = tokio::time::timeout(Duration::from_secs(5), kept.read(&mut buf))
            .await
            .unwrap()
            .unwrap();
        assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
        // ... and one that never finished its head: that one goes first.
        let silent = send(port, b"GET /fast HTTP/1.1\r\n").await;
        tokio::time::sleep(Duration::from_millis(100)).await;
        let a = answer(send(port, FAST).await).await;
        assert!(a.starts_with("HTTP/1.1 200"), "{a}");
        assert_eq!(answer(silent).await, "");
        kept.write_all(FAST).await.unwrap();
        assert!(answer(kept).await.starts_with("HTTP/1.1 200"));
    }
}
