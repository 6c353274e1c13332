//! Process signals and memory hand-back, as runner and serve both handle them.

/// How this process hands free memory back to the system; the binary knows its allocator.
static RELEASE: std::sync::OnceLock<fn()> = std::sync::OnceLock::new();

/// Installs the process's way of handing free memory back (see [`release_free_memory`]).
pub fn set_memory_release(release: fn()) {
    let _ = RELEASE.set(release);
}

/// Hands the allocator's free memory back to the system, after a request that used a lot of
/// it: the installed release, else glibc's `malloc_trim` (glibc keeps freed arenas otherwise).
pub fn release_free_memory() {
    if let Some(release) = RELEASE.get() {
        return release();
    }
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only releases free memory; it has no preconditions.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Hands free memory back when dropped (off the async threads): held by the answer to a large
/// request, so that what building and sending it took is given back once it is sent.
pub struct ReleaseOnDrop;

impl Drop for ReleaseOnDrop {
    fn drop(&mut self) {
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn_blocking(release_free_memory);
        } else {
            release_free_memory();
        }
    }
}

/// `resp` with its body holding a [`ReleaseOnDrop`]: free memory is handed back once the body
/// has been sent or dropped.
pub fn release_after(resp: axum::response::Response) -> axum::response::Response {
    crate::listen::holding(resp, ReleaseOnDrop)
}

/// Resolves with the name of the first SIGTERM or SIGINT; never, when the handlers cannot be
/// installed (the runner then still stops when its parent dies).
pub async fn termination() -> &'static str {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
    }
}
