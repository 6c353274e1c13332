//! Binding benchmarks: `cargo bench --bench binding`.
//!
//! 1. Per-op overhead of our bindings: build and evaluate a chain of 1000 small adds, against
//!    the same chain in Python MLX on the same machine (the peer, from `.venv-peer`, made by
//!    `benches/peer-venv.sh`, or `MLX_RUNNER_PEER_PYTHON`). Reported as a ratio.
//! 2. float32 matmul GFLOP/s at 512, 1024 and 2048, with the BLAS the binary links (OpenBLAS when
//!    the system has it) and with MLX's bundled reference BLAS (the same binary re-run with that
//!    library preloaded, so it wins the symbol lookup).
//! 3. Loading a 64 MiB safetensors file: validated MLX reader against the mmap loader.
//!
//! Medians over several runs; these machines are noisy. Nothing here asserts a time.

mod common;
use common::median;

use mlx::{Array, Dtype};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

fn chain(ops: usize, runs: usize) -> mlx::Result<(f64, f64)> {
    let (mut build, mut eval) = (Vec::new(), Vec::new());
    for i in 0..runs + 2 {
        let t0 = Instant::now();
        let mut x = Array::zeros(&[16], Dtype::F32)?;
        for _ in 0..ops {
            x = x.add_scalar(1.0)?;
        }
        let t1 = Instant::now();
        x.eval()?;
        let t2 = Instant::now();
        assert_eq!(x.index(&mlx::ix![0])?.item::<f32>()?, ops as f32);
        if i >= 2 {
            build.push((t1 - t0).as_secs_f64() * 1e6);
            eval.push((t2 - t1).as_secs_f64() * 1e6);
        }
    }
    Ok((median(build), median(eval)))
}

fn peer_python() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("MLX_RUNNER_PEER_PYTHON") {
        return Some(PathBuf::from(p));
    }
    let local = Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv-peer/bin/python");
    local.exists().then_some(local)
}

fn json_field(text: &str, key: &str) -> Option<f64> {
    let rest = &text[text.find(&format!("\"{key}\":"))? + key.len() + 3..];
    let end = rest.find([',', '}'])?;
    rest[..end].trim().parse().ok()
}

fn matmul_gflops(n: i32, runs: usize) -> mlx::Result<f64> {
    let a = mlx::random::normal(&[n, n], Dtype::F32, 0.0, 1.0, Some(&mlx::random::key(1)?))?;
    let b = mlx::random::normal(&[n, n], Dtype::F32, 0.0, 1.0, Some(&mlx::random::key(2)?))?;
    mlx::eval(&[&a, &b])?;
    let mut times = Vec::new();
    for i in 0..runs + 1 {
        let t = Instant::now();
        a.matmul(&b)?.eval()?;
        if i > 0 {
            times.push(t.elapsed().as_secs_f64());
        }
    }
    Ok(2.0 * f64::from(n).powi(3) / median(times) / 1e9)
}

fn reference_blas() -> Option<PathBuf> {
    let prefix = PathBuf::from(option_env!("MLX_RUNNER_MLX_PREFIX")?);
    let libs = prefix.parent()?.join("mlx_cpu.libs");
    std::fs::read_dir(libs)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("libblas"))
        })
}

fn matmul_rows() -> mlx::Result<Vec<(i32, f64)>> {
    [512, 1024, 2048]
        .into_iter()
        .map(|n| Ok((n, matmul_gflops(n, if n > 1024 { 3 } else { 5 })?)))
        .collect()
}

