//! Running one model over several processes (ranks) with MLX's `ring` backend.
//!
//! The user names the ranks in a hostfile, `mlx.launch`'s format: a JSON list (or an object
//! with a `hosts` list), one `{"ssh": host, "ips": [addresses]}` per rank, rank 0 first. Rank 0
//! is the process the user (or a parent) starts; ranks the hostfile places on loopback
//! addresses it starts itself, as children that die with it; ranks elsewhere are started there
//! with `mlx-runner worker --hostfile FILE --rank N`. Each rank listens on one port per address,
//! counted up from `--ring-port` in hostfile order, as `mlx.launch` counts them.
//!
//! Rank 0 then shares the job (its command line, the model's content key, a seed) with every
//! rank; each checks its binary version and its copy of the model against it, and all agree
//! before anyone loads, and again after loading (docs/DISTRIBUTED.md).

use mlx::distributed::Group;
use mlx::Array;
use serde::{Deserialize, Serialize};
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::rc::Rc;
use std::sync::mpsc;
use std::time::Duration;

/// The ring port `mlx.launch` starts counting from.
pub const DEFAULT_RING_PORT: u16 = 32323;

#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Host {
    #[serde(default)]
    pub ssh: String,
    #[serde(default)]
    pub ips: Vec<String>,
}

