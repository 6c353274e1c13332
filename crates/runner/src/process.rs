//! The runner process: bind, load the model on the engine thread, serve until a signal, the
//! parent's death or a load failure, then end streams and exit.

use crate::engine::{self, EngineConfig, Job};
use crate::server::{router, AppState};
use base::listen::{serve, HttpLimits};
use std::net::SocketAddr;
use std::time::Duration;

#[derive(Debug, Clone)]
pub struct RunnerOptions {
    pub engine: EngineConfig,
    pub host: String,
    pub port: u16,
    pub http: HttpLimits,
}

/// Why the runner stopped serving.
enum Exit {
    Signal(&'static str),
    ParentGone,
    /// A rank of the split model was lost: streams end with errors, the process non-zero.
    RankLost,
}

/// Resolves when a rank of a split model was lost (the engine sets `lost`).
async fn rank_lost(lost: std::sync::Arc<std::sync::atomic::AtomicBool>) -> Exit {
    loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        if lost.load(std::sync::atomic::Ordering::SeqCst) {
            return Exit::RankLost;
        }
    }
}

/// The process that started us, read once at start: a parent that dies while the model loads
/// has already re-parented us by the time loading ends.
fn parent_pid() -> libc::pid_t {
    // SAFETY: getppid has no preconditions and cannot fail.
    unsafe { libc::getppid() }
}

/// Resolves when `parent` is no longer our parent (it exited and we were re-parented).
async fn parent_gone(parent: libc::pid_t) -> Exit {
    loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        // SAFETY: as above.
        if unsafe { libc::getppid() } != parent {
            return Exit::ParentGone;
        }
    }
}

/// Runs the runner to completion. An `Err` is the one line to print before exiting non-zero.
pub async fn run(opts: RunnerOptions) -> Result<(), String> {
    let parent = parent_pid();
    // One listener for the signals from before the port is bound to the end: one made after
    // loading would miss a SIGTERM sent as the runner became ready, and it would not exit.
    let mut signals = base::signals::Termination::new();
    let addr: SocketAddr = format!("{}:{}", opts.host, opts.port)
        .parse()
        .map_err(|e| format!("invalid listen address {}:{}: {e}", opts.host, opts.port))?;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| format!("cannot listen on {addr}: {e}"))?;
    // With --port 0 the system chose the port: report the one bound.
    let addr = listener.local_addr().unwrap_or(addr);
    let handle = engine::spawn(opts.engine.clone())
        .map_err(|e| format!("cannot start the engine thread: {e}"))?;
    let (loaded, join, jobs, shared) = (handle.loaded, handle.thread, handle.jobs, handle.shared);
    let state = AppState {
        limits: opts.http,
        tokenize_slots: std::sync::Arc::new(tokio::sync::Semaphore::new(
            crate::server::TOKENIZE_UNITS as usize,
        )),
        jobs: jobs.clone(),
        shared: shared.clone(),
        prefill_chunk: opts.engine.prefill_chunk,
    };
    let app = router(state);
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let limits = opts.http;
    let server = tokio::spawn(async move {
        serve(listener, app, limits, async {
            let _ = stop_rx.await;
        })
        .await
    });

    // Serve 503 while loading; a model that cannot load ends the process with its reason.
    let load = tokio::select! {
        r = loaded => r.unwrap_or_else(|_| Err("the engine thread died while loading".into())),
        e = signals.wait() => { let _ = stop_tx.send(()); return Err(format!("interrupted by {e} while loading")); }
        _ = parent_gone(parent) => { let _ = stop_tx.send(()); return Err("the parent process exited while the model was loading".into()); }
    };
    if let Err(e) = load {
        let _ = stop_tx.send(());
        return Err(e);
    }
    tracing::info!(
        model = %opts.engine.model.origin.display(),
        architecture = shared.architecture.get().copied().unwrap_or("?"),
        context = shared.context_length.load(std::sync::atomic::Ordering::Relaxed),
        %addr,
        "runner ready"
    );
    let why = tokio::select! {
        e = signals.wait() => Exit::Signal(e),
        e = parent_gone(parent) => e,
        e = rank_lost(shared.rank_lost.clone()) => e,
    };
    let failed = match why {
        Exit::Signal(s) => {
            tracing::info!("{s}: finishing in-flight streams and exiting");
            None
        }
        Exit::ParentGone => {
            tracing::info!("parent process exited; shutting down");
            None
        }
        Exit::RankLost => Some("a rank of the split model was lost".to_string()),
    };
    // End every stream (each gets its final chunk), then stop serving.
    let _ = jobs.send(Job::Shutdown);
    let _ = stop_tx.send(());
    let _ = tokio::time::timeout(Duration::from_secs(5), server).await;
    if let Some(e) = failed {
        // The engine's collectives may never return: do not wait for its thread.
        return Err(e);
    }
    let _ = tokio::task::spawn_blocking(move || join.join()).await;
    Ok(())
}
