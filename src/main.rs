//! `mlx-runner`: a local LLM runner on MLX.

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "mlx-runner", version, about = "A local LLM runner on MLX")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print the MLX version, the compute device and the BLAS library that serves sgemm.
    Info,
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Info => info(),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn info() -> Result<()> {
    println!("mlx-runner {}", env!("CARGO_PKG_VERSION"));
    println!("mlx        {}", mlx::version());
    let gpu = if mlx::gpu_available() {
        "available"
    } else {
        "not available"
    };
    println!("device     {} (gpu {gpu})", mlx::default_device());
    println!("sgemm      {}", mlx::blas_library());
    if let Some(cfg) = mlx::openblas_config() {
        println!("openblas   {cfg}");
    }
    // A tiny computation proves the library loads and evaluates, not just links.
    let a = mlx::Array::from_slice(&[1.0f32, 2.0, 3.0, 4.0], &[2, 2])?;
    let s: f32 = a.matmul(&a)?.sum_all(false)?.item()?;
    anyhow::ensure!(s == 54.0, "MLX self-check failed: expected 54, got {s}");
    println!("self-check ok");
    Ok(())
}
