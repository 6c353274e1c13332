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

/// SIGTERM and SIGINT, caught from the moment this is made: a listener hears only the signals
/// sent after it exists (tokio's), so a process makes one before it tells anyone it is up and
/// keeps it to the end.
pub struct Termination {
    signals: Option<(tokio::signal::unix::Signal, tokio::signal::unix::Signal)>,
}

impl Termination {
    /// Installs the handlers now (inside a tokio runtime).
    pub fn new() -> Termination {
        use tokio::signal::unix::{signal, SignalKind};
        let signals = match (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) {
            (Ok(term), Ok(int)) => Some((term, int)),
            _ => None,
        };
        Termination { signals }
    }

    /// Resolves with the name of the first SIGTERM or SIGINT; never, when the handlers could not
    /// be installed (the runner then still stops when its parent dies).
    pub async fn wait(&mut self) -> &'static str {
        let Some((term, int)) = &mut self.signals else {
            return std::future::pending().await;
        };
        tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
        }
    }
}

impl Default for Termination {
    fn default() -> Self {
        Self::new()
    }
}
