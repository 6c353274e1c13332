//! Runners as child processes: one per model in use, spawned on demand, kept while requests use
//! them and for their keep-alive after, evicted least-recently-used when too many are loaded,
//! noticed when they die, and stopped with the server.
//!
//! Each model has a slot whose async lock serialises loading, so concurrent first requests for
//! a model start one runner, not several. A runner is reaped by the task that waits on its
//! process; everything else only reads `dead`.

use crate::client::{self, HttpClient};
use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};
use tokio::io::AsyncBufReadExt;
use tokio::sync::Notify;

/// How long a model stays loaded after its last request ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeepAlive {
    For(Duration),
    Forever,
}

#[derive(Debug, Clone)]
pub struct SchedConfig {
    /// The `mlx-runner` executable to spawn as `runner`.
    pub exe: PathBuf,
    pub max_loaded: usize,
    pub load_timeout: Duration,
    /// A runner that sends no token and does not answer `/v1/status` for this long is
    /// frozen (stopped by a signal, or wedged): it is killed.
    pub stall_timeout: Duration,
    /// The runner's `--parallel`.
    pub parallel: usize,
    /// Runners split their models over these ranks (docs/DISTRIBUTED.md).
    pub ranks: Option<Ranks>,
    /// Bytes every runner together may use; `None`: what the machine has available. Models
    /// are placed within it (see [`Scheduler::make_room`]) and each runner plans its context
    /// and prefix cache within its share (`--memory-limit`).
    pub memory_limit: Option<u64>,
}

/// The ranks a runner splits its model over: a hostfile, read by the runner.
#[derive(Debug, Clone)]
pub struct Ranks {
    pub hostfile: PathBuf,
    /// How many ranks it names, and how many ring ports they take (one per rank and address).
    pub count: usize,
    pub ports: u16,
    /// The first ring port, where ranks on other hosts wait on a known one; `None`: a free
    /// block on this machine for each runner (ranks on loopback only).
    pub ring_port: Option<u16>,
    /// The runners' `--parallel-mode` (`pipeline`, `tensor`); `None`: the runner's default.
    pub mode: Option<String>,
}

/// What a runner is started for.
#[derive(Debug, Clone)]
pub struct Target {
    /// The model's name as the runner resolves it (`--model`).
    pub name: String,
    /// The manifest digest: a model re-created under the same name gets a new runner.
    pub digest: String,
    pub ctx_size: Option<u64>,
    /// The model's bytes on disk (weights, draft, tokenizer): what its first load is
    /// estimated from.
    pub size: u64,
}

#[derive(Debug, Default)]
struct Idle {
    last_used: Option<Instant>,
    /// `None` while in use or when kept forever.
    expires: Option<Instant>,
    /// The keep-alive of the latest request to start (it decides, as in ollama).
    keep_alive: Option<KeepAlive>,
    /// Unload as soon as the last request ends (an unload asked for while busy).
    expire_on_idle: bool,
    /// Being stopped: no new request may use it.
    stopping: bool,
}

pub struct Runner {
    pub name: String,
    pub digest: String,
    pub port: u16,
    /// The ranks its model is split over (1: one process).
    pub ranks: usize,
    pub context_length: AtomicU64,
    pub memory: AtomicU64,
    /// What it may grow to: its memory once loaded plus its prefix cache's budget. A runner
    /// reports what it uses now; its cache fills its budget later, so placing the next model
    /// by use alone would overcommit once the caches fill.
    committed: AtomicU64,
    pub loaded_at: SystemTime,
    pid: u32,
    active: AtomicUsize,
    idle: Mutex<Idle>,
    dead: AtomicBool,
    /// Killed for not answering: streams that end with it say so.
    frozen: AtomicBool,
    exited: Notify,
    log: Arc<Mutex<Tail>>,
}

/// The runner's last lines on stderr, with when each came, and how it exited.
#[derive(Debug, Default)]
struct Tail {
    lines: std::collections::VecDeque<(Instant, String)>,
    exit: Option<(Instant, String)>,
}

impl Tail {
    const KEPT: usize = 64;

    fn push(&mut self, line: String) {
        if self.lines.len() == Self::KEPT {
            self.lines.pop_front();
        }
        self.lines.push_back((Instant::now(), line));
    }

