//! Memory of one large tokenization: `cargo bench --bench tokenize`.
//!
//! A 31 MiB text through the runner's `/v1/tokenize` (the gemma4 fixture's tokenizer): the
//! runner's resident memory before, its peak (VmHWM) and what it holds a second after, the
//! time, and the ids checked against the same text tokenized in 1 MiB slices at line ends
//! (which this text's tokenizer never merges across). `BENCH_RUNNER=path` measures another
//! build of the binary (an older one, for a before-and-after).

mod common;
use common::{free_port, root, wait_for, Server};

fn status_kib(pid: u32, key: &str) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap()
}

fn tokenize(port: u16, text: &str) -> Vec<u32> {
    let resp = ureq::post(&format!("http://127.0.0.1:{port}/v1/tokenize"))
        .send_string(text)
        .unwrap();
    serde_json::from_reader(resp.into_reader()).unwrap()
}

fn main() {
    let words = [
        "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "über", "naïve", "中文",
        "🙂", "123", "3.14", ",", ".", "!", "?",
    ];
    let mut rng = 0x2545_F491_4F6C_DD1Du64;
    let mut next = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let mut text = String::new();
    while text.len() < 31 << 20 {
        for _ in 0..12 {
            text.push_str(words[(next() % words.len() as u64) as usize]);
            text.push(' ');
        }
        text.push_str(".\n");
    }
    let model = root().join("tests/fixtures/models/gemma4_e2b_like");
    let exe = std::env::var("BENCH_RUNNER").unwrap_or(env!("CARGO_BIN_EXE_mlx-runner").into());
    let port = free_port();
    let s = Server(
        std::process::Command::new(exe)
            .args(["runner", "--model"])
            .arg(&model)
            .args(["--port", &port.to_string()])
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    assert!(wait_for(&format!("http://127.0.0.1:{port}/v1/status")));
    let pid = s.0.id();
    let before = status_kib(pid, "VmRSS:");
    let t = std::time::Instant::now();
    let ids = tokenize(port, &text);
    let secs = t.elapsed().as_secs_f64();
    std::thread::sleep(std::time::Duration::from_secs(1));
    let (peak, after) = (status_kib(pid, "VmHWM:"), status_kib(pid, "VmRSS:"));
    // The reference: slices of about 1 MiB cut after a newline, each tokenized alone (the
    // first keeps the BOS the tokenizer adds).
    let mut reference: Vec<u32> = Vec::new();
    let mut at = 0;
    while at < text.len() {
        let mut end = (at + (1 << 20)).min(text.len());
        while end < text.len() && text.as_bytes()[end - 1] != b'\n' {
            end += 1;
        }
        let part = tokenize(port, &text[at..end]);
        reference.extend(if at == 0 { &part[..] } else { &part[1..] });
        at = end;
    }
    println!(
        "## One /v1/tokenize of {:.0} MiB\n",
        text.len() as f64 / 1048576.0
    );
    println!("| ids | before | peak | a second after | time | equal to the sliced reference |");
    println!("|---|---|---|---|---|---|");
    println!(
        "| {} | {} MiB | {} MiB | {} MiB | {secs:.1} s | {} |",
        ids.len(),
        before / 1024,
        peak / 1024,
        after / 1024,
        ids == reference
    );
}
