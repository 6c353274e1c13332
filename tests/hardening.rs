//! A hostile or careless client, and a parent that dies at the wrong moment: every resource the
//! runner gives a request is bounded, and the runner keeps serving.

mod common;
use common::*;
use serde_json::json;
use std::time::{Duration, Instant};

/// A runner with short HTTP deadlines and a small connection cap, so that the bounds show in
/// seconds.
fn strict_runner() -> Runner {
    Runner::start(
        "gemma4_31b_like",
        &[
            "--http-header-timeout",
            "1",
            "--http-body-timeout",
            "2",
            "--max-connections",
            "8",
            "--ctx-size",
            "256",
        ],
    )
}

fn serving(r: &Runner) -> bool {
    let lines = r.complete(&json!({"Prompt": "Hi", "Options": {"num_predict": 2}}));
    done_of(&lines)["Done"] == true
}

#[test]
fn slow_and_silent_clients_are_cut_off() {
    let r = strict_runner();
    let t = Instant::now();
    // Connects and says nothing.
    let idle = raw_http(r.port, b"", Duration::from_secs(5));
    assert_eq!(idle.as_deref(), Some(""), "an idle socket was kept open");
    // Half a request head.
    let partial = raw_http(
        r.port,
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n",
        Duration::from_secs(5),
    );
    assert!(partial.is_some(), "a partial head was waited on forever");
    // A kept-alive connection that sends nothing after its first request.
    let kept = raw_http(
        r.port,
        b"GET /v1/status HTTP/1.1\r\nhost: x\r\n\r\n",
        Duration::from_secs(5),
    )
    .expect("an idle kept-alive connection was kept open");
    assert!(kept.starts_with("HTTP/1.1 200"), "{kept}");
    assert!(t.elapsed() < Duration::from_secs(10));
    // A body announced and never sent in full: 408 at the body deadline.
    let t = Instant::now();
    let partial_body = raw_http(
        r.port,
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{\"Prompt\":",
        Duration::from_secs(8),
    )
    .expect("a partial body was waited on forever");
    assert!(partial_body.starts_with("HTTP/1.1 408"), "{partial_body}");
    assert!(
        partial_body.contains("did not arrive within 2 s"),
        "{partial_body}"
    );
    assert!(t.elapsed() < Duration::from_secs(6));
    // A terabyte announced: refused at once, nothing read.
    let t = Instant::now();
    let huge = raw_http(
        r.port,
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 1099511627776\r\n\r\n",
        Duration::from_secs(5),
    )
    .expect("a 1 TB body was waited on");
    assert!(huge.starts_with("HTTP/1.1 413"), "{huge}");
    assert!(t.elapsed() < Duration::from_secs(1));
    assert!(serving(&r));
}

#[test]
fn at_the_connection_cap_silent_connections_give_way_and_the_runner_keeps_serving() {
    use std::io::{Read, Write};
    // A header deadline far past the test: only eviction closes a silent connection.
    let r = Runner::start(
        "gemma4_31b_like",
        &[
            "--http-header-timeout",
            "60",
            "--max-connections",
            "8",
            "--ctx-size",
            "256",
        ],
    );
    // Every slot taken by a connection that says nothing or half a request...
    let mut held: Vec<std::net::TcpStream> = (0..8)
        .map(|i| {
            let mut s = std::net::TcpStream::connect(("127.0.0.1", r.port)).unwrap();
            if i % 2 == 1 {
                s.write_all(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")
                    .unwrap();
            }
            s
        })
        .collect();
    std::thread::sleep(Duration::from_millis(200));
    // ... and a crowd of whole requests, each with another silent one before it: every whole
    // one is served at once, the oldest silent ones closed to make room.
    let t = Instant::now();
    for i in 0..100 {
        held.push(std::net::TcpStream::connect(("127.0.0.1", r.port)).unwrap());
        let answer = raw_http(
            r.port,
            b"GET /v1/status HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
            Duration::from_secs(5),
        )
        .unwrap_or_else(|| panic!("connection {i} hung"));
        assert!(answer.starts_with("HTTP/1.1 200"), "{i}: {answer}");
    }
    assert!(t.elapsed() < Duration::from_secs(10));
    // The first eight were the oldest that were not being served: closed, their slots reused.
    for mut s in held.drain(..8) {
        s.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
        let mut buf = [0u8; 16];
        assert_eq!(s.read(&mut buf).unwrap_or(0), 0, "a silent slot was kept");
    }
    drop(held);
    std::thread::sleep(Duration::from_millis(200));
    assert!(serving(&r));
}

/// A penalty window of two billion tokens is the context's, not two billion: the request is
/// served at once and the ones after it are as fast as before.
#[test]
fn a_huge_penalty_window_costs_no_more_than_the_context() {
    let r = Runner::start("gemma4_31b_like", &["--ctx-size", "256"]);
    let plain = json!({"Prompt": "Hello, world", "Options": {"num_predict": 8, "temperature": 0}});
    let t = Instant::now();
    r.complete(&plain);
    let before = t.elapsed();
    let t = Instant::now();
    let lines = r.complete(&json!({"Prompt": "Hello, world", "Options": {
        "num_predict": 8, "repeat_last_n": 2147483647, "repeat_penalty": 1.5}}));
    assert_eq!(done_of(&lines)["EvalCount"], 8);
    assert!(t.elapsed() < Duration::from_secs(30), "{:?}", t.elapsed());
    // Generous bound: ~490x slower was the defect.
    let t = Instant::now();
    r.complete(&plain);
    assert!(
        t.elapsed() < before * 10 + Duration::from_secs(2),
        "{:?} vs {before:?}",
        t.elapsed()
    );
}

/// A prompt that cannot fit is refused from its length alone, before tokenizing megabytes.
#[test]
fn a_huge_prompt_is_refused_without_tokenizing_it() {
    let r = Runner::start("gemma4_31b_like", &["--ctx-size", "256"]);
    let prompt = "All work and no play makes Jack a dull boy. ".repeat(600_000); // 26 MiB
    let body = json!({"Prompt": prompt}).to_string();
    let t = Instant::now();
    let (code, e) = r.post_raw("/v1/completions", &body);
    assert_eq!(code, 400);
    let msg = e.as_str().unwrap();
    assert!(
        msg.contains("cannot fit the context of 256 tokens"),
        "{msg}"
    );
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    // Concurrent large tokenizations run one at a time and the runner stays up, and what they
    // took (hundreds of MB of tokenizer state each) is handed back afterwards.
    let before = rss_mib(r.child.id());
    let big = "word ".repeat(400_000); // 2 MB
    let handles: Vec<_> = (0..4)
        .map(|_| {
            let url = r.url("/v1/tokenize");
            let big = big.clone();
            std::thread::spawn(move || {
                let ids: Vec<u32> = serde_json::from_str(
                    &ureq::post(&url)
                        .send_string(&big)
                        .unwrap()
                        .into_string()
                        .unwrap(),
                )
                .unwrap();
                ids.len()
            })
        })
        .collect();
    let counts: Vec<usize> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    assert!(
        counts.iter().all(|&c| c == counts[0] && c > 100_000),
        "{counts:?}"
    );
    std::thread::sleep(Duration::from_millis(500));
    let after = rss_mib(r.child.id());
    assert!(
        after < before + 100,
        "the runner holds {after} MiB after large tokenizations, {before} MiB before"
    );
    assert!(serving(&r));
}

fn rss_mib(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        .unwrap()
        / 1024
}

/// A parent that dies while the model is still loading takes the runner with it. The model's
/// weights file is a FIFO that nobody writes, so loading blocks for as long as the test wants.
#[test]
fn a_runner_orphaned_while_loading_exits() {
    let dir = fixture_without_weights("gemma4_31b_like");
    let fifo = std::ffi::CString::new(
        dir.path()
            .join("model.safetensors")
            .to_str()
            .unwrap()
            .as_bytes(),
    )
    .unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
    // The parent: a shell that starts the runner, reports its pid, and exits a moment later.
    let exe = env!("CARGO_BIN_EXE_mlx-runner");
    let script = format!(
        "\"{exe}\" runner --model \"{}\" --port {} 2>/dev/null & echo $!; sleep 1",
        dir.path().display(),
        free_port()
    );
    let out = std::process::Command::new("sh")
        .args(["-c", &script])
        .output()
        .unwrap();
    let pid: i32 = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
    let alive = || {
        // SAFETY: signal 0 only checks that the process exists.
        let exists = unsafe { libc::kill(pid, 0) } == 0;
        let zombie =
            std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| s.contains(") Z "));
        exists && !zombie
    };
    let t = Instant::now();
    while alive() && t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(100));
    }
    let gone = !alive();
    if !gone {
        // SAFETY: as above.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    assert!(gone, "the orphaned runner is still loading after 10 s");
}