    /// What the runner said as it died: its last error-looking line from the moments before
    /// it exited (a panic's message, not the backtrace note after it), and the exit status.
    /// Lines from long before the exit are not its last words.
    fn last_words(&self) -> String {
        const RECENT: Duration = Duration::from_secs(3);
        let Some((at, status)) = &self.exit else {
            return self
                .lines
                .back()
                .map(|(_, l)| l.clone())
                .unwrap_or_default();
        };
        let recent: Vec<&str> = self
            .lines
            .iter()
            .filter(|(t, _)| at.saturating_duration_since(*t) <= RECENT)
            .map(|(_, l)| l.as_str())
            .filter(|l| !l.starts_with("note: ") && !l.trim_start().starts_with("at "))
            .collect();
        // An error it printed (a panic, a fatal error, a failed load, C++'s terminate), not
        // its ordinary log lines, however recent.
        let telling = |l: &&&str| {
            let lower = l.to_ascii_lowercase();
            let ordinary = [" info ", " debug ", " trace "]
                .iter()
                .any(|level| lower.contains(level));
            !ordinary
                && [
                    "panicked",
                    "fatal",
                    "error",
                    "abort",
                    "terminate",
                    "killed",
                    "out of memory",
                ]
                .iter()
                .any(|w| lower.contains(w))
        };
        let words = recent.iter().rposition(|l| telling(&l)).map(|i| {
            // C++'s `what():` follows the line that names the exception.
            match recent.get(i + 1) {
                Some(next) if next.trim_start().starts_with("what()") => {
                    format!("{} {}", recent[i], next.trim())
                }
                _ => recent[i].to_string(),
            }
        });
        match words {
            Some(w) => format!("{w} ({status})"),
            None => format!("it exited without a word ({status})"),
        }
    }
}

impl Runner {
    pub fn alive(&self) -> bool {
        !self.dead.load(Ordering::SeqCst)
    }

    /// When an idle runner will be unloaded (`None`: in use, or kept forever).
    pub fn expires_at(&self) -> Option<SystemTime> {
        let idle = self.idle.lock().unwrap();
        let now = Instant::now();
        match (
            self.active.load(Ordering::SeqCst),
            idle.keep_alive,
            idle.expires,
        ) {
            (0, _, Some(at)) => Some(SystemTime::now() + at.saturating_duration_since(now)),
            (_, Some(KeepAlive::For(d)), _) => Some(SystemTime::now() + d),
            _ => None,
        }
    }

    /// Why the runner failed, in its last words: see [`Tail::last_words`].
    pub fn last_error(&self) -> String {
        self.log.lock().unwrap().last_words()
    }

    /// Whether it was killed for not answering.
    pub fn frozen(&self) -> bool {
        self.frozen.load(Ordering::SeqCst)
    }

    /// Whether the runner answers `/v1/status` within `within`. Its HTTP side runs beside the
    /// engine, so a runner busy with a long prefill still answers; a stopped or wedged one
    /// does not.
    pub async fn responsive(&self, client: &HttpClient, within: Duration) -> bool {
        matches!(
            client::status_within(client, self.port, within).await,
            Ok((200, _))
        )
    }

    /// Kills a runner that stopped answering; its reaper notices the exit and the next request
    /// starts a new one.
    pub fn kill_frozen(&self, waited: Duration) {
        if self.alive() && !self.frozen.swap(true, Ordering::SeqCst) {
            tracing::error!(
                model = %self.name,
                seconds = waited.as_secs_f64(),
                "the runner stopped answering; killing it"
            );
            self.idle.lock().unwrap().stopping = true;
            self.signal(libc::SIGKILL);
        }
    }

    fn signal(&self, sig: libc::c_int) {
        if self.alive() && self.pid > 0 {
            // SAFETY: kill has no memory-safety preconditions; the pid is our child and is not
            // reaped (and so not reusable) while `dead` is false.
            unsafe {
                libc::kill(self.pid as libc::pid_t, sig);
            }
        }
    }

    /// Marks the runner as stopping if no request uses it: from then on none can.
    fn begin_stop(&self) -> bool {
        let mut idle = self.idle.lock().unwrap();
        if self.active.load(Ordering::SeqCst) == 0 && !idle.stopping {
            idle.stopping = true;
            true
        } else {
            false
        }
    }

