//! `mlx-runner serve`: the parent model server. It answers ollama's API (`/api/...`) and the
//! OpenAI API (`/v1/...`), renders prompts from chat templates, merges options, and runs each
//! model in a `mlx-runner runner` child process that it spawns, watches and stops
//! (docs/SERVE.md).

mod anthropic_api;
mod body;
pub mod catalog;
pub mod client;
mod create;
pub mod families;
pub mod forced;
mod images;
mod ollama_api;
mod openai_api;
pub mod options;
pub mod parse;
pub mod pipeline;
mod responses_api;
pub mod sched;
mod security;
mod sse;
pub mod template;
mod transcribe;
mod unserved;

use axum::routing::{get, post};
use axum::Router;
pub use create::{ImportError, Importer};
use sched::{KeepAlive, SchedConfig, Scheduler};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

#[derive(Clone)]
pub struct ServeConfig {
    pub addr: SocketAddr,
    /// The store (`MLX_RUNNER_MODELS`), default `~/.mlx-runner/models`.
    pub models: Option<PathBuf>,
    pub keep_alive: KeepAlive,
    pub max_loaded: usize,
    pub parallel: usize,
    pub load_timeout: Duration,
    /// A runner with no token and no status answer for this long is frozen: stopped.
    pub stall_timeout: Duration,
    /// Bytes all runners together may use (`None`: what the machine has available).
    pub memory_limit: Option<u64>,
    /// Runners split their models over these ranks.
    pub ranks: Option<sched::Ranks>,
    pub origins: Vec<String>,
    /// The executable spawned as `runner`.
    pub exe: PathBuf,
    /// What imports a model for `/api/create` (reading and quantizing tensors is the store's
    /// importer's, which this crate does not link).
    pub importer: create::Importer,
}

pub struct App {
    pub cfg: ServeConfig,
    pub catalog: catalog::Catalog,
    pub sched: Arc<Scheduler>,
    /// Renders prompts in worker processes.
    pub renderer: template::Renderer,
    /// Held by the create in progress.
    pub creating: Arc<tokio::sync::Mutex<()>>,
    /// Each model's special tokens by text, by manifest digest (tokenizer.json is large).
    special: std::sync::Mutex<
        std::collections::HashMap<String, Arc<std::collections::HashMap<String, u32>>>,
    >,
}

impl App {
    pub fn special_tokens(
        &self,
        m: &catalog::Model,
    ) -> Arc<std::collections::HashMap<String, u32>> {
        if let Some(s) = self.special.lock().unwrap().get(m.digest()) {
            return s.clone();
        }
        let s = Arc::new(m.special_tokens());
        self.special
            .lock()
            .unwrap()
            .insert(m.digest().to_string(), s.clone());
        s
    }
}

/// The address `MLX_RUNNER_HOST` names (`host`, `host:port`, `http://host:port`), with
/// ollama's defaults (127.0.0.1, port 11434).
pub fn parse_host(v: &str) -> Result<SocketAddr, String> {
    let v = v.trim();
    let v = v
        .strip_prefix("http://")
        .or_else(|| v.strip_prefix("https://"))
        .unwrap_or(v)
        .trim_end_matches('/');
    let (host, port) = match v.rsplit_once(':') {
        Some((h, p)) if !h.is_empty() && !p.contains(']') => (h, p),
        Some(("", p)) => ("127.0.0.1", p),
        _ => (v, "11434"),
    };
    let host = if host.is_empty() { "127.0.0.1" } else { host };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let port: u16 = port
        .parse()
        .map_err(|_| format!("invalid port in host {v:?}"))?;
    let ip = if host == "localhost" {
        std::net::IpAddr::from([127, 0, 0, 1])
    } else {
        host.parse()
            .map_err(|_| format!("invalid host {host:?}: expected an IP address or localhost"))?
    };
    Ok(SocketAddr::new(ip, port))
}

pub(crate) fn http_limits() -> base::listen::HttpLimits {
    base::listen::HttpLimits {
        header_timeout: Duration::from_secs(30),
        body_timeout: Duration::from_secs(60),
        max_connections: 1024,
        max_body: body::MAX_BODY,
    }
}

