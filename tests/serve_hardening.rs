//! `serve` against a hostile page, a careless user and a flaky runner: no request can freeze
//! it, crash a runner or lock clients out. Each case runs the real binary over loopback, is
//! bounded in time, and ends with serve answering `/api/tags` and no process left behind.

mod common;

use common::serve::{children_of, subcommand, Serve};
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Write};
use std::time::{Duration, Instant};

fn generate(template: &str, prompt: &str) -> Value {
    json!({"model": "gem", "prompt": prompt, "template": template, "stream": false,
        "options": {"num_predict": 2, "temperature": 0}})
}

/// `/api/tags` answers within a second.
fn answers_tags(s: &Serve) -> bool {
    let t = Instant::now();
    let r = ureq::get(&s.url("/api/tags"))
        .timeout(Duration::from_secs(1))
        .call();
    let ok = matches!(&r, Ok(r) if r.status() == 200);
    if !ok || t.elapsed() >= Duration::from_secs(1) {
        eprintln!(
            "/api/tags: {:?} after {:?}",
            r.map(|r| r.status()),
            t.elapsed()
        );
    }
    ok && t.elapsed() < Duration::from_secs(1)
}

/// These tests measure latency (`/api/tags` within a second) while loading the machine on
/// purpose: each runs alone, not beside another's bombs.
static QUIET: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn quiet() -> std::sync::MutexGuard<'static, ()> {
    QUIET.lock().unwrap_or_else(|e| e.into_inner())
}

fn error_of(v: &Value) -> String {
    v["error"]
        .as_str()
        .map(String::from)
        .unwrap_or_else(|| v.to_string())
}