    /// SIGTERM (the runner ends its streams and exits), SIGKILL after `grace`.
    async fn stop(&self, grace: Duration) {
        self.idle.lock().unwrap().stopping = true;
        if !self.alive() {
            return;
        }
        self.signal(libc::SIGTERM);
        if !self.exited_within(grace).await {
            tracing::warn!(model = %self.name, "runner ignored SIGTERM; killing it");
            self.signal(libc::SIGKILL);
            self.exited_within(Duration::from_secs(5)).await;
        }
    }

    /// Whether the runner is known dead within `within` (its reaper has seen it exit and read
    /// its last words).
    pub async fn exited_within(&self, within: Duration) -> bool {
        let exited = self.exited.notified();
        tokio::pin!(exited);
        // Registered before `dead` is read: the reaper stores it before notifying.
        exited.as_mut().enable();
        if !self.alive() {
            return true;
        }
        let _ = tokio::time::timeout(within, exited).await;
        !self.alive()
    }
}

/// A request's hold on a loaded runner; dropping it starts the keep-alive countdown.
pub struct Lease {
    pub runner: Arc<Runner>,
    sched: Arc<Scheduler>,
    keep_alive: KeepAlive,
}

impl Drop for Lease {
    fn drop(&mut self) {
        let r = &self.runner;
        let mut idle = r.idle.lock().unwrap();
        if r.active.fetch_sub(1, Ordering::SeqCst) == 1 {
            let now = Instant::now();
            let keep = match idle.keep_alive.unwrap_or(self.keep_alive) {
                _ if idle.expire_on_idle => KeepAlive::For(Duration::ZERO),
                k => k,
            };
            idle.last_used = Some(now);
            idle.expires = match keep {
                // Past what an Instant holds: forever.
                KeepAlive::For(d) => now.checked_add(d),
                KeepAlive::Forever => None,
            };
            if keep == KeepAlive::For(Duration::ZERO) {
                let (sched, runner) = (self.sched.clone(), r.clone());
                tokio::spawn(async move { sched.unload_if_idle(&runner).await });
            }
        }
        drop(idle);
        self.sched.changed.notify_waiters();
    }
}

#[derive(Default)]
struct Slot {
    load: Arc<tokio::sync::Mutex<()>>,
    runner: Mutex<Option<Arc<Runner>>>,
}

pub struct Scheduler {
    cfg: SchedConfig,
    pub client: HttpClient,
    slots: Mutex<HashMap<String, Arc<Slot>>>,
    changed: Notify,
    shutting_down: AtomicBool,
    /// Held while making room for a runner and starting it: loads happen one at a time, so
    /// two of them cannot both fit under the limit.
    placement: tokio::sync::Mutex<()>,
    /// The most memory each model's runners have reported (by digest): a model's next load
    /// is placed by what it took, not by an estimate.
    needs: Mutex<HashMap<String, u64>>,
}

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("{0}")]
    Failed(String),
    #[error("the server is shutting down")]
    ShuttingDown,
    #[error("{0}")]
    Busy(String),
}

impl Scheduler {
    pub fn new(cfg: SchedConfig) -> Arc<Scheduler> {
        let s = Arc::new(Scheduler {
            cfg,
            client: client::http_client(),
            slots: Mutex::new(HashMap::new()),
            changed: Notify::new(),
            shutting_down: AtomicBool::new(false),
            placement: tokio::sync::Mutex::new(()),
            needs: Mutex::new(HashMap::new()),
        });
        tokio::spawn(reaper(Arc::downgrade(&s)));
        s
    }

    fn slot(&self, key: &str) -> Arc<Slot> {
        self.slots
            .lock()
            .unwrap()
            .entry(key.to_string())
            .or_default()
            .clone()
    }

    pub fn stall_timeout(&self) -> Duration {
        self.cfg.stall_timeout
    }

    /// Every live runner.
    pub fn loaded(&self) -> Vec<Arc<Runner>> {
        let slots: Vec<_> = self.slots.lock().unwrap().values().cloned().collect();
        slots
            .iter()
            .filter_map(|s| s.runner.lock().unwrap().clone())
            .filter(|r| r.alive())
            .collect()
    }