impl Host {
    /// Whether the host is this machine by its addresses: every one is a loopback address.
    pub fn is_local(&self) -> bool {
        !self.ips.is_empty()
            && self
                .ips
                .iter()
                .all(|ip| ip.parse::<IpAddr>().is_ok_and(|a| a.is_loopback()))
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Hostfile {
    pub path: PathBuf,
    pub hosts: Vec<Host>,
}

impl Hostfile {
    pub fn read(path: &Path) -> Result<Hostfile, String> {
        let at = |m: String| format!("hostfile {}: {m}", path.display());
        let text = std::fs::read_to_string(path).map_err(|e| at(e.to_string()))?;
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Form {
            List(Vec<Host>),
            Object { hosts: Vec<Host> },
        }
        let hosts = match serde_json::from_str::<Form>(&text).map_err(|e| {
            at(format!(
                "{e} (expected a list of {{\"ssh\": host, \"ips\": [addresses]}}, one per rank)"
            ))
        })? {
            Form::List(h) | Form::Object { hosts: h } => h,
        };
        if hosts.is_empty() {
            return Err(at("names no ranks".into()));
        }
        for (rank, h) in hosts.iter().enumerate() {
            if h.ips.is_empty() {
                return Err(at(format!(
                    "rank {rank} ({}) has no \"ips\": the ring backend connects to addresses",
                    h.ssh
                )));
            }
            if let Some(bad) = h.ips.iter().find(|ip| ip.parse::<IpAddr>().is_err()) {
                return Err(at(format!("rank {rank}: {bad:?} is not an IP address")));
            }
        }
        let path = path.canonicalize().map_err(|e| at(e.to_string()))?;
        Ok(Hostfile { path, hosts })
    }

    /// Each rank's listening addresses for MLX's ring backend (`ip:port`), ports counted up
    /// from `port` over every rank's addresses in order.
    pub fn ring_nodes(&self, port: u16) -> Result<Vec<Vec<String>>, String> {
        let mut next = u32::from(port);
        let mut out = Vec::with_capacity(self.hosts.len());
        for h in &self.hosts {
            let mut node = Vec::with_capacity(h.ips.len());
            for ip in &h.ips {
                if next > u32::from(u16::MAX) {
                    return Err(format!("ring ports from {port} run past 65535"));
                }
                node.push(match ip.parse::<IpAddr>() {
                    Ok(IpAddr::V6(_)) => format!("[{ip}]:{next}"),
                    _ => format!("{ip}:{next}"),
                });
                next += 1;
            }
            out.push(node);
        }
        Ok(out)
    }
}

/// How this process joins.
#[derive(Debug, Clone)]
pub struct JoinOptions {
    pub hostfile: PathBuf,
    pub rank: usize,
    pub ring_port: u16,
    /// How long the ring may take to form before this rank gives up with an error.
    pub timeout: Duration,
    /// Rank 0: give each rank on this machine its own share of the CPUs ([`pin_shares`]).
    pub pin: bool,
}

impl JoinOptions {
    /// The command line of a rank rank 0 starts on this machine.
    pub fn worker_argv(&self, rank: usize) -> Vec<String> {
        vec![
            "worker".into(),
            "--hostfile".into(),
            self.hostfile.display().to_string(),
            "--rank".into(),
            rank.to_string(),
            "--ring-port".into(),
            self.ring_port.to_string(),
            "--join-timeout".into(),
            self.timeout.as_secs_f64().to_string(),
        ]
    }
}

/// What rank 0 tells every rank before anything is loaded.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Job {
    /// Rank 0's `mlx-runner` version: every rank must run the same.
    pub version: String,
    /// Rank 0's command line: every rank runs the same command.
    pub argv: Vec<String>,
    /// Rank 0's model's content key ([`models::ModelFiles::content_key`]).
    pub model: String,
    /// The seed of every rank's sampler where the request gives none: ranks that sample
    /// must draw the same tokens.
    pub seed: u64,
    /// The content key of the draft model rank 0 names, where the other ranks load a part of
    /// it (the gemma4 assistant's layers): each must hold the same.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub draft: Option<String>,
}

impl Job {
    /// This process's job as rank 0: its version and command line, and `files`' content key.
    pub fn of(
        argv: Vec<String>,
        files: &base::files::ModelFiles,
        seed: u64,
    ) -> Result<Job, String> {
        Ok(Job {
            version: env!("CARGO_PKG_VERSION").into(),
            argv,
            model: files
                .content_key()
                .map_err(|e| format!("reading the model's files: {e}"))?,
            seed,
            draft: None,
        })
    }
}

/// This process's place among the ranks.
pub struct Cluster {
    pub group: Rc<Group>,
    local: Local,
    watchdog: Watchdog,
}

/// The ranks rank 0 started on this machine.
struct Local {
    children: Vec<(usize, Child)>,
    /// Which CPUs each rank on this machine was given ("rank 0 on CPUs 0-7, rank 1 on CPUs
    /// 8-15"), where rank 0 pinned them.
    pinned: Option<String>,
}

/// A file removed when this goes: MLX's ring hostfile, which its init reads once.
struct TempFile(PathBuf);

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

impl Cluster {
    /// Which CPUs each rank on this machine runs on, where rank 0 gave them their own.
    pub fn pinned(&self) -> Option<&str> {
        self.local.pinned.as_deref()
    }

