//! The official `ollama` and `openai` Python clients (pinned in tests/clients/requirements.txt,
//! installed into target/clients-venv by tests/clients/venv.sh) drive `serve` end to end:
//! tests/clients/test_clients.py.

mod common;

use common::fixture;
use common::serve::Serve;
use std::process::Command;

#[test]
fn official_python_clients_work_against_serve() {
    let root = env!("CARGO_MANIFEST_DIR");
    let venv = Command::new("bash")
        .arg(format!("{root}/tests/clients/venv.sh"))
        .output()
        .expect("running tests/clients/venv.sh");
    assert!(
        venv.status.success(),
        "could not install the Python clients: {}",
        String::from_utf8_lossy(&venv.stderr)
    );
    let python = String::from_utf8(venv.stdout).unwrap().trim().to_string();
    let s = Serve::start(&[]);
    let out = Command::new(&python)
        .arg(format!("{root}/tests/clients/test_clients.py"))
        .env("MLX_SERVE_URL", format!("http://127.0.0.1:{}", s.port))
        .env("MLX_SERVE_PID", s.child.id().to_string())
        .env("MLX_FIXTURE_DIR", fixture("gemma4_e2b_like"))
        .env("NO_PROXY", "127.0.0.1,localhost")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    assert!(
        out.status.success() && stdout.contains("all client checks passed"),
        "python client checks failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