    /// A runner for `target`, loading it if needed; the lease keeps it loaded.
    pub async fn acquire(
        self: &Arc<Self>,
        target: &Target,
        keep_alive: KeepAlive,
    ) -> Result<Lease, LoadError> {
        loop {
            if self.shutting_down.load(Ordering::SeqCst) {
                return Err(LoadError::ShuttingDown);
            }
            let slot = self.slot(&target.name);
            let loading = slot.load.clone().lock_owned().await;
            let current = slot.runner.lock().unwrap().clone();
            if let Some(r) = current {
                if r.alive() && r.digest == target.digest {
                    if let Some(lease) = self.lease(&r, keep_alive) {
                        return Ok(lease);
                    }
                }
                // Dead, stopping, or the model changed under its name: once its requests are
                // done, a fresh runner.
                drop(loading);
                self.retire(&r).await;
                continue;
            }
            // The load runs in its own task: a request that goes away mid-load leaves a
            // registered runner (which its keep-alive will unload), never an orphan process.
            let (sched, t) = (self.clone(), target.clone());
            let task = tokio::spawn(async move {
                let _loading = loading;
                let _placing = sched.placement.lock().await;
                let share = sched.make_room(&t).await?;
                let r = sched.spawn(&t, share).await?;
                {
                    let mut idle = r.idle.lock().unwrap();
                    let now = Instant::now();
                    idle.last_used = Some(now);
                    // Until a request takes it: the keep-alive, at least a few seconds.
                    idle.expires = match keep_alive {
                        KeepAlive::For(d) => now.checked_add(d.max(Duration::from_secs(5))),
                        KeepAlive::Forever => None,
                    };
                }
                *slot.runner.lock().unwrap() = Some(r.clone());
                if sched.shutting_down.load(Ordering::SeqCst) {
                    sched.unload(&r).await;
                    return Err(LoadError::ShuttingDown);
                }
                Ok(r)
            });
            let r = task
                .await
                .map_err(|e| LoadError::Failed(format!("loading failed: {e}")))??;
            if let Some(lease) = self.lease(&r, keep_alive) {
                return Ok(lease);
            }
        }
    }

    /// Waits for `r`'s requests to end (up to the load timeout), then stops it.
    async fn retire(&self, r: &Arc<Runner>) {
        let deadline = Instant::now() + self.cfg.load_timeout;
        while r.alive() && r.active.load(Ordering::SeqCst) > 0 && Instant::now() < deadline {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if r.active.load(Ordering::SeqCst) == 0 {
                break;
            }
            let _ = tokio::time::timeout(Duration::from_millis(500), changed).await;
        }
        r.stop(Duration::from_secs(10)).await;
        self.forget(r);
    }

    /// A lease on `r`, unless it is being stopped.
    fn lease(self: &Arc<Self>, r: &Arc<Runner>, keep_alive: KeepAlive) -> Option<Lease> {
        let mut idle = r.idle.lock().unwrap();
        if idle.stopping || !r.alive() {
            return None;
        }
        r.active.fetch_add(1, Ordering::SeqCst);
        idle.expires = None;
        idle.keep_alive = Some(keep_alive);
        // A new request's keep-alive replaces an unload asked for earlier (as in ollama).
        idle.expire_on_idle = false;
        drop(idle);
        Some(Lease {
            runner: r.clone(),
            sched: self.clone(),
            keep_alive,
        })
    }

    /// What loading `target` will take: what its runners took before, else twice its bytes on
    /// disk (a 16-bit checkpoint computed in float32 on the CPU doubles; a quantized one's
    /// packed weights do not, so this errs on the side of room).
    fn need(&self, target: &Target) -> u64 {
        let known = self.needs.lock().unwrap().get(&target.digest).copied();
        known.unwrap_or(target.size.saturating_mul(2))
    }

    /// Records what a runner reports using, for its model's next placement.
    fn noted(&self, r: &Runner, memory: u64) {
        r.memory.store(memory, Ordering::SeqCst);
        let mut needs = self.needs.lock().unwrap();
        let n = needs.entry(r.digest.clone()).or_default();
        *n = (*n).max(memory);
    }

    /// The memory free for one more runner beside `others`, each counted at the most it may
    /// hold (what it uses now, asked now, or what it is committed to: its memory once loaded
    /// plus its prefix-cache budget): within `--memory-limit`, what they leave of it; else what
    /// the machine has available less what they may still grow by.
    async fn room(&self, others: &[Arc<Runner>]) -> Option<u64> {
        let (mut most, mut growth) = (0u64, 0u64);
        for r in others {
            if let Ok((200, st)) = client::status(&self.client, r.port).await {
                self.noted(r, st.memory);
            }
            let now = r.memory.load(Ordering::SeqCst);
            let committed = r.committed.load(Ordering::SeqCst);
            most = most.saturating_add(now.max(committed));
            growth = growth.saturating_add(committed.saturating_sub(now));
        }
        match self.cfg.memory_limit {
            Some(limit) => Some(limit.saturating_sub(most)),
            None => base::machine::machine_available().map(|b| (b as u64).saturating_sub(growth)),
        }
    }

