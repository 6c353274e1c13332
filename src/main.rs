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

/// `auto` or a fixed depth.
#[derive(Debug, Clone, Copy)]
struct DraftDepth(Option<usize>);

impl std::str::FromStr for DraftDepth {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        if s == "auto" {
            return Ok(DraftDepth(None));
        }
        s.parse()
            .map(|n| DraftDepth(Some(n)))
            .map_err(|_| format!("draft depth must be auto or a number, got {s:?}"))
    }
}

#[derive(clap::Args, Clone)]
struct DraftArgs {
    /// Draft model directory: a gemma4 assistant, or a small model with the target's tokenizer.
    /// A GLM target with its own MTP layer drafts with it by default.
    #[arg(long)]
    draft: Option<PathBuf>,
    /// Draft depth: auto (adaptive, including no drafting when it does not pay) or a fixed
    /// number; 0 turns drafting off.
    #[arg(long, default_value = "auto")]
    draft_depth: DraftDepth,
    /// The deepest round the adaptive depth considers.
    #[arg(long, default_value_t = 6)]
    max_draft_depth: usize,
    /// Query position of the gemma4 assistant: s-1 (the last committed position, as mlx-vlm
    /// and ollama) or s (the bonus token's, as transformers).
    #[arg(long, default_value = "s-1")]
    draft_position: models::gemma4_assistant::QueryPosition,
}

impl DraftArgs {
    fn engine(&self, model: PathBuf, dtype: DtypeChoice) -> EngineConfig {
        EngineConfig {
            model_dir: model,
            dtype,
            ctx_size: None,
            parallel: 1,
            prefill_chunk: 512,
            cache_budget: None,
            cache_interval: 256,
            draft: self.draft.clone(),
            draft_depth: self.draft_depth.0,
            max_draft_depth: self.max_draft_depth,
            draft_position: self.draft_position,
        }
    }
}

#[derive(clap::Args)]
struct RunnerArgs {
    #[command(flatten)]
    draft: DraftArgs,
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
    #[command(flatten)]
    draft: DraftArgs,
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
        if stats.draft_tokens > 0 {
            eprintln!(
                "drafted: {} tokens, accepted {} ({:.0}%)",
                stats.draft_tokens,
                stats.draft_accepted,
                100.0 * stats.draft_accepted as f64 / stats.draft_tokens as f64
            );
        }
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
            ctx_size: a.ctx_size,
            parallel: a.parallel,
            prefill_chunk: a.prefill_chunk,
            cache_budget: a.cache_budget,
            cache_interval: a.cache_interval,
            ..a.draft.engine(a.model, a.dtype)
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
    let mut loaded = models::load(&a.model, a.dtype)?;
    let cfg = a.draft.engine(a.model.clone(), a.dtype);
    let draft = runner::engine::load_drafter(&cfg, &mut loaded).map_err(anyhow::Error::msg)?;
    let mut controller = runner::depth::DepthController::new(cfg.max_draft_depth, cfg.draft_depth);
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
        draft: draft.as_ref().map(|d| (d, &mut controller)),
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