    /// Joins the ranks of `opts.hostfile` as `opts.rank`, rank 0 first starting the ranks on
    /// this machine as children (`worker_args` is what each runs after the executable path,
    /// given its rank). Ends the process with one line on stderr if the ring does not form
    /// within `opts.timeout`: MLX's ring waits for its peers for ever.
    pub fn join(
        opts: &JoinOptions,
        worker_args: impl Fn(usize) -> Vec<String>,
    ) -> Result<Cluster, String> {
        if !mlx::distributed::is_available("ring") {
            return Err("this MLX was built without the ring backend".into());
        }
        let hostfile = Hostfile::read(&opts.hostfile)?;
        let size = hostfile.hosts.len();
        if opts.rank >= size {
            return Err(format!(
                "rank {} is not among the {size} ranks of {}",
                opts.rank,
                hostfile.path.display()
            ));
        }
        let nodes = hostfile.ring_nodes(opts.ring_port)?;
        let ring_file = TempFile(std::env::temp_dir().join(format!(
            "mlx-runner-ring-{}-{}.json",
            std::process::id(),
            opts.rank
        )));
        std::fs::write(
            &ring_file.0,
            serde_json::to_vec(&nodes).map_err(|e| e.to_string())?,
        )
        .map_err(|e| format!("writing {}: {e}", ring_file.0.display()))?;
        // MLX's ring backend reads its place from the environment, once, in its init; nothing
        // else of ours reads these variables.
        std::env::set_var("MLX_HOSTFILE", &ring_file.0);
        std::env::set_var("MLX_RANK", opts.rank.to_string());
        let mut local = Local {
            children: Vec::new(),
            pinned: None,
        };
        if opts.rank == 0 {
            let here: Vec<usize> = (1..size)
                .filter(|&r| hostfile.hosts[r].is_local())
                .collect();
            let shares = if opts.pin && !here.is_empty() {
                pin_shares(here.len() + 1)
            } else {
                None
            };
            for (i, &rank) in here.iter().enumerate() {
                let cpus = shares.as_ref().map(|s| cpu_set(&s[i + 1]));
                local
                    .children
                    .push((rank, spawn_worker(&worker_args(rank), cpus)?));
            }
            if let Some(shares) = &shares {
                // Pinning only speeds the ranks up: where it fails they run as they are.
                if let Err(e) = pin_self(&shares[0]) {
                    tracing::warn!("{e}");
                }
                let pinned = std::iter::once(0)
                    .chain(here.iter().copied())
                    .zip(shares)
                    .map(|(r, cpus)| format!("rank {r} on CPUs {}", cpu_list(cpus)))
                    .collect::<Vec<_>>()
                    .join(", ");
                tracing::info!("ranks on this machine: {pinned}");
                local.pinned = Some(pinned);
            }
        }
        let watchdog = Watchdog::start(
            opts.timeout,
            join_failure(opts.timeout, opts.rank, &hostfile),
            Some(ring_file.0.clone()),
        );
        let group = Group::init("ring").map_err(|e| format!("joining the ring: {e}"))?;
        watchdog.send(Tick::Phase(None));
        drop(ring_file);
        if group.size() != size {
            return Err(format!(
                "MLX formed a group of {} ranks from a hostfile of {size}",
                group.size()
            ));
        }
        Ok(Cluster {
            group: Rc::new(group),
            local,
            watchdog,
        })
    }

    /// Joins as rank 0 (starting the ranks on this machine) and shares `job`; returns once
    /// every rank has checked its version and its model against it (the other side of
    /// [`Job`]'s checks is the worker's).
    pub fn lead(opts: &JoinOptions, job: &Job) -> Result<Cluster, String> {
        let cluster = Cluster::join(opts, |r| opts.worker_argv(r))?;
        // Sharing the job and checking it is part of joining.
        cluster.watch(Some(opts.timeout), "joining");
        cluster.share(Some(&serde_json::to_vec(job).map_err(|e| e.to_string())?))?;
        cluster.agree("joining", Ok(()))?;
        cluster.agree("checking the model", Ok(()))?;
        Ok(cluster)
    }

    pub fn rank(&self) -> usize {
        self.group.rank()
    }

    /// Ends the process with one line if, from now on, `limit` passes without a
    /// [`Cluster::progress`] (`None`: no limit, for work whose length no one can bound, such
    /// as loading); `what` says what the ranks were doing.
    pub fn watch(&self, limit: Option<Duration>, what: &str) {
        self.watchdog.send(Tick::Phase(limit.map(|l| {
            let message = format!(
                "rank {}: {what}: no answer from the other ranks within {} s",
                self.rank(),
                l.as_secs_f64()
            );
            (l, message)
        })));
    }

    /// Progress in the watched phase: its time starts again.
    pub fn progress(&self) {
        self.watchdog.send(Tick::Beat);
    }

    pub fn size(&self) -> usize {
        self.group.size()
    }