    /// Unloads runners until one more fits, in count (`--max-loaded-models`) and in memory
    /// (what `target` is expected to take against [`Scheduler::room`]): the least recently
    /// used idle one first; when all are busy, waits for one to become idle (up to the load
    /// timeout). A model that does not fit even alone is still started, and its runner's own
    /// plan decides (it refuses a context it cannot hold). Returns the new runner's share when
    /// others stay loaded or there is a `--memory-limit`: what they leave
    /// ([`Scheduler::room`]), so that its plan (context, prefix-cache budget) does not count on
    /// memory they may still fill.
    async fn make_room(&self, target: &Target) -> Result<Option<u64>, LoadError> {
        let deadline = Instant::now() + self.cfg.load_timeout;
        let need = self.need(target);
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            let others: Vec<_> = self
                .loaded()
                .into_iter()
                .filter(|r| r.name != target.name)
                .collect();
            let crowded = others.len() >= self.cfg.max_loaded.max(1);
            let room = match (self.cfg.memory_limit, others.is_empty()) {
                (limit, true) => limit,
                _ => self.room(&others).await,
            };
            let short = !others.is_empty() && room.is_some_and(|r| need > r);
            if !crowded && !short {
                return Ok(room);
            }
            let mut idle: Vec<_> = others
                .iter()
                .filter(|r| r.active.load(Ordering::SeqCst) == 0)
                .cloned()
                .collect();
            idle.sort_by_key(|r| r.idle.lock().unwrap().last_used);
            if let Some(v) = idle.into_iter().find(|r| r.begin_stop()) {
                if crowded {
                    tracing::info!(model = %v.name, "unloading the least recently used model to make room");
                } else {
                    tracing::info!(
                        model = %v.name,
                        need,
                        room = room.unwrap_or_default(),
                        "unloading the least recently used model to make room in memory"
                    );
                }
                self.unload(&v).await;
                continue;
            }
            if tokio::time::timeout_at(deadline.into(), changed)
                .await
                .is_err()
            {
                return Err(LoadError::Busy(if crowded {
                    format!(
                        "{} models are loaded and all are busy; try again later",
                        others.len()
                    )
                } else {
                    format!(
                        "{} needs about {need} bytes and {} are free beside the {} busy models \
                         loaded; try again later",
                        target.name,
                        room.unwrap_or_default(),
                        others.len()
                    )
                }));
            }
        }
    }

    async fn unload(&self, r: &Arc<Runner>) {
        r.stop(Duration::from_secs(10)).await;
        self.forget(r);
    }

    /// Unloads `r` if no request is using it.
    pub async fn unload_if_idle(&self, r: &Arc<Runner>) {
        if r.begin_stop() {
            self.unload(r).await;
        }
    }

    /// Unloads the runner of model `name` now if it is idle, else as soon as its last request
    /// ends (`keep_alive: 0` with no prompt, `delete`).
    pub async fn unload_model(&self, name: &str) {
        let slot = self.slot(name);
        let r = slot.runner.lock().unwrap().clone();
        if let Some(r) = r {
            r.idle.lock().unwrap().expire_on_idle = true;
            self.unload_if_idle(&r).await;
        }
    }

    fn forget(&self, r: &Arc<Runner>) {
        let slots = self.slots.lock().unwrap();
        if let Some(slot) = slots.get(&r.name) {
            let mut cur = slot.runner.lock().unwrap();
            if cur.as_ref().is_some_and(|c| Arc::ptr_eq(c, r)) {
                cur.take();
            }
        }
        drop(slots);
        self.changed.notify_waiters();
    }

    /// Starts a runner for `target`, with `--memory-limit share` when it has one.
    async fn spawn(&self, target: &Target, share: Option<u64>) -> Result<Arc<Runner>, LoadError> {
        let started = Instant::now();
        let port = free_port().map_err(|e| LoadError::Failed(format!("no free port: {e}")))?;
        let mut cmd = tokio::process::Command::new(&self.cfg.exe);
        cmd.arg("runner")
            .arg("--model")
            .arg(&target.name)
            .arg("--port")
            .arg(port.to_string())
            .arg("--parallel")
            .arg(self.cfg.parallel.to_string());
        if let Some(n) = target.ctx_size {
            cmd.arg("--ctx-size").arg(n.to_string());
        }
        if let Some(share) = share {
            cmd.arg("--memory-limit").arg(share.to_string());
        }
        if let Some(r) = &self.cfg.ranks {
            let ring = match r.ring_port {
                Some(p) => p,
                None => free_ports(r.ports).map_err(|e| {
                    LoadError::Failed(format!("no {} free ring ports: {e}", r.ports))
                })?,
            };
            cmd.arg("--hostfile")
                .arg(&r.hostfile)
                .arg("--ring-port")
                .arg(ring.to_string());
            if let Some(mode) = &r.mode {
                cmd.arg("--parallel-mode").arg(mode);
            }
            // Each split runner would give its ranks the same shares of this machine's CPUs:
            // where several may run at once, the scheduler places them instead.
            if self.cfg.max_loaded > 1 {
                cmd.arg("--no-pin");
            }
        }
        cmd.stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let mut child = cmd.spawn().map_err(|e| {
            LoadError::Failed(format!(
                "cannot start the runner {}: {e}",
                self.cfg.exe.display()
            ))
        })?;
        let pid = child.id().unwrap_or_default();
        let log = Arc::new(Mutex::new(Tail::default()));
        let (read_tx, read_rx) = tokio::sync::oneshot::channel::<()>();
        if let Some(stderr) = child.stderr.take() {
            let (log, name) = (log.clone(), target.name.clone());
            tokio::spawn(async move {
                let _done = read_tx;
                // Read to the end whatever comes (a runner blocked on a full pipe would stall).
                let mut reader = tokio::io::BufReader::new(stderr);
                let mut buf = Vec::new();
                loop {
                    buf.clear();
                    match reader.read_until(b'\n', &mut buf).await {
                        Ok(0) => break,
                        Ok(_) => {
                            let line = String::from_utf8_lossy(&buf);
                            let line = strip_ansi(line.trim_end());
                            tracing::debug!(target: "runner", model = %name, "{line}");
                            if !line.trim().is_empty() {
                                log.lock().unwrap().push(line);
                            }
                        }
                        Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
                    }
                }
            });
        }
        let runner = Arc::new(Runner {
            name: target.name.clone(),
            digest: target.digest.clone(),
            port,
            ranks: self.cfg.ranks.as_ref().map_or(1, |r| r.count),
            context_length: AtomicU64::new(0),
            memory: AtomicU64::new(0),
            committed: AtomicU64::new(0),
            loaded_at: SystemTime::now(),
            pid,
            active: AtomicUsize::new(0),
            idle: Mutex::new(Idle::default()),
            dead: AtomicBool::new(false),
            frozen: AtomicBool::new(false),
            exited: Notify::new(),
            log,
        });
        // The reaper of this process: the only place `dead` is set.
        let watched = runner.clone();
        tokio::spawn(async move {
            let status = child.wait().await;
            let status = status.map(|s| s.to_string()).unwrap_or_default();
            // Its last lines may still be in the pipe: read them before it is known dead.
            let _ = tokio::time::timeout(Duration::from_millis(500), read_rx).await;
            watched.log.lock().unwrap().exit = Some((Instant::now(), status));
            watched.dead.store(true, Ordering::SeqCst);
            watched.exited.notify_waiters();
        });
        let deadline = started + self.cfg.load_timeout;
        loop {
            if runner.exited_within(Duration::from_millis(50)).await {
                let why = runner.last_error();
                return Err(LoadError::Failed(format!(
                    "the runner for {} exited while loading: {why}",
                    target.name
                )));
            }
            if let Ok((200, s)) = client::status(&self.client, port).await {
                // Ready, and our own child (not another process that took the port).
                if s.status == Some(0) && s.pid.is_none_or(|p| p == pid) {
                    runner
                        .context_length
                        .store(s.context_length, Ordering::SeqCst);
                    self.noted(&runner, s.memory);
                    runner
                        .committed
                        .store(s.memory.saturating_add(s.cache_budget), Ordering::SeqCst);
                    tracing::info!(
                        model = %target.name,
                        port,
                        seconds = started.elapsed().as_secs_f64(),
                        "runner ready"
                    );
                    return Ok(runner);
                }
            }
            if Instant::now() > deadline {
                runner.stop(Duration::from_secs(2)).await;
                return Err(LoadError::Failed(format!(
                    "the runner for {} did not become ready within {} s",
                    target.name,
                    self.cfg.load_timeout.as_secs()
                )));
            }
        }
    }

    /// Stops every runner (with the server).
    pub async fn shutdown(&self) {
        self.shutting_down.store(true, Ordering::SeqCst);
        let all = self.loaded();
        futures::future::join_all(all.iter().map(|r| r.stop(Duration::from_secs(10)))).await;
    }
}

