//! `mlx-runner`: a local LLM runner on MLX.

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use models::DtypeChoice;
use runner::engine::EngineConfig;
use runner::process::RunnerOptions;
use runner::protocol::CompletionChunk;
use runner::text::TextStream;
use runner::{Ctx, Event, Generation, GenerationParams};
use sample::{Options, Sampler};
use std::io::Write;
use std::path::PathBuf;

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
    /// Generate a completion once, in-process (smoke tests and benchmarks).
    Generate(GenerateArgs),
    /// Serve a model over local HTTP, as a parent model server spawns it (PROTOCOL.md).
    Runner(RunnerArgs),
}

#[derive(clap::Args)]
struct RunnerArgs {
    /// Model directory.
    #[arg(long)]
    model: PathBuf,
    #[arg(long)]
    port: u16,
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Context length (default: the model's maximum).
    #[arg(long)]
    ctx_size: Option<usize>,
    /// Compute dtype: auto (float32 on CPU, the checkpoint's on a GPU), f32, f16 or bf16.
    #[arg(long, default_value = "auto")]
    dtype: DtypeChoice,
    /// Sequences generated concurrently; more requests wait in arrival order.
    #[arg(long, default_value_t = 4)]
    parallel: usize,
    /// Tokens per prefill forward pass.
    #[arg(long, default_value_t = 512)]
    prefill_chunk: usize,
    /// Bytes the prefix cache may hold (default: a quarter of MLX's memory limit).
    #[arg(long)]
    cache_budget: Option<usize>,
    /// Prompt tokens between sliding-window snapshots kept by the prefix cache.
    #[arg(long, default_value_t = 256)]
    cache_interval: usize,
    /// Log at debug level.
    #[arg(long)]
    verbose: bool,
    /// Accepted for compatibility with the ollama parent; ignored.
    #[arg(long)]
    mlx_engine: bool,
}

#[derive(clap::Args)]
struct GenerateArgs {
    /// Model directory (config.json, *.safetensors, tokenizer.json, ...).
    #[arg(long)]
    model: PathBuf,
    /// The prompt text, tokenized as the model's tokenizer config says.
    #[arg(long)]
    prompt: String,
    /// Tokens to generate at most.
    #[arg(short = 'n', long = "num-predict", default_value_t = 64)]
    num_predict: usize,
    /// 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    #[arg(long, default_value_t = 0)]
    top_k: i32,
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    #[arg(long, default_value_t = 1.0)]
    repeat_penalty: f32,
    #[arg(long, default_value_t = 64)]
    repeat_last_n: i32,
    #[arg(long, default_value_t = -1)]
    seed: i64,
    /// Stop strings (repeatable).
    #[arg(long)]
    stop: Vec<String>,
    /// Also report this many most likely alternatives per token (implies --logprobs).
    #[arg(long, default_value_t = 0)]
    top_logprobs: i32,
    /// Report the chosen token's logprob.
    #[arg(long)]
    logprobs: bool,
    /// Print the runner's NDJSON completion chunks instead of plain text.
    #[arg(long)]
    json: bool,
    /// Compute dtype: auto (float32 on CPU), f32, f16 or bf16.
    #[arg(long, default_value = "auto")]
    dtype: DtypeChoice,
    /// Context length (default: the model's maximum).
    #[arg(long)]
    ctx_size: Option<usize>,
    /// Tokens per prefill forward pass.
    #[arg(long, default_value_t = 512)]
    prefill_chunk: usize,
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Info => info(),
        Command::Generate(args) => generate(args),
        Command::Runner(args) => runner(args),
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

fn finish(
    out: &mut impl Write,
    a: &GenerateArgs,
    reason: runner::protocol::DoneReason,
    tail: String,
    stats: &runner::protocol::Stats,
) -> Result<()> {
    if a.json {
        let chunk = CompletionChunk::done(reason, tail, stats);
        writeln!(out, "{}", serde_json::to_string(&chunk)?)?;
    } else {
        writeln!(out, "{tail}")?;
        let rate = |n: usize, ns: u64| n as f64 / (ns.max(1) as f64 / 1e9);
        eprintln!(
            "prompt: {} tokens, {:.1} tok/s; generated: {} tokens, {:.1} tok/s",
            stats.prompt_eval_count,
            rate(stats.prompt_eval_count, stats.prompt_eval_ns),
            stats.eval_count,
            rate(stats.eval_count.saturating_sub(1), stats.eval_ns),
        );
    }
    Ok(())
}

fn runner(a: RunnerArgs) -> Result<()> {
    let level = if a.verbose { "debug" } else { "info" };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(level));
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(filter)
        .with_ansi(false)
        .init();
    let _ = a.mlx_engine;
    let opts = RunnerOptions {
        engine: EngineConfig {
            model_dir: a.model,
            dtype: a.dtype,
            ctx_size: a.ctx_size,
            parallel: a.parallel,
            prefill_chunk: a.prefill_chunk,
            cache_budget: a.cache_budget,
            cache_interval: a.cache_interval,
        },
        host: a.host,
        port: a.port,
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(runner::process::run(opts))
        .map_err(anyhow::Error::msg)
}

fn generate(a: GenerateArgs) -> Result<()> {
    let loaded = models::load(&a.model, a.dtype)?;
    let num_ctx = a.ctx_size.unwrap_or(loaded.model.max_context());
    let options = Options {
        temperature: a.temperature,
        top_k: a.top_k,
        top_p: a.top_p,
        min_p: a.min_p,
        repeat_last_n: a.repeat_last_n,
        repeat_penalty: a.repeat_penalty,
        presence_penalty: 0.0,
        frequency_penalty: 0.0,
        seed: a.seed,
        logprobs: a.logprobs || a.top_logprobs > 0,
        top_logprobs: a.top_logprobs,
    };
    options.validate()?;
    let prompt = loaded.tokenizer.encode(&a.prompt)?;
    let params = GenerationParams {
        prompt,
        options,
        num_predict: Some(a.num_predict),
        num_ctx,
        prefill_chunk: a.prefill_chunk,
        eos: loaded.tokenizer.eos_ids().to_vec(),
        checkpoints: Vec::new(),
    };
    if a.num_predict == 0 {
        return Ok(());
    }
    let tok = &loaded.tokenizer;
    let mut sampler = Sampler::new(num_ctx);
    let mut ctx = Ctx {
        model: &*loaded.model,
        sampler: &mut sampler,
    };
    let mut g = Generation::new(&mut ctx, 0, params)?;
    let mut text = TextStream::new(&a.stop);
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let mut stopped = false;
    while !g.is_finished() {
        let Some(ev) = g.step(&mut ctx)? else {
            continue;
        };
        match ev {
            Event::Token { id, logprob } => {
                let piece = text.push(tok, id, logprob.as_ref())?;
                if a.json {
                    let chunk =
                        CompletionChunk::content(piece.text, piece.logprob.map(|l| vec![l]));
                    writeln!(out, "{}", serde_json::to_string(&chunk)?)?;
                } else {
                    write!(out, "{}", piece.text)?;
                }
                out.flush().context("writing to stdout")?;
                if piece.stopped {
                    stopped = true;
                    g.cancel(&mut ctx);
                    let stats = g.stats().clone();
                    finish(
                        &mut out,
                        &a,
                        runner::protocol::DoneReason::Stop,
                        String::new(),
                        &stats,
                    )?;
                }
            }
            Event::Done { reason, stats } => {
                let tail = if stopped {
                    String::new()
                } else {
                    text.finish(tok)?
                };
                finish(&mut out, &a, reason, tail, &stats)?;
            }
        }
    }
    Ok(())
}