/// Stops serve and checks that every process it started (runners, renderers) is gone.
fn stop_leaving_nothing(s: Serve) {
    let children = children_of(s.child.id());
    drop(s);
    let deadline = Instant::now() + Duration::from_secs(10);
    for pid in children {
        while alive(pid) {
            assert!(Instant::now() < deadline, "process {pid} outlived serve");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .is_ok_and(|s| !s[s.rfind(')').unwrap() + 2..].starts_with('Z'))
}

fn rss_mib(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kib: u64 = s
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap();
    kib / 1024
}

#[test]
fn template_bombs_are_refused_while_serve_keeps_answering() {
    let _quiet = quiet();
    let s = Serve::start(&[]);
    let bombs = [
        (
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
            "steps",
        ),
        (
            "{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(40) }}",
            "nests deeper",
        ),
        (
            "{% for i in range(100000) %}{{ 'x' * 10000 }}{% endfor %}",
            "larger than",
        ),
        (
            "{% set ns = namespace(s='x' * 50000000) %}{% for i in range(30) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}",
            "MiB of memory",
        ),
        // Quadratic copying: few steps, little memory at first, no end in sight. Its copies
        // reach the memory bound at about the time the clock bound ends it (which comes first
        // depends on the machine's speed): either refusal is right.
        (
            "{% set ns = namespace(s='') %}{% for i in range(60000) %}{% set ns.s = ns.s ~ ('y' * 4000) %}{% endfor %}{{ ns.s | length }}",
            "longer than|MiB of memory",
        ),
    ];
    let t = Instant::now();
    let running: Vec<_> = bombs
        .iter()
        .map(|&(tmpl, why)| {
            let url = s.url("/api/generate");
            let body = generate(tmpl, "hi").to_string();
            std::thread::spawn(move || {
                let r = ureq::post(&url).send_string(&body);
                let (code, text) = match r {
                    Ok(r) => (r.status(), r.into_string().unwrap()),
                    Err(ureq::Error::Status(c, r)) => (c, r.into_string().unwrap()),
                    Err(e) => panic!("{e}"),
                };
                (code, text, why)
            })
        })
        .collect();
    // While they run (four renderers busy, one waiting), serve answers.
    for _ in 0..5 {
        std::thread::sleep(Duration::from_millis(200));
        assert!(answers_tags(&s), "serve froze under template bombs");
    }
    for r in running {
        let (code, text, why) = r.join().unwrap();
        assert_eq!(code, 400, "{text}");
        assert!(why.split('|').any(|w| text.contains(w)), "{why}: {text}");
    }
    // The slowest is stopped by the render time bound, not left running.
    assert!(t.elapsed() < Duration::from_secs(20), "{:?}", t.elapsed());

    // A stored template is rendered under the same bounds on every chat.
    let (code, v) = s.post(
        "/api/create",
        &json!({"model": "bomb", "from": "gem",
            "template": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"}),
    );
    assert_eq!(code, 200, "{v}");
    for _ in 0..2 {
        let (code, v) = s.post(
            "/api/chat",
            &json!({"model": "bomb", "messages": [{"role": "user", "content": "hi"}], "stream": false}),
        );
        assert_eq!(code, 400, "{v}");
        assert!(error_of(&v).contains("steps"), "{v}");
        assert!(answers_tags(&s));
    }
    // One that cannot parse is not stored.
    let (code, v) = s.post(
        "/api/create",
        &json!({"model": "broken", "from": "gem", "template": "{% for %}"}),
    );
    assert_eq!(code, 400, "{v}");
    assert!(error_of(&v).contains("does not parse"), "{v}");

    let (code, v) = s.post(
        "/api/generate",
        &generate("{{ messages[0].content }}", "Hello"),
    );
    assert_eq!(code, 200, "{v}");
    stop_leaving_nothing(s);
}

#[test]
fn template_errors_and_oversized_prompts_are_client_errors() {
    let _quiet = quiet();
    let s = Serve::start(&[]);
    for (tmpl, why) in [
        ("{{ foo.bar.baz }}", "undefined value"),
        ("{% for %}", "does not parse"),
        (
            "{{ raise_exception('no system role here') }}",
            "no system role here",
        ),
    ] {
        let (code, v) = s.post("/api/generate", &generate(tmpl, "hi"));
        assert_eq!(code, 400, "{tmpl}: {v}");
        assert!(error_of(&v).contains(why), "{tmpl}: {v}");
    }
    // A 3 MB message rendered 40 times: a 120 MB prompt.
    let before = rss_mib(s.child.id());
    let big = "y".repeat(3 << 20);
    let (code, v) = s.post(
        "/api/generate",
        &generate(
            "{% for i in range(40) %}{{ messages[0].content }}{% endfor %}",
            &big,
        ),
    );
    assert_eq!(code, 400, "{v}");
    assert!(error_of(&v).contains("larger than"), "{v}");
    // A 30 MiB prompt: refused, and its memory handed back.
    let huge = "z ".repeat(15 << 20);
    let (code, v) = s.post(
        "/api/generate",
        &json!({"model": "gem", "prompt": huge, "raw": true, "stream": false}),
    );
    assert_eq!(code, 400, "{v}");
    std::thread::sleep(Duration::from_millis(300));
    let after = rss_mib(s.child.id());
    assert!(
        after < before + 100,
        "serve holds {after} MiB after large requests, {before} MiB before"
    );
    stop_leaving_nothing(s);
}

fn props(n: usize) -> Value {
    let p: serde_json::Map<String, Value> = (0..n)
        .map(|i| (format!("p{i}"), json!({"type": "string", "maxLength": 3})))
        .collect();
    json!({"type": "object", "properties": p})
}

#[test]
fn format_bombs_are_refused_and_the_runner_survives() {
    let _quiet = quiet();
    let s = Serve::start(&[]);
    let chat = |format: &Value, n: i64| {
        json!({"model": "gem", "messages": [{"role": "user", "content": "A person:"}],
            "format": format, "stream": false, "think": false,
            "options": {"num_predict": n, "temperature": 0}})
    };
    let (code, v) = s.post("/api/chat", &chat(&json!("json"), 2));
    assert_eq!(code, 200, "{v}");
    let runner = s.runners();
    assert_eq!(runner.len(), 1);
    // A stream in flight on the same model while the bombs land.
    let stream = ureq::post(&s.url("/api/chat"))
        .send_string(
            &json!({"model": "gem", "messages": [{"role": "user", "content": "Hi"}],
                "options": {"num_predict": 200, "temperature": 0}})
            .to_string(),
        )
        .unwrap();
    let mut stream = BufReader::new(stream.into_reader()).lines();
    let _first = stream.next().unwrap().unwrap();
    let deep = (0..40).fold(
        json!({"type": "string"}),
        |inner, _| json!({"type": "object", "properties": {"a": inner}}),
    );
    let cycle = json!({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
        "$ref": "#/$defs/a"});
    let one_mb = json!({"type": "object", "properties": {"a": {"type": "string",
        "description": "d".repeat(1 << 20)}}});
    for (format, why) in [
        (props(8000), "too many properties"),
        (props(2001), "too many properties"),
        (one_mb, "too large"),
        (deep, "nests too deeply"),
        (cycle, "admits no value"),
    ] {
        let (code, v) = s.post("/api/chat", &chat(&format, 4));
        assert_eq!(code, 400, "{v}");
        assert!(error_of(&v).contains(why), "{why}: {v}");
        assert!(
            !error_of(&v).contains("<state>"),
            "llguidance's internals: {v}"
        );
    }
    // Large but within the bounds: compiled and enforced.
    let (code, v) = s.post("/api/chat", &chat(&props(1000), 8));
    assert_eq!(code, 200, "{v}");
    // The stream in flight finished, on the same runner.
    let rest: Vec<Value> = stream
        .map(|l| serde_json::from_str(&l.unwrap()).unwrap())
        .collect();
    assert_eq!(rest.last().unwrap()["done"], true, "{:?}", rest.last());
    assert_eq!(s.runners(), runner, "the runner was replaced");
    stop_leaving_nothing(s);
}

#[test]
fn a_frozen_runner_is_stopped_and_replaced() {
    let _quiet = quiet();
    let s = Serve::start(&[("MLX_RUNNER_STALL_TIMEOUT", "2s")]);
    let r = ureq::post(&s.url("/api/generate"))
        .send_string(
            &json!({"model": "gem", "prompt": "Hello", "options": {"num_predict": 400}})
                .to_string(),
        )
        .unwrap();
    let mut lines = BufReader::new(r.into_reader()).lines();
    let _first = lines.next().unwrap().unwrap();
    let frozen = s.runners();
    assert_eq!(frozen.len(), 1);
    // SAFETY: a signal to the runner we just read from /proc.
    unsafe { libc::kill(frozen[0] as i32, libc::SIGSTOP) };
    let t = Instant::now();
    // A new request for the model meanwhile: it waits, then runs on a new runner.
    let url = s.url("/api/generate");
    let second = std::thread::spawn(move || {
        let body =
            json!({"model": "gem", "prompt": "x", "stream": false, "options": {"num_predict": 2}});
        match ureq::post(&url).send_string(&body.to_string()) {
            Ok(r) => (r.status(), r.into_string().unwrap()),
            Err(ureq::Error::Status(c, r)) => (c, r.into_string().unwrap()),
            Err(e) => panic!("{e}"),
        }
    });
    assert!(answers_tags(&s));
    let rest: Vec<Value> = lines
        .map(|l| serde_json::from_str(&l.unwrap()).unwrap())
        .collect();
    let last = rest.last().unwrap();
    assert!(
        error_of(last).contains("stopped responding"),
        "the stream did not end with the freeze: {last}"
    );
    assert!(t.elapsed() < Duration::from_secs(15), "{:?}", t.elapsed());
    let (code, text) = second.join().unwrap();
    assert_eq!(code, 200, "{text}");
    assert!(t.elapsed() < Duration::from_secs(30), "{:?}", t.elapsed());
    // The frozen one was killed, not left stopped.
    let deadline = Instant::now() + Duration::from_secs(5);
    while alive(frozen[0]) {
        assert!(
            Instant::now() < deadline,
            "the frozen runner was left behind"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let now = s.runners();
    assert_eq!(now.len(), 1);
    assert_ne!(now, frozen);
    stop_leaving_nothing(s);
}

#[test]
fn a_dead_runners_error_is_its_own_last_words() {
    let _quiet = quiet();
    let s = Serve::start(&[]);
    let r = ureq::post(&s.url("/api/generate"))
        .send_string(
            &json!({"model": "gem", "prompt": "Hello", "options": {"num_predict": 400}})
                .to_string(),
        )
        .unwrap();
    let mut lines = BufReader::new(r.into_reader()).lines();
    let _first = lines.next().unwrap().unwrap();
    let victim = s.runners()[0];
    // SAFETY: a signal to the runner we just read from /proc.
    unsafe { libc::kill(victim as i32, libc::SIGKILL) };
    let last: Value = lines
        .map(|l| serde_json::from_str(&l.unwrap()).unwrap())
        .last()
        .unwrap();
    let e = error_of(&last);
    // It said nothing: the error says how it ended, not an older log line (its "ready").
    assert!(e.contains("SIGKILL"), "{e}");
    assert!(!e.contains("ready") && !e.contains("INFO"), "{e}");
    stop_leaving_nothing(s);
}

fn raise_fd_limit(n: u64) {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: plain syscalls on a local struct.
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim);
        lim.rlim_cur = lim.rlim_max.min(n.max(lim.rlim_cur));
        libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
    }
}

#[test]
fn a_crowd_of_half_sent_requests_does_not_lock_clients_out() {
    let _quiet = quiet();
    raise_fd_limit(4096);
    let s = Serve::start(&[]);
    // Past serve's cap of 1024 connections, each with half a request head.
    let mut crowd = Vec::new();
    for _ in 0..1100 {
        let Ok(mut c) = std::net::TcpStream::connect(("127.0.0.1", s.port)) else {
            break;
        };
        let _ = c.write_all(b"GET /api/tags HTTP/1.1\r\nhost: localhost\r\n");
        crowd.push(c);
    }
    assert!(
        crowd.len() >= 1100,
        "only {} connections opened",
        crowd.len()
    );
    std::thread::sleep(Duration::from_millis(300));
    let mut slowest = Duration::ZERO;
    for i in 0..50 {
        // The pressure keeps up: another half-sent request before each whole one.
        if let Ok(mut c) = std::net::TcpStream::connect(("127.0.0.1", s.port)) {
            let _ = c.write_all(b"POST /api/chat HTTP/1.1\r\n");
            crowd.push(c);
        }
        let t = Instant::now();
        assert!(answers_tags(&s), "request {i} was locked out");
        slowest = slowest.max(t.elapsed());
    }
    eprintln!(
        "50 requests through a crowd of {} half-sent ones: slowest {slowest:?}",
        crowd.len()
    );
    drop(crowd);
    stop_leaving_nothing(s);
}

#[test]
fn malformed_tools_file_names_and_origins_are_refused() {
    let _quiet = quiet();
    let s = Serve::start(&[]);
    let nope = json!([{"type": "function", "function": "nope"}]);
    let (code, v) = s.post(
        "/api/chat",
        &json!({"model": "gem", "messages": [{"role": "user", "content": "hi"}], "tools": nope, "stream": false}),
    );
    assert_eq!(code, 400, "{v}");
    assert!(error_of(&v).contains("invalid tool 0"), "{v}");
    let (code, v) = s.post(
        "/v1/chat/completions",
        &json!({"model": "gem", "messages": [{"role": "user", "content": "hi"}], "tools": nope}),
    );
    assert_eq!(code, 400, "{v}");
    assert!(v.to_string().contains("invalid tool 0"), "{v}");
    let (code, v) = s.post(
        "/api/chat",
        &json!({"model": "gem", "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "retrieval", "function": {"name": "f"}}], "stream": false}),
    );
    assert_eq!(code, 400, "{v}");

    let digest = format!("sha256:{}", "0".repeat(64));
    for name in ["a\0b".to_string(), "x".repeat(5000), "a\nb".to_string()] {
        let (code, v) = s.post(
            "/api/create",
            &json!({"model": "m", "files": {name: digest}}),
        );
        assert_eq!(code, 400, "{v}");
        assert!(error_of(&v).contains("invalid file name"), "{v}");
    }

    for origin in [
        "http://localhost:80@evil.com",
        "http://localhost@evil.com",
        "http://localhost:3000/path",
    ] {
        let r = ureq::get(&s.url("/api/tags")).set("Origin", origin).call();
        match r {
            Err(ureq::Error::Status(403, _)) => {}
            Ok(r) => panic!(
                "{origin} was granted (CORS {:?})",
                r.header("access-control-allow-origin")
            ),
            Err(e) => panic!("{origin}: {e}"),
        }
    }
    let r = ureq::get(&s.url("/api/tags"))
        .set("Origin", "http://localhost:3000")
        .call()
        .unwrap();
    assert_eq!(
        r.header("access-control-allow-origin"),
        Some("http://localhost:3000")
    );
    stop_leaving_nothing(s);
}

/// Serve's renderers are its own children, and go with it.
#[test]
fn renderers_are_reused_and_end_with_serve() {
    let _quiet = quiet();
    let s = Serve::start(&[]);
    for _ in 0..6 {
        let (code, v) = s.post(
            "/api/chat",
            &json!({"model": "gem", "messages": [{"role": "user", "content": "hi"}],
                "stream": false, "options": {"num_predict": 1}}),
        );
        assert_eq!(code, 200, "{v}");
    }
    let renderers: Vec<u32> = children_of(s.child.id())
        .into_iter()
        .filter(|&p| subcommand(p).as_deref() == Some("render-worker"))
        .collect();
    assert_eq!(
        renderers.len(),
        1,
        "one sequential client needs one renderer"
    );

    // A render whose client leaves stops with it: its worker is killed, not left to run.
    let body = generate(
        "{% set ns = namespace(s='') %}{% for i in range(60000) %}{% set ns.s = ns.s ~ ('y' * 4000) %}{% endfor %}{{ ns.s | length }}",
        "x",
    )
    .to_string();
    let mut c = std::net::TcpStream::connect(("127.0.0.1", s.port)).unwrap();
    write!(
        c,
        "POST /api/generate HTTP/1.1\r\nhost: localhost\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    std::thread::sleep(Duration::from_millis(700));
    let rendering: Vec<u32> = children_of(s.child.id())
        .into_iter()
        .filter(|&p| subcommand(p).as_deref() == Some("render-worker"))
        .collect();
    assert_eq!(
        rendering, renderers,
        "the idle renderer takes the next render"
    );
    drop(c);
    let t = Instant::now();
    while alive(rendering[0]) {
        assert!(
            t.elapsed() < Duration::from_secs(3),
            "the render went on after its client left"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(answers_tags(&s));
    stop_leaving_nothing(s);
}

/// One HTTP/1.1 request on `conn` (kept alive) and its status, the response's body read to
/// its end.
fn exchange(conn: &mut std::net::TcpStream, head: &str, body: &[u8]) -> u16 {
    conn.write_all(head.as_bytes()).unwrap();
    conn.write_all(body).unwrap();
    let mut r = BufReader::new(conn.try_clone().unwrap());
    let mut line = String::new();
    r.read_line(&mut line).unwrap();
    let status: u16 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    let mut len = 0;
    loop {
        line.clear();
        r.read_line(&mut line).unwrap();
        if line == "\r\n" {
            break;
        }
        if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
            len = v.trim().parse().unwrap();
        }
    }
    let mut rest = vec![0u8; len];
    std::io::Read::read_exact(&mut r, &mut rest).unwrap();
    status
}

/// A blob posted again (ollama's Python client posts without asking first) is read to its end
/// and answered 200, and the connection goes on: answering before the body is read hung up on
/// a client still sending it.
#[test]
fn a_blob_posted_again_is_read_and_the_connection_kept() {
    use sha2::Digest;
    let s = Serve::start(&[]);
    let body: Vec<u8> = (0..8u32 << 20).map(|i| (i * 7 + i / 251) as u8).collect();
    let hash = sha2::Sha256::digest(&body);
    let digest = format!(
        "sha256:{}",
        hash.iter().map(|b| format!("{b:02x}")).collect::<String>()
    );
    let addr = s
        .url("")
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .to_string();
    let mut conn = std::net::TcpStream::connect(&addr).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let head = format!(
        "POST /api/blobs/{digest} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    assert_eq!(exchange(&mut conn, &head, &body), 201, "stored");
    assert_eq!(exchange(&mut conn, &head, &body), 200, "already stored");
    let version = format!("GET /api/version HTTP/1.1\r\nHost: {addr}\r\n\r\n");
    assert_eq!(
        exchange(&mut conn, &version, b""),
        200,
        "the same connection"
    );
    assert!(answers_tags(&s));
}