    /// Rank 0's `bytes` on every rank (the others pass `None`).
    pub fn share(&self, bytes: Option<&[u8]>) -> Result<Vec<u8>, String> {
        let e = |e: mlx::Error| format!("sharing the job between ranks: {e}");
        let len = bytes.map_or(0, <[u8]>::len) as i32;
        let len: i32 = self
            .group
            .broadcast(&Array::from_slice(&[len], &[1]).map_err(e)?, 0)
            .and_then(|a| a.item())
            .map_err(e)?;
        match bytes {
            Some(b) => self.broadcast_bytes(b),
            None => self.broadcast_bytes(&vec![0u8; len.max(0) as usize]),
        }
    }

    /// Rank 0's `bytes` on every rank (the others pass as many bytes, whose values are
    /// ignored): one collective, evaluated here.
    pub fn broadcast_bytes(&self, bytes: &[u8]) -> Result<Vec<u8>, String> {
        let e = |e: mlx::Error| format!("broadcasting between ranks: {e}");
        let a = Array::from_slice(bytes, &[bytes.len() as i32]).map_err(e)?;
        let out = self.broadcast(&a)?;
        out.to_vec::<u8>().map_err(e)
    }

    /// Rank 0's `x` on every rank (the others pass an array of the same shape and dtype),
    /// evaluated here. MLX's ring records a lost peer as an error of the stream rather than of
    /// the evaluation that met it; it is raised here, not left to surface later (or never,
    /// when the next collective waits on the dead connection).
    pub fn broadcast(&self, x: &Array) -> Result<Array, String> {
        let e = |e: mlx::Error| format!("broadcasting between ranks: {e}");
        let out = self.group.broadcast(x, 0).map_err(e)?;
        out.eval().map_err(e)?;
        mlx::synchronize().map_err(e)?;
        Ok(out)
    }

    /// Every rank's verdict on `what`, on every rank: `Ok` where all are, else an error naming
    /// the first rank that failed and why.
    pub fn agree(&self, what: &str, verdict: Result<(), String>) -> Result<(), String> {
        const WIDTH: usize = 512;
        let mut line = vec![0u8; WIDTH];
        if let Err(m) = &verdict {
            line[0] = 1;
            let m = m.as_bytes();
            let n = m.len().min(WIDTH - 1);
            line[1..1 + n].copy_from_slice(&m[..n]);
        }
        let e = |e: mlx::Error| format!("{what}: the ranks could not compare: {e}");
        let all = self
            .group
            .all_gather(&Array::from_slice(&line, &[1, WIDTH as i32]).map_err(e)?)
            .and_then(|a| a.to_vec::<u8>())
            .map_err(e)?;
        for (rank, l) in all.chunks(WIDTH).enumerate() {
            if l[0] != 0 {
                let text = String::from_utf8_lossy(&l[1..]);
                return Err(format!(
                    "{what}: rank {rank}: {}",
                    text.trim_end_matches('\0')
                ));
            }
        }
        Ok(())
    }

    /// This rank's part of the model in `files` (split as `mode` and `ends` say), once every
    /// rank has loaded its own, and what each rank holds. A load error anywhere is an error on
    /// every rank, naming the rank.
    pub fn load_stage(
        &self,
        files: &base::files::ModelFiles,
        dtype: models::DtypeChoice,
        ends: models::parallel::Ends,
        mode: models::parallel::Mode,
    ) -> Result<(models::LoadedModel, Vec<Held>), String> {
        // Loading takes as long as the slowest rank's disk: not watched.
        self.watch(None, "loading");
        let loaded = models::load_files_stage(files, dtype, self.group.clone(), ends, mode);
        self.agree(
            "loading the model",
            loaded.as_ref().map(|_| ()).map_err(|e| e.to_string()),
        )?;
        let loaded = loaded.map_err(|e| e.to_string())?;
        let layers = loaded.layers.clone().unwrap_or(0..0);
        let all = self.gather(&[
            layers.start as i64,
            layers.end as i64,
            mlx::memory::active() as i64,
        ])?;
        let held = all
            .iter()
            .map(|r| Held {
                layers: r[0].max(0) as usize..r[1].max(0) as usize,
                weights: r[2].max(0) as usize,
            })
            .collect();
        Ok((loaded, held))
    }