/// Unloads runners whose keep-alive has run out.
async fn reaper(sched: std::sync::Weak<Scheduler>) {
    loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let Some(s) = sched.upgrade() else { return };
        let now = Instant::now();
        for r in s.loaded() {
            let expired = r.active.load(Ordering::SeqCst) == 0
                && r.idle.lock().unwrap().expires.is_some_and(|at| at <= now);
            if expired && r.begin_stop() {
                tracing::info!(model = %r.name, "keep-alive ran out: unloading");
                s.unload(&r).await;
            }
        }
        // Runners that died on their own leave their slots.
        let dead: Vec<_> = {
            let slots = s.slots.lock().unwrap();
            slots
                .values()
                .filter_map(|slot| slot.runner.lock().unwrap().clone())
                .filter(|r| !r.alive())
                .collect()
        };
        for r in dead {
            tracing::warn!(model = %r.name, "runner exited: {}", r.last_error());
            s.forget(&r);
        }
    }
}

fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// The first of `n` consecutive ports free on this machine now.
fn free_ports(n: u16) -> std::io::Result<u16> {
    for _ in 0..100 {
        let base = free_port()?;
        let free = base.checked_add(n).is_some()
            && (base..base + n).all(|p| std::net::TcpListener::bind(("127.0.0.1", p)).is_ok());
        if free {
            return Ok(base);
        }
    }
    Err(std::io::Error::new(
        std::io::ErrorKind::AddrInUse,
        "no block of free ports",
    ))
}

