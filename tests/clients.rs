//! The official `ollama`, `openai` and `anthropic` Python clients (pinned in
//! tests/clients/requirements.txt, installed into target/clients-venv by tests/clients/venv.sh)
//! drive `serve` end to end (tests/clients/test_clients.py), and so do the libraries people
//! build on them: langchain-ollama, langchain-openai, litellm, instructor and llama-index's
//! ollama LLM
//! (tests/clients/libraries.txt in target/libraries-venv; tests/clients/test_libraries.py).

mod common;

use common::fixture;
use common::serve::Serve;
use std::process::Command;

/// The python of the environment `venv.sh` builds from `requirements` in `target/<dir>`.
fn python(dir: &str, requirements: &str) -> String {
    let root = env!("CARGO_MANIFEST_DIR");
    let venv = Command::new("bash")
        .arg(format!("{root}/tests/clients/venv.sh"))
        .arg(format!("{root}/target/{dir}"))
        .arg(format!("{root}/tests/clients/{requirements}"))
        .output()
        .expect("running tests/clients/venv.sh");
    assert!(
        venv.status.success(),
        "could not install the Python clients: {}",
        String::from_utf8_lossy(&venv.stderr)
    );
    String::from_utf8(venv.stdout).unwrap().trim().to_string()
}

#[test]
fn libraries_built_on_the_clients_work_against_serve() {
    let root = env!("CARGO_MANIFEST_DIR");
    let python = python("libraries-venv", "libraries.txt");
    let s = Serve::start(&[]);
    let out = Command::new(&python)
        .arg(format!("{root}/tests/clients/test_libraries.py"))
        .env("MLX_SERVE_URL", format!("http://127.0.0.1:{}", s.port))
        .env("NO_PROXY", "127.0.0.1,localhost")
        // Offline: no library may reach for the network (telemetry, tokenizer downloads).
        .env("LANGCHAIN_TRACING_V2", "false")
        .env("HF_HUB_OFFLINE", "1")
        .env("LITELLM_LOCAL_MODEL_COST_MAP", "True")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    assert!(
        out.status.success() && stdout.contains("all library checks passed"),
        "library checks failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn official_python_clients_work_against_serve() {
    let root = env!("CARGO_MANIFEST_DIR");
    let python = python("clients-venv", "requirements.txt");
    let s = Serve::start(&[]);
    s.create(
        "vis",
        &format!("FROM {}\n", fixture("gemma4_vision_like").display()),
    );
    s.create(
        "aud",
        &format!("FROM {}\n", fixture("gemma4_audio_like").display()),
    );
    let out = Command::new(&python)
        .arg(format!("{root}/tests/clients/test_clients.py"))
        .env("MLX_SERVE_URL", format!("http://127.0.0.1:{}", s.port))
        .env("MLX_SERVE_PID", s.child.id().to_string())
        .env("MLX_FIXTURE_DIR", fixture("gemma4_e2b_like"))
        .env(
            "MLX_IMAGES_DIR",
            fixture("gemma4_vision_like").join("images"),
        )
        .env("MLX_AUDIO_DIR", fixture("gemma4_audio_like").join("audio"))
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