    /// Every rank's `values` (the same count on each), by rank, on every rank.
    pub fn gather(&self, values: &[i64]) -> Result<Vec<Vec<i64>>, String> {
        let e = |e: mlx::Error| format!("gathering from the ranks: {e}");
        let n = values.len();
        let all = self
            .group
            .all_gather(&Array::from_slice(values, &[1, n as i32]).map_err(e)?)
            .and_then(|a| a.to_vec::<i64>())
            .map_err(e)?;
        // A lost peer is an error of the stream (see `broadcast`).
        mlx::synchronize().map_err(e)?;
        Ok(all.chunks(n.max(1)).map(<[i64]>::to_vec).collect())
    }

    /// Waits for the ranks rank 0 started to exit (they finish with it), at most `limit`;
    /// any still running then is killed. The error is the first that did not exit cleanly.
    pub fn finish(mut self, limit: Duration) -> Result<(), RankExit> {
        let deadline = std::time::Instant::now() + limit;
        let mut failed = None;
        for (rank, child) in &mut self.local.children {
            loop {
                match child.try_wait() {
                    Ok(Some(status)) => {
                        if !status.success() && failed.is_none() {
                            use std::os::unix::process::ExitStatusExt;
                            failed = Some(RankExit {
                                message: format!("rank {rank} exited with {status}"),
                                killed: status.signal().is_some(),
                            });
                        }
                        break;
                    }
                    Ok(None) if std::time::Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(20))
                    }
                    _ => {
                        let _ = child.kill();
                        let _ = child.wait();
                        failed.get_or_insert(RankExit {
                            message: format!("rank {rank} did not finish; stopped"),
                            killed: true,
                        });
                        break;
                    }
                }
            }
        }
        self.local.children.clear();
        failed.map_or(Ok(()), Err)
    }
}

/// What a rank of a split model holds.
#[derive(Debug, Clone, PartialEq)]
pub struct Held {
    pub layers: std::ops::Range<usize>,
    /// Bytes its weights take.
    pub weights: usize,
}

/// How a rank rank 0 started ended, where it did not end cleanly.
#[derive(Debug)]
pub struct RankExit {
    pub message: String,
    /// By a signal, or stopped for not finishing: not a reaction to an error rank 0 also saw.
    pub killed: bool,
}