/// tracing's colours, if the runner logs with them.
fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\x1b' {
            for d in chars.by_ref() {
                if d.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tail(lines: &[(u64, &str)], exit_at: u64, status: &str) -> Tail {
        let t0 = Instant::now();
        let mut t = Tail::default();
        for &(ms, l) in lines {
            t.lines
                .push_back((t0 + Duration::from_millis(ms), l.to_string()));
        }
        t.exit = Some((t0 + Duration::from_millis(exit_at), status.to_string()));
        t
    }

    #[test]
    fn last_words_are_what_the_runner_said_as_it_died() {
        let ready = "2026-12-03T06:33:18Z  INFO runner::process: runner ready model=gem";
        // Killed without a word: the status, not its old log line.
        let t = tail(&[(0, ready)], 500, "signal: 9 (SIGKILL)");
        assert_eq!(
            t.last_words(),
            "it exited without a word (signal: 9 (SIGKILL))"
        );
        // A panic: its message, not the backtrace note after it.
        let t = tail(
            &[
                (0, ready),
                (900, "thread 'engine' panicked at src/x.rs:1:1:"),
                (901, "index out of bounds"),
                (
                    902,
                    "note: run with `RUST_BACKTRACE=1` environment variable",
                ),
            ],
            1000,
            "signal: 6 (SIGABRT)",
        );
        assert_eq!(
            t.last_words(),
            "thread 'engine' panicked at src/x.rs:1:1: (signal: 6 (SIGABRT))"
        );
        // C++'s terminate with the exception's text.
        let t = tail(
            &[
                (
                    10,
                    "terminate called after throwing an instance of 'std::runtime_error'",
                ),
                (11, "  what():  [malloc] out of memory"),
            ],
            20,
            "signal: 6 (SIGABRT)",
        );
        assert!(t.last_words().contains("what():  [malloc] out of memory"));
        // An error from long before the exit is not its last words.
        let t = tail(&[(0, "error: an old one")], 60_000, "exit status: 1");
        assert_eq!(t.last_words(), "it exited without a word (exit status: 1)");
        // A failed load.
        let t = tail(
            &[(0, ready), (5, "error: model.safetensors is truncated")],
            10,
            "exit status: 1",
        );
        assert_eq!(
            t.last_words(),
            "error: model.safetensors is truncated (exit status: 1)"
        );
    }
}