fn load_bench() -> mlx::Result<(f64, f64)> {
    let dir = std::env::temp_dir().join(format!("mlx-runner-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| mlx::Error::Invalid(e.to_string()))?;
    let path = dir.join("w.safetensors");
    let tensors: Vec<(String, Array)> = (0..16)
        .map(|i| {
            let k = mlx::random::key(i)?;
            Ok((
                format!("layer.{i}.weight"),
                mlx::random::normal(&[1024, 1024], Dtype::F32, 0.0, 1.0, Some(&k))?,
            ))
        })
        .collect::<mlx::Result<_>>()?;
    let refs: Vec<(&str, &Array)> = tensors.iter().map(|(n, a)| (n.as_str(), a)).collect();
    mlx::io::save_safetensors(&path, &refs)?;
    let (mut ours, mut theirs) = (Vec::new(), Vec::new());
    for _ in 0..5 {
        let t = Instant::now();
        let m = mlx::io::load_safetensors(&path)?;
        let arrays: Vec<&Array> = m.arrays.values().collect();
        mlx::eval(&arrays)?;
        ours.push(t.elapsed().as_secs_f64() * 1e3);
        let t = Instant::now();
        let m = mlx::io::load_safetensors_mmap(&path)?;
        let arrays: Vec<&Array> = m.arrays.values().collect();
        mlx::eval(&arrays)?;
        theirs.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok((median(ours), median(theirs)))
}

fn main() -> mlx::Result<()> {
    // `--matmul-only` is how the bench re-runs itself under a preloaded reference BLAS.
    if std::env::args().any(|a| a == "--matmul-only") {
        for (n, g) in matmul_rows()? {
            println!("{n} {g:.2}");
        }
        return Ok(());
    }
    // cargo passes `--bench`; ignore it and any filter.
    println!(
        "mlx {} · sgemm from {}",
        mlx::version(),
        mlx::blas_library()
    );

    println!("\n## Per-op overhead: a chain of 1000 small adds (median of 15 runs)\n");
    let (build, eval) = chain(1000, 15)?;
    println!("| | graph build µs/op | eval µs/op | total µs/op |");
    println!("|---|---|---|---|");
    println!(
        "| mlx-runner (Rust) | {:.3} | {:.3} | {:.3} |",
        build / 1000.0,
        eval / 1000.0,
        (build + eval) / 1000.0
    );
    match peer_python() {
        Some(py) => {
            let out = Command::new(&py)
                .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/peer_ops.py"))
                .args(["1000", "15"])
                .output();
            match out {
                Ok(o) if o.status.success() => {
                    let text = String::from_utf8_lossy(&o.stdout);
                    let pb = json_field(&text, "build_us").unwrap_or(f64::NAN);
                    let pe = json_field(&text, "eval_us").unwrap_or(f64::NAN);
                    println!(
                        "| Python mlx (peer) | {:.3} | {:.3} | {:.3} |",
                        pb / 1000.0,
                        pe / 1000.0,
                        (pb + pe) / 1000.0
                    );
                    println!(
                        "\nratio peer/ours (total time, >1 means we are faster): {:.2}",
                        (pb + pe) / (build + eval)
                    );
                }
                Ok(o) => println!("peer failed: {}", String::from_utf8_lossy(&o.stderr).trim()),
                Err(e) => println!("peer failed to start ({}): {e}", py.display()),
            }
        }
        None => println!("(no peer: run benches/peer-venv.sh or set MLX_RUNNER_PEER_PYTHON)"),
    }

    println!("\n## float32 matmul GFLOP/s (median)\n");
    let linked = matmul_rows()?;
    let reference: Option<Vec<f64>> = reference_blas().and_then(|lib| {
        let exe = std::env::current_exe().ok()?;
        let out = Command::new(exe)
            .arg("--matmul-only")
            .env("LD_PRELOAD", &lib)
            .output()
            .ok()?;
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        Some(
            text.lines()
                .filter_map(|l| l.split_whitespace().nth(1)?.parse().ok())
                .collect(),
        )
    });
    println!("| n | linked BLAS | reference BLAS (bundled) | speed-up |");
    println!("|---|---|---|---|");
    for (i, (n, g)) in linked.iter().enumerate() {
        match reference.as_ref().and_then(|r| r.get(i)) {
            Some(r) => println!("| {n} | {g:.1} | {r:.1} | {:.1}x |", g / r),
            None => println!("| {n} | {g:.1} | n/a | |"),
        }
    }

    println!("\n## Loading 16 × 4 MiB float32 tensors (median of 5, ms)\n");
    let (ours, theirs) = load_bench()?;
    println!("| validated MLX reader (default) | mmap + copy |");
    println!("|---|---|");
    println!("| {ours:.1} | {theirs:.1} |");
    Ok(())
}
