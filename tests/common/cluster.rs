//! Ranks of a split model on loopback, for the tests that run them: hostfiles, ring ports, and
//! the processes a run started.

use serde_json::{json, Value};
use std::net::TcpListener;
use std::path::{Path, PathBuf};

/// A hostfile of `ips` (one rank each), in its own directory: the path also names the run's
/// processes, which the tests look for.
pub fn hostfile(ips: &[&str]) -> (tempfile::TempDir, PathBuf) {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("hosts.json");
    let hosts: Vec<Value> = ips
        .iter()
        .map(|ip| json!({"ssh": "localhost", "ips": [ip]}))
        .collect();
    std::fs::write(&p, serde_json::to_vec(&hosts).unwrap()).unwrap();
    (d, p)
}

/// `ranks` ranks on 127.0.0.1.
pub fn local(ranks: usize) -> (tempfile::TempDir, PathBuf) {
    hostfile(&vec!["127.0.0.1"; ranks])
}

/// A first port with `n` free ones from it.
pub fn ring_port(n: u16) -> u16 {
    for _ in 0..200 {
        let base = super::free_port();
        if base <= u16::MAX - n
            && (base..base + n).all(|p| TcpListener::bind(("127.0.0.1", p)).is_ok())
        {
            return base;
        }
    }
    panic!("no {n} consecutive free ports");
}

/// The live processes (not zombies) whose command line names `hostfile` and holds `also`.
pub fn processes(hostfile: &Path, also: &str) -> Vec<u32> {
    let needle = hostfile.to_string_lossy().into_owned();
    let mut pids = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let cmd = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
        let state = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
        let zombie = state
            .rsplit(')')
            .next()
            .is_some_and(|s| s.trim_start().starts_with('Z'));
        if cmd.contains(&needle) && cmd.contains(also) && !zombie {
            pids.push(pid);
        }
    }
    pids
}

pub fn signal(pid: u32, sig: libc::c_int) {
    // SAFETY: a plain syscall.
    unsafe { libc::kill(pid as libc::pid_t, sig) };
}

/// Waits (at most 10 s) until no process names `hostfile`: a run's ranks have all ended.
pub fn none_left(hostfile: &Path) {
    let started = std::time::Instant::now();
    while !processes(hostfile, "").is_empty() {
        assert!(
            started.elapsed() < std::time::Duration::from_secs(10),
            "ranks left running: {:?}",
            processes(hostfile, "")
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}