impl Drop for Local {
    fn drop(&mut self) {
        // Ranks told to stop get a moment to end by themselves.
        let deadline = std::time::Instant::now() + Duration::from_secs(2);
        for (_, child) in &mut self.children {
            while std::time::Instant::now() < deadline && matches!(child.try_wait(), Ok(None)) {
                std::thread::sleep(Duration::from_millis(10));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The CPUs this process may run on, in order.
fn allowed_cpus() -> Vec<usize> {
    // SAFETY: a zeroed cpu_set_t is an empty set, which sched_getaffinity fills; CPU_ISSET
    // reads within it for every index below CPU_SETSIZE.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    let size = std::mem::size_of::<libc::cpu_set_t>();
    if unsafe { libc::sched_getaffinity(0, size, &mut set) } != 0 {
        return Vec::new();
    }
    (0..libc::CPU_SETSIZE as usize)
        .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
        .collect()
}

/// The physical core (package, core) `cpu` is a hardware thread of, where Linux says.
fn core_of(cpu: usize) -> Option<(String, String)> {
    let dir = format!("/sys/devices/system/cpu/cpu{cpu}/topology");
    let read = |f: &str| std::fs::read_to_string(format!("{dir}/{f}")).ok();
    Some((read("physical_package_id")?, read("core_id")?))
}

/// This process's CPUs cut into `ranks` shares as even as they go, or `None` where there are
/// fewer CPUs than ranks.
///
/// Ranks on one machine left to the scheduler take each other's cores: a rank waiting on the
/// ring polls its sockets, and each rank's kernels start a thread per CPU it may use, so a rank
/// computing runs beside its peers' spinning threads (docs/DISTRIBUTED.md, "Ranks on one
/// machine", measures it). A share is whole physical cores where there are enough of them (a
/// core's hardware threads share its caches and units, and Linux often numbers a core's two
/// threads far apart), else single CPUs.
pub fn pin_shares(ranks: usize) -> Option<Vec<Vec<usize>>> {
    let cpus = allowed_cpus();
    let single: Vec<Vec<usize>> = cpus.iter().map(|&c| vec![c]).collect();
    let mut cores: Vec<((String, String), Vec<usize>)> = Vec::new();
    for &c in &cpus {
        let Some(key) = core_of(c) else {
            return shares(&single, ranks);
        };
        match cores.iter_mut().find(|(k, _)| *k == key) {
            Some((_, threads)) => threads.push(c),
            None => cores.push((key, vec![c])),
        }
    }
    let cores: Vec<Vec<usize>> = cores.into_iter().map(|(_, t)| t).collect();
    shares(&cores, ranks).or_else(|| shares(&single, ranks))
}

/// `units` (cores, each a list of CPUs) cut into `ranks` contiguous shares as even as they go
/// (the first ones a unit larger where they do not divide), each share its units' CPUs in
/// order; `None` where there are fewer units than ranks.
fn shares(units: &[Vec<usize>], ranks: usize) -> Option<Vec<Vec<usize>>> {
    if ranks == 0 || units.len() < ranks {
        return None;
    }
    let (each, extra) = (units.len() / ranks, units.len() % ranks);
    let mut at = 0;
    Some(
        (0..ranks)
            .map(|r| {
                let n = each + usize::from(r < extra);
                at += n;
                let mut cpus: Vec<usize> = units[at - n..at].concat();
                cpus.sort_unstable();
                cpus
            })
            .collect(),
    )
}

fn cpu_set(cpus: &[usize]) -> libc::cpu_set_t {
    // SAFETY: a zeroed cpu_set_t is an empty set; CPU_SET writes within it for indices below
    // CPU_SETSIZE, which every CPU sched_getaffinity reported is.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &c in cpus {
        unsafe { libc::CPU_SET(c, &mut set) };
    }
    set
}

/// "0-3,8" for [0, 1, 2, 3, 8].
fn cpu_list(cpus: &[usize]) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut i = 0;
    while i < cpus.len() {
        let mut j = i;
        while j + 1 < cpus.len() && cpus[j + 1] == cpus[j] + 1 {
            j += 1;
        }
        parts.push(if i == j {
            cpus[i].to_string()
        } else {
            format!("{}-{}", cpus[i], cpus[j])
        });
        i = j + 1;
    }
    parts.join(",")
}

/// Pins every thread this process has to `cpus` (threads started later inherit it from the
/// thread that starts them), and tells OpenBLAS, which counted the CPUs when it loaded.
fn pin_self(cpus: &[usize]) -> Result<(), String> {
    let set = cpu_set(cpus);
    let size = std::mem::size_of::<libc::cpu_set_t>();
    let tasks = std::fs::read_dir("/proc/self/task")
        .map_err(|e| format!("listing this process's threads: {e}"))?;
    for t in tasks.flatten() {
        let Some(tid) = t
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<libc::pid_t>().ok())
        else {
            continue;
        };
        // SAFETY: sched_setaffinity reads `size` bytes of `set`. A thread that ended since
        // the listing is no error.
        if unsafe { libc::sched_setaffinity(tid, size, &set) } != 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::ESRCH) {
                return Err(format!("pinning this rank to CPUs {}: {e}", cpu_list(cpus)));
            }
        }
    }
    mlx::set_blas_threads(cpus.len());
    Ok(())
}