pub fn router(app: Arc<App>) -> Router {
    let access = Arc::new(security::Access::new(
        app.cfg.addr.ip().is_loopback(),
        &app.cfg.origins,
    ));
    let running = || async { "Ollama is running" };
    let api = Router::new()
        .route("/", get(running).head(running))
        .route(
            "/api/version",
            get(ollama_api::version).head(ollama_api::version),
        )
        .route("/api/tags", get(ollama_api::tags).head(ollama_api::tags))
        .route("/api/ps", get(ollama_api::ps))
        .route("/api/show", post(ollama_api::show))
        .route("/api/generate", post(ollama_api::generate))
        .route("/api/chat", post(ollama_api::chat))
        .route("/api/copy", post(ollama_api::copy))
        .route("/api/delete", axum::routing::delete(ollama_api::delete))
        .route("/api/create", post(create::create))
        .route("/v1/chat/completions", post(openai_api::chat))
        .route("/v1/completions", post(openai_api::completions))
        .route("/v1/models", get(openai_api::models))
        .route("/v1/models/{*name}", get(openai_api::model))
        .route("/v1/responses", post(responses_api::responses))
        .route("/v1/audio/transcriptions", post(transcribe::transcriptions))
        .route("/v1/messages", post(anthropic_api::messages_route))
        .route(
            "/v1/messages/count_tokens",
            post(anthropic_api::count_tokens),
        )
        .route("/api/embed", post(unserved::embed))
        .route("/api/embeddings", post(unserved::embed))
        .route("/v1/embeddings", post(unserved::openai_embeddings))
        .route("/api/pull", post(unserved::registry))
        .route("/api/push", post(unserved::registry))
        .fallback(unserved::not_found)
        .method_not_allowed_fallback(unserved::method_not_allowed)
        .layer(axum::extract::DefaultBodyLimit::max(body::MAX_BODY))
        .layer(axum::middleware::from_fn(body::release_after_large))
        .layer(axum::middleware::from_fn_with_state(
            http_limits(),
            base::listen::refuse_oversized,
        ))
        .with_state(app.clone());
    // Checkpoint uploads are as large as checkpoints: streamed to disk, not bounded.
    let blobs = Router::new()
        .route(
            "/api/blobs/{digest}",
            axum::routing::head(create::head_blob).post(create::post_blob),
        )
        .layer(axum::extract::DefaultBodyLimit::disable())
        .with_state(app);
    api.merge(blobs).layer(axum::middleware::from_fn_with_state(
        access,
        security::guard,
    ))
}

/// Serves until SIGINT/SIGTERM, then stops every runner.
pub async fn run(cfg: ServeConfig) -> anyhow::Result<()> {
    let catalog = catalog::Catalog::open(cfg.models.clone())?;
    let sched = Scheduler::new(SchedConfig {
        exe: cfg.exe.clone(),
        max_loaded: cfg.max_loaded,
        load_timeout: cfg.load_timeout,
        stall_timeout: cfg.stall_timeout,
        parallel: cfg.parallel,
        memory_limit: cfg.memory_limit,
        ranks: cfg.ranks.clone(),
    });
    // Signals are caught from before anyone can know serve is up.
    let mut signals = base::signals::Termination::new();
    let listener = tokio::net::TcpListener::bind(cfg.addr)
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen on {}: {e}", cfg.addr))?;
    let addr = listener.local_addr()?;
    let renderer = template::Renderer::new(cfg.exe.clone());
    let app = Arc::new(App {
        cfg,
        catalog,
        sched: sched.clone(),
        renderer,
        creating: Default::default(),
        special: Default::default(),
    });
    // Uploads a previous serve left unfinished.
    let _ = std::fs::remove_dir_all(app.catalog.ours.uploads());
    eprintln!("mlx-runner serve listening on http://{addr}");
    tracing::info!(%addr, store = %app.catalog.ours.root().display(), "serving");
    let limits = http_limits();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(base::listen::serve(listener, router(app), limits, async {
        let _ = stop_rx.await;
    }));
    let why = signals.wait().await;
    tracing::info!("{why}: stopping, unloading models");
    sched.shutdown().await;
    let _ = stop_tx.send(());
    let _ = tokio::time::timeout(Duration::from_secs(5), server).await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_parse_as_ollama_reads_them() {
        assert_eq!(parse_host("").unwrap().to_string(), "127.0.0.1:11434");
        assert_eq!(
            parse_host("127.0.0.1").unwrap().to_string(),
            "127.0.0.1:11434"
        );
        assert_eq!(parse_host(":8080").unwrap().to_string(), "127.0.0.1:8080");
        assert_eq!(
            parse_host("http://0.0.0.0:1234/").unwrap().to_string(),
            "0.0.0.0:1234"
        );
        assert_eq!(
            parse_host("localhost:9").unwrap().to_string(),
            "127.0.0.1:9"
        );
        assert_eq!(parse_host("[::1]:7").unwrap().to_string(), "[::1]:7");
        assert!(parse_host("example.com").is_err());
    }
}
