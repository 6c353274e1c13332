//! `serve` over a temporary store holding fixture models, as the serve and client tests drive
//! it.

use super::{binary, fixture, free_port, wait_timeout};
use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

pub struct Serve {
    pub child: Child,
    pub port: u16,
    pub dir: tempfile::TempDir,
    pub models: PathBuf,
}

impl Serve {
    /// A store holding `gem` (gemma4) and `glm` (GLM4-MoE-Lite), and `serve` over it.
    pub fn start(env: &[(&str, &str)]) -> Serve {
        let dir = tempfile::tempdir().unwrap();
        let models = dir.path().join("models");
        for (name, fix) in [("gem", "gemma4_e2b_like"), ("glm", "glm4_moe_lite")] {
            create(
                dir.path(),
                &models,
                name,
                &format!("FROM {}\n", fixture(fix).display()),
            );
        }
        Self::on(dir, models, env)
    }

    pub fn on(dir: tempfile::TempDir, models: PathBuf, env: &[(&str, &str)]) -> Serve {
        let port = free_port();
        let child = binary()
            .env("MLX_RUNNER_MODELS", &models)
            .env("MLX_RUNNER_HOST", format!("127.0.0.1:{port}"))
            .envs(env.iter().copied())
            .arg("serve")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let s = Serve {
            child,
            port,
            dir,
            models,
        };
        let start = Instant::now();
        while ureq::get(&s.url("/")).call().is_err() {
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "serve did not start"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        s
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    pub fn get(&self, path: &str) -> Value {
        serde_json::from_str(
            &ureq::get(&self.url(path))
                .call()
                .unwrap()
                .into_string()
                .unwrap(),
        )
        .unwrap()
    }

    /// (status, body as JSON or as a string).
    pub fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        self.send("POST", path, &body.to_string())
    }

    pub fn send(&self, method: &str, path: &str, body: &str) -> (u16, Value) {
        let r = ureq::request(method, &self.url(path)).send_string(body);
        let (code, text) = match r {
            Ok(r) => (r.status(), r.into_string().unwrap()),
            Err(ureq::Error::Status(c, r)) => (c, r.into_string().unwrap()),
            Err(e) => panic!("{e}"),
        };
        (
            code,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        )
    }

    /// A streamed answer's lines (NDJSON).
    pub fn stream(&self, path: &str, body: &Value) -> Vec<Value> {
        let r = ureq::post(&self.url(path))
            .send_string(&body.to_string())
            .unwrap();
        BufReader::new(r.into_reader())
            .lines()
            .map(|l| serde_json::from_str(&l.unwrap()).unwrap())
            .collect()
    }

    /// Creates `name` in serve's store from a Modelfile's text.
    pub fn create(&self, name: &str, modelfile: &str) {
        create(self.dir.path(), &self.models, name, modelfile);
    }

    /// The runner processes serve has spawned (not its template renderers).
    pub fn runners(&self) -> Vec<u32> {
        children_of(self.child.id())
            .into_iter()
            .filter(|&p| subcommand(p).as_deref() == Some("runner"))
            .collect()
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        // SAFETY: kill with a valid pid.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        if wait_timeout(&mut self.child, Duration::from_secs(15)).is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// `mlx-runner create name` into the store `models` from a Modelfile written in `dir`.
fn create(dir: &std::path::Path, models: &std::path::Path, name: &str, modelfile: &str) {
    let mf = dir.join(format!("Modelfile.{name}"));
    std::fs::write(&mf, modelfile).unwrap();
    let out = binary()
        .env("MLX_RUNNER_MODELS", models)
        .args(["create", name, "-f"])
        .arg(&mf)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The subcommand a process of ours runs (`runner`, `render-worker`, ...).
pub fn subcommand(pid: u32) -> Option<String> {
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let arg = cmdline.split(|&b| b == 0).nth(1)?;
    Some(String::from_utf8_lossy(arg).into_owned())
}

pub fn children_of(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(p) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{p}/stat")) else {
            continue;
        };
        // The fields after the command name (which may hold spaces): state, ppid, ...
        let after = &stat[stat.rfind(')').unwrap() + 2..];
        let mut f = after.split(' ');
        let state = f.next().unwrap_or("");
        if f.next().and_then(|pp| pp.parse::<u32>().ok()) == Some(pid) && state != "Z" {
            out.push(p);
        }
    }
    out
}