/// Starts this executable with `args` as a rank on this machine, on `cpus` where given. It is
/// killed when this process dies, however it dies, so no rank outlives rank 0.
fn spawn_worker(args: &[String], cpus: Option<libc::cpu_set_t>) -> Result<Child, String> {
    use std::os::unix::process::CommandExt;
    let exe = std::env::current_exe().map_err(|e| format!("finding this executable: {e}"))?;
    let parent = std::process::id() as libc::pid_t;
    let mut cmd = Command::new(&exe);
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .env_remove("MLX_HOSTFILE")
        .env_remove("MLX_RANK");
    // SAFETY: prctl, sched_setaffinity and getppid are raw system calls (not on POSIX's list
    // of async-signal-safe functions, but they take no locks and allocate nothing); nothing is
    // allocated between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The affinity holds across exec: the worker's kernels and OpenBLAS count these.
            // Where it cannot be set the worker runs unpinned.
            if let Some(set) = &cpus {
                libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), set);
            }
            // The parent may have died before the line above took effect.
            if libc::getppid() != parent {
                libc::_exit(1);
            }
            Ok(())
        });
    }
    cmd.spawn()
        .map_err(|e| format!("starting {}: {e}", exe.display()))
}

/// This process's peak resident memory in bytes (`VmHWM`), 0 where unknown.
pub fn peak_resident() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// Ends the process with one line on stderr when a phase it watches takes too long: MLX's
/// collectives wait for a peer that stalls as long as it takes, and after a peer's connection
/// fails once, every later collective on it waits for ever.
struct Watchdog {
    ticks: mpsc::Sender<Tick>,
    thread: Option<std::thread::JoinHandle<()>>,
}

enum Tick {
    /// Progress: the current phase's time starts again.
    Beat,
    /// A new phase: its time limit and what to say if it runs out (`None`: not watched).
    Phase(Option<(Duration, String)>),
}

impl Watchdog {
    /// Watches a first phase of `limit`; `leftover` is a file to remove if it ends the process.
    fn start(limit: Duration, message: String, leftover: Option<PathBuf>) -> Watchdog {
        let (ticks, rx) = mpsc::channel::<Tick>();
        let thread = std::thread::spawn(move || {
            let mut phase = Some((limit, message));
            loop {
                let tick = match &phase {
                    Some((limit, _)) => rx.recv_timeout(*limit),
                    None => rx.recv().map_err(|_| mpsc::RecvTimeoutError::Disconnected),
                };
                match tick {
                    Ok(Tick::Beat) => {}
                    Ok(Tick::Phase(p)) => phase = p,
                    Err(mpsc::RecvTimeoutError::Disconnected) => return,
                    Err(mpsc::RecvTimeoutError::Timeout) => {
                        let message = phase.as_ref().map_or("", |(_, m)| m.as_str());
                        eprintln!("error: {message}");
                        if let Some(f) = &leftover {
                            let _ = std::fs::remove_file(f);
                        }
                        // Children die with us (PR_SET_PDEATHSIG).
                        // SAFETY: ends the process; the MLX thread is blocked on a peer.
                        unsafe { libc::_exit(1) };
                    }
                }
            }
        });
        Watchdog {
            ticks,
            thread: Some(thread),
        }
    }

    fn send(&self, tick: Tick) {
        let _ = self.ticks.send(tick);
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        // Closing the channel ends the thread.
        let (closed, _) = mpsc::channel();
        drop(std::mem::replace(&mut self.ticks, closed));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Why the ring did not form, for [`Cluster::join`]'s watchdog.
fn join_failure(limit: Duration, rank: usize, hostfile: &Hostfile) -> String {
    let remote: Vec<String> = hostfile
        .hosts
        .iter()
        .enumerate()
        .filter(|(r, h)| *r != rank && !h.is_local())
        .map(|(r, h)| format!("{r} ({})", h.ips.join(", ")))
        .collect();
    let hint = if remote.is_empty() {
        String::new()
    } else {
        format!(
            "; ranks on other hosts ({}) are started there with `mlx-runner worker --hostfile {} --rank N`",
            remote.join(", "),
            hostfile.path.display()
        )
    };
    format!(
        "rank {rank}: the ring of {} ranks did not form within {:.0} s{hint}",
        hostfile.hosts.len(),
        limit.as_secs_f64()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(text: &str) -> (tempfile::TempDir, PathBuf) {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("hosts.json");
        std::fs::write(&p, text).unwrap();
        (d, p)
    }

    #[test]
    fn local_ranks_share_the_cpus_out_evenly() {
        let single = |cpus: &[usize]| cpus.iter().map(|&c| vec![c]).collect::<Vec<_>>();
        assert_eq!(
            shares(&single(&[0, 1, 2, 3, 4, 5, 6, 7]), 3).unwrap(),
            vec![vec![0, 1, 2], vec![3, 4, 5], vec![6, 7]]
        );
        assert_eq!(shares(&single(&[4, 5]), 2).unwrap(), vec![vec![4], vec![5]]);
        // Fewer CPUs than ranks: nothing pinned.
        assert_eq!(shares(&single(&[0, 1]), 3), None);
        // Four cores of two threads numbered n and n + 4: each rank gets whole cores.
        let cores = [vec![0, 4], vec![1, 5], vec![2, 6], vec![3, 7]];
        assert_eq!(
            shares(&cores, 2).unwrap(),
            vec![vec![0, 1, 4, 5], vec![2, 3, 6, 7]]
        );
        assert_eq!(cpu_list(&[0, 1, 2, 3, 8, 10, 11]), "0-3,8,10-11");
    }

    #[test]
    fn hostfiles_in_both_of_mlx_launch_forms() {
        let (_d, p) = write(
            r#"[{"ssh": "a", "ips": ["127.0.0.1"]}, {"ssh": "b", "ips": ["10.0.0.2", "10.0.1.2"]}]"#,
        );
        let h = Hostfile::read(&p).unwrap();
        assert!(h.hosts[0].is_local() && !h.hosts[1].is_local());
        assert_eq!(
            h.ring_nodes(5000).unwrap(),
            vec![
                vec!["127.0.0.1:5000".to_string()],
                vec!["10.0.0.2:5001".to_string(), "10.0.1.2:5002".to_string()]
            ]
        );
        let (_d, p) = write(r#"{"backend": "ring", "hosts": [{"ssh": "x", "ips": ["::1"]}]}"#);
        let h = Hostfile::read(&p).unwrap();
        assert!(h.hosts[0].is_local());
        assert_eq!(h.ring_nodes(7).unwrap(), vec![vec!["[::1]:7".to_string()]]);
    }

    #[test]
    fn bad_hostfiles_say_what_is_wrong() {
        for (text, says) in [
            ("[]", "names no ranks"),
            (r#"[{"ssh": "a"}]"#, "rank 0 (a) has no \"ips\""),
            (
                r#"[{"ssh": "a", "ips": ["host-a"]}]"#,
                "\"host-a\" is not an IP address",
            ),
            ("{", "expected a list of"),
        ] {
            let (_d, p) = write(text);
            let e = Hostfile::read(&p).unwrap_err();
            assert!(e.contains(says), "{text}: {e}");
        }
        let (_d, p) = write(r#"[{"ips": ["127.0.0.1"]}, {"ips": ["127.0.0.1"]}]"#);
        let e = Hostfile::read(&p).unwrap().ring_nodes(65535).unwrap_err();
        assert!(e.contains("past 65535"), "{e}");
    }
}
