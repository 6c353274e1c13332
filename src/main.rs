//! `mlx-runner`: a local LLM runner on MLX.

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use models::{DtypeChoice, ModelFiles};
use runner::cluster::{Cluster, Job, JoinOptions};
use runner::engine::{DraftSource, EngineConfig};
use runner::process::RunnerOptions;
use runner::protocol::{CompletionChunk, CompletionRequest};
use runner::text::{TextPiece, TextStream};
use runner::{Ctx, Event, Generation, GenerationParams};
use sample::Sampler;
use std::io::Write;
use std::path::PathBuf;

/// jemalloc for Rust's allocations too (its symbols already stand in for malloc process-wide):
/// a decode step's graph and MLX's buffers are many short-lived allocations, which glibc's
/// allocator served with periodic consolidations of its free lists on the engine thread.
#[cfg(target_os = "linux")]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// jemalloc's options, read at its first allocation (`MALLOC_CONF` still applies after them).
/// Blocks over 8 MiB come from one arena that returns its pages at once by default, so every
/// prefill chunk's larger activations were fresh pages to fault in and zero: prefill 0.85x of
/// glibc's on the 4-bit bench model, against 1.01x with the arena off.
#[cfg(target_os = "linux")]
#[no_mangle]
#[allow(non_upper_case_globals)]
pub static malloc_conf: &[u8; 21] = b"oversize_threshold:0\0";

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
    /// Serve a model over local HTTP, as a parent model server spawns it (docs/PROTOCOL.md).
    Runner(RunnerArgs),
    /// The model server: ollama's and OpenAI's APIs over the store's models, each run in a
    /// runner child process (docs/SERVE.md).
    Serve(ServeArgs),
    /// Create a model in the store from a Modelfile (FROM, DRAFT, PARAMETER, ...).
    Create(CreateArgs),
    /// List the models in the store.
    #[command(alias = "ls")]
    List,
    /// Show a stored model: architecture, parameters, quantization, draft, Modelfile.
    Show(ShowArgs),
    /// Remove models from the store (blobs another model uses stay).
    Rm(RmArgs),
    /// Join a model split over several processes as one of its ranks: started on each host
    /// the hostfile names (rank 0 starts the ranks on its own machine itself); the command
    /// and the model come from rank 0 (docs/DISTRIBUTED.md).
    Worker(WorkerArgs),
    /// `serve`'s chat-template renderer: JSON lines in, JSON lines out (internal).
    #[command(hide = true)]
    RenderWorker,
}

#[derive(clap::Args)]
struct CreateArgs {
    /// The model's name: [host/][namespace/]name[:tag].
    name: String,
    /// The Modelfile (paths in it are relative to it).
    #[arg(short = 'f', long = "file", default_value = "Modelfile")]
    file: PathBuf,
    /// Quantize the target: q4 or q8 (int4 and int8 are aliases), MLX affine, group size 64.
    #[arg(short = 'q', long)]
    quantize: Option<store::QuantType>,
    /// Quantize the draft (including its output head): q4 or q8.
    #[arg(long, alias = "draft-quantize")]
    quantize_draft: Option<store::QuantType>,
}

#[derive(clap::Args)]
struct ShowArgs {
    name: String,
    /// Print only the Modelfile.
    #[arg(long)]
    modelfile: bool,
    /// Also list every tensor with its precision.
    #[arg(short, long)]
    verbose: bool,
}

#[derive(clap::Args)]
struct RmArgs {
    #[arg(required = true)]
    names: Vec<String>,
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
    /// Drafter: `ngram` (prompt lookup: drafts what followed the latest earlier occurrence of
    /// the context's last tokens, no model needed), or a draft model, a directory (`./ngram`
    /// for one of that name) or a stored model: a gemma4 assistant, or a small model with the
    /// target's tokenizer. Overrides the draft a stored model carries. A GLM target with its own
    /// MTP layer drafts with it by default.
    #[arg(long, conflicts_with = "no_draft")]
    draft: Option<String>,
    /// Do not draft at all (no speculative decoding).
    #[arg(long)]
    no_draft: bool,
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
    /// The engine configuration for the model given as `model` (a directory or a stored name),
    /// and the stored model's parameters.
    fn engine(&self, model: &str, dtype: DtypeChoice) -> Result<(EngineConfig, ModelContext)> {
        let m = model_files(model)?;
        let draft = match self.draft.as_deref() {
            Some("ngram") => Some(DraftSource::Ngram),
            Some(d) => Some(DraftSource::Model(draft_files(d)?)),
            None if self.no_draft => None,
            None => m.draft.map(DraftSource::Model),
        };
        let cfg = EngineConfig {
            model: m.files,
            dtype,
            ctx_size: None,
            parallel: 1,
            prefill_chunk: 512,
            cache_budget: None,
            memory_limit: None,
            cache_interval: 256,
            cache_disk: None,
            kv_cache: models::KvCacheType::default(),
            draft,
            draft_depth: if self.no_draft {
                Some(0)
            } else {
                self.draft_depth.0.map(|n| capped_depth(n, "--draft-depth"))
            },
            max_draft_depth: capped_depth(self.max_draft_depth, "--max-draft-depth"),
            draft_position: self.draft_position,
            cluster: None,
        };
        Ok((
            cfg,
            ModelContext {
                parameters: m.parameters,
                store: m.store,
            },
        ))
    }
}

/// The store, with what killed writers left behind cleaned away (when no writer is at work);
/// returns what a user should hear about that.
/// The deepest draft round allowed: a round's verify forward grows with its depth while the
/// chance that every draft is accepted shrinks geometrically, so deeper rounds only cost time
/// (a depth of 1000 took minutes per request).
const MAX_DRAFT_DEPTH: usize = 16;

fn capped_depth(n: usize, flag: &str) -> usize {
    if n > MAX_DRAFT_DEPTH {
        eprintln!("warning: {flag} {n} is deeper than {MAX_DRAFT_DEPTH}: using {MAX_DRAFT_DEPTH}");
        MAX_DRAFT_DEPTH
    } else {
        n
    }
}

/// Bytes as people write them: `1000`, `512MB`, `64GiB`, `1.5G` (a bare K, M, G or T is
/// binary, as memory is sized).
fn parse_bytes(v: &str) -> std::result::Result<u64, String> {
    let t = v.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let n: f64 = number
        .parse()
        .map_err(|_| format!("{v:?} is not a number of bytes (e.g. 1000, 512MB, 64GiB)"))?;
    let scale: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        "k" | "kib" => 1024.0,
        "m" | "mib" => 1024f64.powi(2),
        "g" | "gib" => 1024f64.powi(3),
        "t" | "tib" => 1024f64.powi(4),
        u => {
            return Err(format!(
                "{u:?} is not a unit of bytes (B, KB, MB, GB, KiB, MiB, GiB)"
            ))
        }
    };
    let bytes = n * scale;
    if !(1.0..1.8e19).contains(&bytes) {
        return Err(format!("{v:?} is out of range"));
    }
    Ok(bytes as u64)
}

fn seconds(v: f64, flag: &str) -> Result<std::time::Duration> {
    std::time::Duration::try_from_secs_f64(v)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| anyhow::anyhow!("{flag} must be a positive number of seconds, got {v}"))
}

/// What to say when MLX's float32 matmuls run on the reference BLAS bundled with its wheel
/// (12-16x slower than OpenBLAS), if they do.
fn reference_blas_warning() -> Option<String> {
    let lib = mlx::blas_library();
    let fast = lib.contains("openblas") || lib.contains("mlxr_blas");
    (!fast).then(|| {
        format!(
            "float32 matmuls run on the reference BLAS ({lib}), 12-16x slower than OpenBLAS: \
             install libopenblas0-pthread, or rebuild with python3/pip available so the build can \
             fetch the pinned scipy-openblas wheel (see README)"
        )
    })
}

/// A stored model's `num_ctx` PARAMETER: the context length it runs with unless `--ctx-size`
/// says otherwise.
fn stored_ctx(stored: &serde_json::Map<String, serde_json::Value>) -> Option<usize> {
    stored
        .get("num_ctx")
        .and_then(|v| v.as_u64())
        .map(|n| n as usize)
}

/// `--ctx-size 0` would make every request fail: refuse it at start.
fn check_ctx_size(n: Option<usize>) -> Result<()> {
    if n == Some(0) {
        anyhow::bail!("--ctx-size must be at least 1");
    }
    Ok(())
}

fn open_store_swept() -> Result<(store::Store, Option<String>)> {
    let st = store::Store::open(store::Store::default_root()?);
    let note = match st.sweep_partials()? {
        Some((0, _)) => None,
        Some((n, bytes)) => Some(format!(
            "removed {n} partial file(s) ({:.1} MB) left by an interrupted create",
            bytes as f64 / 1e6
        )),
        None => Some("a create is in progress: its partial files are kept".into()),
    };
    Ok((st, note))
}

fn open_store() -> Result<store::Store> {
    Ok(open_store_swept()?.0)
}

fn model_name(arg: &str) -> Result<store::ModelName> {
    arg.parse().map_err(anyhow::Error::msg)
}

/// What a model given on the command line brings besides its files.
struct ModelContext {
    /// A stored model's PARAMETERs.
    parameters: serde_json::Map<String, serde_json::Value>,
    /// Our store's root, for a stored model.
    store: Option<PathBuf>,
}

/// Where the prefix cache's disk tier goes and what it may hold: `--cache-dir`, else the
/// store's `prefix-cache` for a stored model; `--cache-disk-budget`, else a tenth of the free
/// space there, at most 10 GiB.
fn disk_tier(
    dir: Option<PathBuf>,
    store: Option<&std::path::Path>,
    budget: Option<u64>,
) -> Option<runner::DiskConfig> {
    let dir = dir.or_else(|| store.map(|s| s.join("prefix-cache")))?;
    let budget = budget.unwrap_or_else(|| {
        // What the tier holds already counts as room it may keep: the default must not shrink
        // each time the runner starts over a full directory.
        let held: u64 = std::fs::read_dir(&dir)
            .map(|d| {
                d.flatten()
                    .filter_map(|e| e.metadata().ok())
                    .filter(|m| m.is_file())
                    .map(|m| m.len())
                    .sum()
            })
            .unwrap_or(0);
        let free = base::machine::disk_free(&dir).unwrap_or(0);
        ((free + held) / 10).min(10 << 30)
    });
    (budget > 0).then_some(runner::DiskConfig { dir, budget })
}

/// A model given on the command line.
struct ModelArg {
    files: ModelFiles,
    /// The draft a stored model carries.
    draft: Option<ModelFiles>,
    /// A stored model's PARAMETERs.
    parameters: serde_json::Map<String, serde_json::Value>,
    /// Our store's root, for a stored model (where its prefix cache's disk tier goes).
    store: Option<PathBuf>,
}

/// A model on the command line: a checkpoint directory, else a model in the store (with the
/// draft and parameters it carries).
fn model_files(arg: &str) -> Result<ModelArg> {
    let dir = std::path::Path::new(arg);
    if dir.is_dir() {
        return Ok(ModelArg {
            files: ModelFiles::dir(dir)?,
            draft: None,
            parameters: Default::default(),
            store: None,
        });
    }
    let name: store::ModelName = arg.parse().map_err(|e: String| {
        anyhow::anyhow!("{arg:?} is not a model directory, and not a model name: {e}")
    })?;
    let (_, r) = resolve_stored(&name)?.map_err(|searched| {
        anyhow::anyhow!(
            "model {arg:?} not found: no such directory, and no model {name} in {searched}"
        )
    })?;
    Ok(ModelArg {
        files: r.target,
        draft: r.draft,
        parameters: r.parameters,
        // Ours even for a model read from ollama's store: we do not write into theirs.
        store: Some(open_store()?.root().to_path_buf()),
    })
}

/// A model name, resolved in our store and then in ollama's own (as a parent that passes
/// `--model gemma4:e4b` expects): the store it was found in and what it holds, or the stores
/// searched.
fn resolve_stored(
    name: &store::ModelName,
) -> Result<std::result::Result<(store::Store, store::Resolved), String>> {
    let st = open_store()?;
    match st.resolve(name) {
        Ok(r) => return Ok(Ok((st, r))),
        Err(store::StoreError::NotFound(_)) => {}
        Err(e) => return Err(e.into()),
    }
    let mut searched = st.root().display().to_string();
    let ollama = store::Store::ollama_root()
        .filter(|r| r != st.root() && r.is_dir())
        .map(store::Store::open);
    if let Some(o) = ollama {
        match o.resolve(name) {
            Ok(r) => return Ok(Ok((o, r))),
            Err(store::StoreError::NotFound(_)) => {
                searched = format!("{searched} or {}", o.root().display());
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(Err(searched))
}

/// A `--draft`: a directory, or a stored model used as a whole (its target).
fn draft_files(arg: &str) -> Result<ModelFiles> {
    Ok(model_files(arg)?.files)
}

/// `serve`'s settings; each flag falls back to its `MLX_RUNNER_*` variable (named as ollama's
/// `OLLAMA_*` ones), then to ollama's default.
#[derive(clap::Args)]
struct ServeArgs {
    /// Listen address: host, host:port or http://host:port [env MLX_RUNNER_HOST; default
    /// 127.0.0.1:11434].
    #[arg(long)]
    host: Option<String>,
    /// Port (overrides the port of --host).
    #[arg(long)]
    port: Option<u16>,
    /// How long a model stays loaded after its last request (e.g. 5m, 1h, 0, -1 forever)
    /// [env MLX_RUNNER_KEEP_ALIVE; default 5m].
    #[arg(long)]
    keep_alive: Option<String>,
    /// Models loaded at once; the least recently used idle one is unloaded to make room
    /// [env MLX_RUNNER_MAX_LOADED_MODELS; default 3].
    #[arg(long)]
    max_loaded_models: Option<usize>,
    /// Requests each runner generates at once [env MLX_RUNNER_NUM_PARALLEL; default 4].
    #[arg(long)]
    num_parallel: Option<usize>,
    /// How long a model may take to load [env MLX_RUNNER_LOAD_TIMEOUT; default 5m].
    #[arg(long)]
    load_timeout: Option<String>,
    /// A runner that sends no token and does not answer its status for this long is stopped
    /// (its streams end with an error; the next request starts a new one)
    /// [env MLX_RUNNER_STALL_TIMEOUT; default 30s].
    #[arg(long)]
    stall_timeout: Option<String>,
    /// Memory all runners together may use, in bytes or with a unit (64GiB, 512MB); models
    /// are placed within it, unloading the least recently used idle ones first
    /// [env MLX_RUNNER_MEMORY_LIMIT; default: what the machine has available].
    #[arg(long)]
    memory_limit: Option<String>,
    /// Split every model over the ranks of this hostfile (mlx.launch's JSON; each runner
    /// starts the ranks on loopback addresses itself) [env MLX_RUNNER_HOSTFILE].
    #[arg(long)]
    hostfile: Option<PathBuf>,
    /// The ranks' first ring port, for ranks on other hosts started with the same one
    /// [env MLX_RUNNER_RING_PORT; default: a free block for each runner].
    #[arg(long)]
    ring_port: Option<u16>,
    /// How the runners split models over the hostfile's ranks: pipeline (by layers) or tensor
    /// [env MLX_RUNNER_PARALLEL_MODE; default pipeline].
    #[arg(long, value_enum)]
    parallel_mode: Option<ParallelMode>,
    /// Extra allowed browser origins, comma-separated [env MLX_RUNNER_ORIGINS].
    #[arg(long)]
    origins: Option<String>,
    /// Log at debug level (including every runner's log lines).
    #[arg(long)]
    verbose: bool,
}

fn env_or(flag: Option<String>, var: &str) -> Option<String> {
    flag.or_else(|| std::env::var(var).ok().filter(|v| !v.trim().is_empty()))
}

fn duration_setting(
    v: Option<String>,
    what: &str,
    default: u64,
) -> Result<serve::sched::KeepAlive> {
    let Some(v) = v else {
        return Ok(serve::sched::KeepAlive::For(
            std::time::Duration::from_secs(default),
        ));
    };
    serve::pipeline::parse_keep_alive(&serde_json::Value::String(v))
        .map_err(|e| anyhow::anyhow!("{what}: {e}"))
        .map(|k| {
            k.unwrap_or(serve::sched::KeepAlive::For(
                std::time::Duration::from_secs(default),
            ))
        })
}

/// The ranks `serve --hostfile` splits models over, the hostfile checked now rather than at
/// each runner's start.
fn serve_ranks(
    hostfile: Option<PathBuf>,
    ring_port: Option<u16>,
    mode: Option<ParallelMode>,
) -> Result<Option<serve::sched::Ranks>> {
    let Some(path) =
        hostfile.or_else(|| std::env::var_os("MLX_RUNNER_HOSTFILE").map(PathBuf::from))
    else {
        return Ok(None);
    };
    let h = runner::cluster::Hostfile::read(&path).map_err(anyhow::Error::msg)?;
    let ring_port = match env_or(ring_port.map(|p| p.to_string()), "MLX_RUNNER_RING_PORT") {
        None => None,
        Some(v) => Some(
            v.trim()
                .parse::<u16>()
                .map_err(|_| anyhow::anyhow!("the ring port must be a port number, got {v:?}"))?,
        ),
    };
    if ring_port.is_none() && !h.hosts.iter().all(|r| r.is_local()) {
        anyhow::bail!(
            "{}: ranks on other hosts wait on a known ring port: give serve --ring-port (and \
             those ranks the same)",
            h.path.display()
        );
    }
    let mode = match (mode, std::env::var("MLX_RUNNER_PARALLEL_MODE")) {
        (Some(m), _) => Some(m),
        (None, Ok(v)) if !v.trim().is_empty() => Some(
            <ParallelMode as clap::ValueEnum>::from_str(v.trim(), true).map_err(|_| {
                anyhow::anyhow!("MLX_RUNNER_PARALLEL_MODE must be pipeline or tensor, got {v:?}")
            })?,
        ),
        _ => None,
    };
    let ports = h.hosts.iter().map(|r| r.ips.len()).sum::<usize>();
    Ok(Some(serve::sched::Ranks {
        count: h.hosts.len(),
        ports: u16::try_from(ports).unwrap_or(u16::MAX),
        hostfile: h.path,
        ring_port,
        mode: mode.map(|m| {
            <ParallelMode as clap::ValueEnum>::to_possible_value(&m)
                .map_or_else(String::new, |v| v.get_name().to_string())
        }),
    }))
}

fn serve(a: ServeArgs) -> Result<()> {
    init_logging(a.verbose);
    let mut addr = serve::parse_host(&env_or(a.host, "MLX_RUNNER_HOST").unwrap_or_default())
        .map_err(anyhow::Error::msg)?;
    if let Some(p) = a.port {
        addr.set_port(p);
    }
    let count = |flag: Option<usize>, var: &str, default: usize| -> Result<usize> {
        match env_or(flag.map(|n| n.to_string()), var) {
            None => Ok(default),
            Some(v) => match v.trim().parse::<usize>() {
                Ok(n) if n > 0 => Ok(n),
                _ => anyhow::bail!("{var} must be a positive number, got {v:?}"),
            },
        }
    };
    let load_timeout = match duration_setting(
        env_or(a.load_timeout, "MLX_RUNNER_LOAD_TIMEOUT"),
        "load timeout",
        300,
    )? {
        serve::sched::KeepAlive::For(d) if !d.is_zero() => d,
        _ => std::time::Duration::from_secs(300),
    };
    let stall_timeout = match duration_setting(
        env_or(a.stall_timeout, "MLX_RUNNER_STALL_TIMEOUT"),
        "stall timeout",
        30,
    )? {
        serve::sched::KeepAlive::For(d) if !d.is_zero() => d,
        _ => anyhow::bail!("the stall timeout must be a positive duration"),
    };
    let cfg = serve::ServeConfig {
        addr,
        models: std::env::var_os("MLX_RUNNER_MODELS").map(PathBuf::from),
        keep_alive: duration_setting(
            env_or(a.keep_alive, "MLX_RUNNER_KEEP_ALIVE"),
            "keep alive",
            300,
        )?,
        max_loaded: count(a.max_loaded_models, "MLX_RUNNER_MAX_LOADED_MODELS", 3)?,
        parallel: count(a.num_parallel, "MLX_RUNNER_NUM_PARALLEL", 4)?,
        load_timeout,
        stall_timeout,
        memory_limit: env_or(a.memory_limit, "MLX_RUNNER_MEMORY_LIMIT")
            .map(|v| parse_bytes(&v).map_err(|e| anyhow::anyhow!("the memory limit: {e}")))
            .transpose()?,
        ranks: serve_ranks(a.hostfile, a.ring_port, a.parallel_mode)?,
        origins: env_or(a.origins, "MLX_RUNNER_ORIGINS")
            .map(|o| o.split(',').map(String::from).collect())
            .unwrap_or_default(),
        exe: std::env::current_exe().context("finding this executable")?,
        importer: std::sync::Arc::new(|st, name, mf, opts| {
            import::create_from(st, name, mf, std::path::Path::new("/"), opts).map_err(|e| {
                serve::ImportError {
                    internal: e.internal(),
                    message: e.to_string(),
                }
            })
        }),
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(serve::run(cfg))
}

#[derive(clap::Args)]
struct RunnerArgs {
    #[command(flatten)]
    draft: DraftArgs,
    #[command(flatten)]
    cluster: ClusterArgs,
    /// A model directory, or the name of a model in the store.
    #[arg(long)]
    model: String,
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
    /// Bytes the prefix cache may hold (default: a quarter of what the memory plan leaves
    /// once every sequence's KV cache at the full context is counted).
    #[arg(long)]
    cache_budget: Option<usize>,
    /// Bytes this runner may use in all, weights included (default: what the machine, or its
    /// cgroup, has available once the weights are loaded). The context and the prefix-cache
    /// budget are planned within it.
    #[arg(long, value_parser = parse_bytes)]
    memory_limit: Option<u64>,
    /// Prompt tokens between sliding-window snapshots kept by the prefix cache (and the
    /// length of the blocks its disk tier writes).
    #[arg(long, default_value_t = 256)]
    cache_interval: usize,
    /// The prefix cache's disk tier: blocks of finished sequences that a runner started again
    /// resumes from (default: `prefix-cache` in the store, for a stored model; none for a
    /// model directory).
    #[arg(long)]
    cache_dir: Option<PathBuf>,
    /// Bytes the disk tier's directory may hold, all models together (default: a tenth of the
    /// free space there, at most 10 GiB); 0 turns the tier off.
    #[arg(long, value_parser = parse_bytes)]
    cache_disk_budget: Option<u64>,
    /// What the KV caches store keys and values (GLM: latent rows) as: auto (the compute
    /// dtype), f32, f16, bf16, q8 or q4. f16 and bf16 halve a cached token's bytes; q8 and q4
    /// are MLX's affine quantization (groups of 64 values, or 32 where 64 does not divide a
    /// row; rows no group divides are stored as f16).
    #[arg(long, default_value = "auto")]
    kv_cache_type: models::KvCacheType,
    /// Log at debug level.
    #[arg(long)]
    verbose: bool,
    /// Accepted for compatibility with the ollama parent; ignored.
    #[arg(long)]
    mlx_engine: bool,
    /// Seconds a client has to send a request's headers (and, on a kept-alive connection, the
    /// next request's); then the connection is closed.
    #[arg(long, default_value_t = 10.0)]
    http_header_timeout: f64,
    /// Seconds a client has to send a request's whole body; then it gets a 408.
    #[arg(long, default_value_t = 60.0)]
    http_body_timeout: f64,
    /// Connections served at once; more get an immediate 503.
    #[arg(long, default_value_t = 512)]
    max_connections: usize,
}

#[derive(clap::Args)]
struct GenerateArgs {
    /// A model directory (config.json, *.safetensors, tokenizer.json, ...) or a stored model.
    #[arg(long)]
    model: String,
    /// The prompt text, tokenized as the model's tokenizer config says.
    #[arg(long)]
    prompt: String,
    /// Tokens to generate at most; ≤ 0: until EOS or the context is full (default: a stored
    /// model's num_predict, else 64).
    #[arg(short = 'n', long = "num-predict")]
    num_predict: Option<i32>,
    /// 0 is greedy (the default, unless a stored model's PARAMETERs say otherwise). Every
    /// sampling flag overrides the stored model's PARAMETER of the same name.
    #[arg(long)]
    temperature: Option<f32>,
    #[arg(long)]
    top_k: Option<i32>,
    #[arg(long)]
    top_p: Option<f32>,
    #[arg(long)]
    min_p: Option<f32>,
    #[arg(long)]
    repeat_penalty: Option<f32>,
    #[arg(long)]
    repeat_last_n: Option<i32>,
    #[arg(long)]
    presence_penalty: Option<f32>,
    #[arg(long)]
    frequency_penalty: Option<f32>,
    /// Default: unseeded (-1).
    #[arg(long)]
    seed: Option<i64>,
    /// Stop strings (repeatable; replace a stored model's).
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
    #[command(flatten)]
    cluster: ClusterArgs,
}

/// How a model is split over the ranks of a hostfile.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum ParallelMode {
    /// Contiguous layers per rank, balanced by their bytes; the hidden states pass from rank
    /// to rank.
    Pipeline,
    /// Every layer on every rank, each holding its share of the heads and hidden units; the
    /// output projections' partial products are summed over the ranks.
    Tensor,
}

#[derive(clap::Args, Clone)]
struct ClusterArgs {
    /// Split the model over the ranks this hostfile names (mlx.launch's JSON: one
    /// {"ssh": host, "ips": [addresses]} per rank); this process is rank 0 and starts the
    /// ranks on loopback addresses itself.
    #[arg(long)]
    hostfile: Option<PathBuf>,
    /// How the model is split over the ranks.
    #[arg(long, value_enum, default_value = "pipeline", requires = "hostfile")]
    parallel_mode: ParallelMode,
    /// The first port of the ranks' ring connections, one more per rank and address.
    #[arg(long, default_value_t = runner::cluster::DEFAULT_RING_PORT)]
    ring_port: u16,
    /// Seconds the ranks may take to connect before this one gives up.
    #[arg(long, default_value_t = 60.0)]
    join_timeout: f64,
    /// Seconds a step may wait on the other ranks before this one gives up (a rank that
    /// stalls ends the run with an error rather than a hang).
    #[arg(long, default_value_t = 120.0)]
    rank_timeout: f64,
    /// Split by layers, a pass of at least this many tokens (a prefill chunk, a large verify
    /// block) goes down the ranks as micro-batches, one per rank, so that they work at once;
    /// 0 keeps every pass whole.
    #[arg(long, default_value_t = 128)]
    micro_batch_tokens: usize,
    /// Leave the ranks this process starts on this machine to the scheduler, rather than
    /// giving each its own share of the CPUs.
    #[arg(long)]
    no_pin: bool,
}

#[derive(clap::Args)]
struct WorkerArgs {
    /// The hostfile rank 0 was given (the same ranks, in the same order).
    #[arg(long)]
    hostfile: PathBuf,
    /// This process's rank in the hostfile (1 and up).
    #[arg(long)]
    rank: usize,
    #[arg(long, default_value_t = runner::cluster::DEFAULT_RING_PORT)]
    ring_port: u16,
    #[arg(long, default_value_t = 60.0)]
    join_timeout: f64,
}

impl ClusterArgs {
    fn mode(&self) -> models::parallel::Mode {
        match self.parallel_mode {
            ParallelMode::Pipeline => models::parallel::Mode::Pipeline {
                micro_tokens: self.micro_batch_tokens,
            },
            ParallelMode::Tensor => models::parallel::Mode::Tensor,
        }
    }

    fn join_options(&self, hostfile: &std::path::Path, rank: usize) -> Result<JoinOptions> {
        Ok(JoinOptions {
            hostfile: hostfile.to_path_buf(),
            rank,
            ring_port: self.ring_port,
            timeout: seconds(self.join_timeout, "--join-timeout")?,
            pin: !self.no_pin,
        })
    }
}

/// A stored model is one file per module (hundreds), each held open by MLX's lazy reader until
/// loaded; raise the soft open-file limit to the hard one, as Go's runtime does for ollama.
fn raise_open_file_limit() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: plain syscalls on a local struct.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && lim.rlim_cur < lim.rlim_max {
            lim.rlim_cur = lim.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
    }
}

/// Hands jemalloc's free pages back to the system now, in every arena. Its decay is lazy (it
/// runs on later allocations), so an idle process would hold a large request's pages.
#[cfg(target_os = "linux")]
fn purge_jemalloc() {
    // MALLCTL_ARENAS_ALL.
    const ALL: &[u8] = b"arena.4096.purge\0";
    // SAFETY: a NUL-terminated control name; purge reads and writes nothing through the
    // pointers, which are null.
    unsafe {
        tikv_jemalloc_sys::mallctl(
            ALL.as_ptr().cast(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            0,
        );
    }
}

fn main() {
    raise_open_file_limit();
    #[cfg(target_os = "linux")]
    base::signals::set_memory_release(purge_jemalloc);
    // MLX's own kernels and op graphs instead of ours on the CPU (comparisons, bisecting).
    if std::env::var("MLX_RUNNER_KERNELS").as_deref() == Ok("mlx") {
        mlx::set_quantized_kernel(false);
        mlx::fast::set_fused_kernels(false);
    }
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Info => info(),
        Command::Generate(args) => generate(args),
        Command::Worker(args) => worker(args),
        Command::Runner(args) => runner(args),
        Command::Serve(args) => serve(args),
        Command::RenderWorker => serve::template::worker_main().context("rendering"),
        Command::Create(args) => create(args),
        Command::List => list(),
        Command::Show(args) => show(args),
        Command::Rm(args) => rm(args),
    };
    use std::io::Write;
    let code = match result {
        // A rank of a split model ends as an error does: MLX's ring group, destroyed by the
        // C++ static destructors, can hang the exit (`mlx::distributed::joined`).
        Ok(()) if mlx::distributed::joined() => 0,
        Ok(()) => return,
        Err(e) => {
            eprintln!("error: {e:#}");
            1
        }
    };
    let _ = std::io::stdout().flush();
    // An error can end the process while the engine thread is still inside MLX (a runner
    // interrupted while loading): `_exit` skips the C++ static destructors that thread would
    // race, which `exit` runs. Nothing else is left to flush.
    // SAFETY: `_exit` ends the process; no Rust state is observed afterwards.
    unsafe { libc::_exit(code) };
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
    println!("quantized  {}", mlx::quantized_kernel_description());
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
    stats: &runner::protocol::Stats,
) -> Result<()> {
    if a.json {
        let chunk = CompletionChunk::done(reason, String::new(), stats);
        writeln!(out, "{}", serde_json::to_string(&chunk)?)?;
    } else {
        writeln!(out)?;
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

fn init_logging(verbose: bool) {
    init_logging_at(if verbose { "debug" } else { "info" });
}

fn init_logging_at(level: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(level));
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(filter)
        .with_ansi(false)
        .init();
}

fn runner(a: RunnerArgs) -> Result<()> {
    init_logging(a.verbose);
    let _ = a.mlx_engine;
    check_ctx_size(a.ctx_size)?;
    if let Some(w) = reference_blas_warning() {
        tracing::warn!("{w}");
    }
    let (engine, model) = a.draft.engine(&a.model, a.dtype)?;
    let cluster = match &a.cluster.hostfile {
        None => None,
        Some(hostfile) => Some(runner::replica::LeadConfig {
            join: a.cluster.join_options(hostfile, 0)?,
            argv: std::env::args().skip(1).collect(),
            rank_timeout: seconds(a.cluster.rank_timeout, "--rank-timeout")?,
            mode: a.cluster.mode(),
            draft: match &engine.draft {
                Some(DraftSource::Model(files)) if models::is_assistant(files)? => Some(
                    files
                        .content_key()
                        .with_context(|| format!("reading {}", files.origin.display()))?,
                ),
                _ => None,
            },
        }),
    };
    let stored = &model.parameters;
    let cache_disk = disk_tier(
        a.cache_dir.clone(),
        model.store.as_deref(),
        a.cache_disk_budget,
    );
    // A stored model's num_ctx is the runner's context length unless --ctx-size says otherwise.
    // Its other PARAMETERs are not applied to requests: the parent merges them into each
    // request's options before sending it (as ollama's does), so a key it leaves out means
    // Go's zero value, not a stored default.
    let opts = RunnerOptions {
        engine: EngineConfig {
            ctx_size: a.ctx_size.or(stored_ctx(stored)),
            parallel: a.parallel,
            prefill_chunk: a.prefill_chunk,
            cache_budget: a.cache_budget,
            memory_limit: a.memory_limit.map(|b| b as usize),
            cache_interval: a.cache_interval,
            cache_disk,
            kv_cache: a.kv_cache_type,
            cluster,
            ..engine
        },
        host: a.host,
        port: a.port,
        http: runner::listen::HttpLimits {
            header_timeout: seconds(a.http_header_timeout, "--http-header-timeout")?,
            body_timeout: seconds(a.http_body_timeout, "--http-body-timeout")?,
            max_connections: a.max_connections.max(1),
            ..Default::default()
        },
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(runner::process::run(opts))
        .map_err(anyhow::Error::msg)
}

impl GenerateArgs {
    /// The request `generate` runs: the stored model's PARAMETERs, overridden by the flags
    /// given, read with the protocol's own rules (so a missing key means what it means on the
    /// wire), with this command's defaults of 64 tokens and no seed.
    fn request(
        &self,
        stored: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<CompletionRequest> {
        use serde_json::json;
        for (flag, v) in [
            ("temperature", self.temperature),
            ("top-p", self.top_p),
            ("min-p", self.min_p),
            ("repeat-penalty", self.repeat_penalty),
            ("presence-penalty", self.presence_penalty),
            ("frequency-penalty", self.frequency_penalty),
        ] {
            // JSON has no NaN or infinity (serde_json writes them as null, which reads as
            // "absent"): refuse them here rather than silently drop the flag.
            if v.is_some_and(|v| !v.is_finite()) {
                anyhow::bail!("--{flag} must be a finite number");
            }
        }
        let mut o = stored.clone();
        let flags = [
            ("num_predict", self.num_predict.map(|v| json!(v))),
            ("temperature", self.temperature.map(|v| json!(v))),
            ("top_k", self.top_k.map(|v| json!(v))),
            ("top_p", self.top_p.map(|v| json!(v))),
            ("min_p", self.min_p.map(|v| json!(v))),
            ("repeat_penalty", self.repeat_penalty.map(|v| json!(v))),
            ("repeat_last_n", self.repeat_last_n.map(|v| json!(v))),
            ("presence_penalty", self.presence_penalty.map(|v| json!(v))),
            (
                "frequency_penalty",
                self.frequency_penalty.map(|v| json!(v)),
            ),
            ("seed", self.seed.map(|v| json!(v))),
            ("stop", (!self.stop.is_empty()).then(|| json!(self.stop))),
        ];
        for (k, v) in flags {
            if let Some(v) = v {
                o.insert(k.into(), v);
            }
        }
        o.entry("num_predict").or_insert(json!(64));
        o.entry("seed").or_insert(json!(-1));
        // A stored `stop` may be one string.
        if let Some(serde_json::Value::String(s)) = o.get("stop").cloned() {
            o.insert("stop".into(), json!([s]));
        }
        let body = json!({
            "Prompt": self.prompt,
            "Options": o,
            "Logprobs": self.logprobs || self.top_logprobs > 0,
            "TopLogprobs": self.top_logprobs,
        });
        let req =
            CompletionRequest::parse(body.to_string().as_bytes()).map_err(anyhow::Error::msg)?;
        req.validate().map_err(anyhow::Error::msg)?;
        Ok(req)
    }
}

fn generate(a: GenerateArgs) -> Result<()> {
    check_ctx_size(a.ctx_size)?;
    if let Some(w) = reference_blas_warning() {
        eprintln!("warning: {w}");
    }
    let (cfg, model) = a.draft.engine(&a.model, a.dtype)?;
    let Some(hostfile) = a.cluster.hostfile.clone() else {
        return run_generate(a, cfg, model, None);
    };
    if a.draft.draft.is_some() && a.draft.draft_depth.0.is_none() && !a.draft.no_draft {
        anyhow::bail!(
            "--draft over ranks needs a fixed --draft-depth N: every rank drafts for itself, and \
             an adaptive depth follows each rank's own timings"
        );
    }
    if let Some(DraftSource::Model(files)) = &cfg.draft {
        // Over ranks only a fixed depth drafts (a stored model's draft included).
        let off = a.draft.no_draft || !matches!(a.draft.draft_depth.0, Some(n) if n > 0);
        if !off && models::is_assistant(files)? {
            anyhow::bail!(
                "the gemma4 assistant drafts on a split model only where rank 0 leads the other \
                 ranks (`runner --hostfile`), not in `generate`"
            );
        }
    }
    let opts = a.cluster.join_options(&hostfile, 0)?;
    let job = Job::of(
        std::env::args().skip(1).collect(),
        &cfg.model,
        // Seeds are non-negative i64s.
        sample::fresh_seed() >> 1,
    )
    .map_err(anyhow::Error::msg)?;
    let cluster = Cluster::lead(&opts, &job).map_err(anyhow::Error::msg)?;
    let run = run_generate(a, cfg, model, Some((&cluster, job.seed)));
    // Every rank ends with rank 0's last collective; a rank that failed is an error too, and
    // where both failed, the rank's exit says why the collective did.
    let finished = cluster.finish(std::time::Duration::from_secs(30));
    match (run, finished) {
        (Ok(()), Ok(())) => Ok(()),
        (Err(e), Err(rank)) if rank.killed => Err(e.context(rank.message)),
        (Err(e), _) => Err(e),
        (Ok(()), Err(rank)) => Err(anyhow::Error::msg(rank.message)),
    }
}

/// Ends a rank other than 0 after a failure rank 0 reports (as `main` ends on an error).
fn quiet_exit() -> ! {
    // SAFETY: ends the process; no Rust state is observed afterwards.
    unsafe { libc::_exit(1) }
}

/// A rank other than 0: joins, takes rank 0's command and runs it beside rank 0, printing
/// nothing (rank 0 prints).
fn worker(w: WorkerArgs) -> Result<()> {
    let opts = JoinOptions {
        hostfile: w.hostfile,
        rank: w.rank,
        ring_port: w.ring_port,
        timeout: seconds(w.join_timeout, "--join-timeout")?,
        pin: false,
    };
    if opts.rank == 0 {
        anyhow::bail!("--rank 0 is the process the hostfile is given to, not a worker");
    }
    // Rank 0 reports what the ranks do; a worker only what goes wrong on it, named.
    init_logging_at("warn");
    let _rank = tracing::warn_span!("rank", n = opts.rank).entered();
    let cluster = Cluster::join(&opts, |_| Vec::new()).map_err(anyhow::Error::msg)?;
    cluster.watch(Some(opts.timeout), "joining");
    let shared = cluster.share(None).map_err(anyhow::Error::msg)?;
    let job = serde_json::from_slice::<Job>(&shared)
        .map_err(|e| format!("rank 0 sent a job this rank cannot read: {e}"))
        .and_then(|job| {
            let mine = env!("CARGO_PKG_VERSION");
            if job.version != mine {
                return Err(format!(
                    "runs mlx-runner {mine}, rank 0 runs {}",
                    job.version
                ));
            }
            let argv = std::iter::once("mlx-runner".to_string()).chain(job.argv.clone());
            match Cli::try_parse_from(argv).map(|c| c.command) {
                Ok(Command::Generate(a)) => Ok((job, Followed::Generate(a))),
                Ok(Command::Runner(a)) => Ok((job, Followed::Runner(a))),
                Ok(_) => Err("rank 0 runs a command that ranks do not follow".into()),
                Err(e) => Err(format!("cannot read rank 0's command line: {e}")),
            }
        });
    // Rank 0 says which rank failed and why; the others end without repeating it.
    let quietly = |_: String| -> anyhow::Error { quiet_exit() };
    cluster
        .agree("joining", job.as_ref().map(|_| ()).map_err(Clone::clone))
        .map_err(quietly)?;
    let (job, followed) = job.map_err(anyhow::Error::msg)?;
    let (model_name, draft, dtype) = match &followed {
        Followed::Generate(a) => (a.model.clone(), &a.draft, a.dtype),
        Followed::Runner(a) => (a.model.clone(), &a.draft, a.dtype),
    };
    let prepared = draft.engine(&model_name, dtype).and_then(|(cfg, model)| {
        let key = cfg
            .model
            .content_key()
            .context("reading the model's files")?;
        anyhow::ensure!(
            key == job.model,
            "its copy of {model_name} differs from rank 0's"
        );
        Ok((cfg, model))
    });
    cluster
        .agree(
            "checking the model",
            prepared.as_ref().map(|_| ()).map_err(|e| format!("{e:#}")),
        )
        .map_err(quietly)?;
    let (mut cfg, model) = prepared?;
    match followed {
        Followed::Generate(a) => run_generate(a, cfg, model, Some((&cluster, job.seed))),
        Followed::Runner(a) => {
            let mode = a.cluster.mode();
            let (loaded, _) = cluster
                .load_stage(&cfg.model, a.dtype, models::parallel::Ends::First, mode)
                .map_err(quietly)?;
            // This rank's own disk tier where rank 0's runner keeps one: the same flags,
            // this host's store.
            cfg.cache_disk = disk_tier(
                a.cache_dir.clone(),
                model.store.as_deref(),
                a.cache_disk_budget,
            );
            cfg.cache_interval = a.cache_interval;
            cfg.kv_cache = a.kv_cache_type;
            let dtype = loaded.dtype;
            // This rank's part of a drafter split with the model (the gemma4 assistant's
            // layers); rank 0 runs every other drafter alone.
            let drafter = |target: &mut dyn models::CausalLm| match &cfg.draft {
                Some(DraftSource::Model(files)) if cfg.draft_depth != Some(0) => {
                    let name = files.origin.display();
                    // Rank 0 names its copy's key where the ranks load parts of it.
                    if let Some(want) = &job.draft {
                        let key = files
                            .content_key()
                            .map_err(|e| format!("draft {name}: {e}"))?;
                        if key != *want {
                            return Err(format!(
                                "its copy of the draft {name} differs from rank 0's"
                            ));
                        }
                    }
                    models::load_draft_follower(files, target, dtype, cfg.draft_position)
                        .map_err(|e| format!("draft {name}: {e}"))
                }
                _ => Ok(None),
            };
            runner::replica::serve_following(
                &cluster,
                loaded.model,
                a.kv_cache_type.0,
                mode,
                |architecture, place, drafts| {
                    let drafter = match (&cfg.draft, drafts) {
                        (Some(source), true) => source.identity(),
                        _ => "-".into(),
                    };
                    runner::engine::open_disk(&cfg, architecture, &drafter, place)
                },
                drafter,
            )
            .map_err(|e| match e {
                runner::replica::FollowError::Failed(m) => anyhow::Error::msg(m),
                runner::replica::FollowError::Refused => quiet_exit(),
            })
        }
    }
}

/// The commands a rank other than 0 follows.
enum Followed {
    Generate(GenerateArgs),
    Runner(RunnerArgs),
}

/// `generate`'s work, alone or as one rank of `cluster` (with the seed every rank's sampler
/// takes where the request has none); only rank 0 prints.
fn run_generate(
    a: GenerateArgs,
    mut cfg: EngineConfig,
    model: ModelContext,
    cluster: Option<(&Cluster, u64)>,
) -> Result<()> {
    let stored = model.parameters;
    let req = a.request(&stored)?;
    let loaded = match cluster {
        None => models::load_files(&cfg.model, a.dtype).map_err(anyhow::Error::from),
        Some((c, _)) => {
            // Every rank runs the same loop, its drafter included (prompt lookup, or a draft
            // model each rank loads whole): they draft alike at a fixed depth, verify against
            // the same logits and accept alike. An adaptive depth follows each rank's own
            // timings, so without a fixed one none drafts (a stored model's draft included).
            if cfg.draft_depth.is_none() {
                cfg.draft_depth = Some(0);
            }
            let mode = a.cluster.mode();
            match c.load_stage(
                &cfg.model,
                a.dtype,
                models::parallel::Ends::Everywhere,
                mode,
            ) {
                Ok((loaded, held)) => {
                    if c.rank() == 0 {
                        for (rank, h) in held.iter().enumerate() {
                            eprintln!(
                                "rank {rank}: layers {}..{}, weights {:.1} MB",
                                h.layers.start,
                                h.layers.end,
                                h.weights as f64 / 1e6
                            );
                        }
                        if let Some(pinned) = c.pinned() {
                            eprintln!("ranks on this machine: {pinned}");
                        }
                    }
                    Ok(loaded)
                }
                // Rank 0 says which rank failed and why; the others end without repeating it.
                Err(_) if c.rank() != 0 => quiet_exit(),
                Err(e) => Err(anyhow::Error::msg(e)),
            }
        }
    };
    let mut loaded = loaded?;
    let quiet = cluster.is_some_and(|(c, _)| c.rank() != 0);
    if let Some((c, _)) = cluster {
        c.watch(
            Some(seconds(a.cluster.rank_timeout, "--rank-timeout")?),
            "generating",
        );
    }
    let draft = runner::engine::load_drafter(&cfg, &mut loaded).map_err(anyhow::Error::msg)?;
    let mut controller = runner::depth::DepthController::new(cfg.max_draft_depth, cfg.draft_depth);
    let max_ctx = loaded.model.max_context();
    let num_ctx = req.num_ctx(
        a.ctx_size
            .or(stored_ctx(&stored))
            .unwrap_or(max_ctx)
            .min(max_ctx),
    );
    let prompt = loaded.tokenizer.encode(&a.prompt)?;
    let mut options = req.sampler_options();
    if let Some((_, seed)) = cluster.filter(|_| options.seed < 0) {
        options.seed = seed as i64;
    }
    let params = GenerationParams {
        prompt,
        options,
        num_predict: req.num_predict(),
        num_ctx,
        prefill_chunk: a.prefill_chunk,
        eos: loaded.tokenizer.eos_ids().to_vec(),
        checkpoints: Vec::new(),
        snapshot_every: None,
        constraint: None,
        media: Vec::new(),
    };
    let tok = &loaded.tokenizer;
    let mut sampler = Sampler::new(num_ctx);
    let mut ctx = Ctx {
        model: &*loaded.model,
        sampler: &mut sampler,
        draft: draft.as_deref().map(|d| (d, &mut controller)),
        towers: None,
    };
    let mut g = Generation::new(&mut ctx, 0, params)?;
    let mut text = TextStream::new(&req.options.stop);
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let mut stopped = false;
    let print = |out: &mut std::io::StdoutLock, piece: TextPiece| -> Result<()> {
        if quiet || piece.text.is_empty() {
            return Ok(());
        }
        if a.json {
            let lp = (!piece.logprobs.is_empty()).then_some(piece.logprobs);
            let chunk = CompletionChunk::content(piece.text, lp);
            writeln!(out, "{}", serde_json::to_string(&chunk)?)?;
        } else {
            write!(out, "{}", piece.text)?;
        }
        out.flush().context("writing to stdout")
    };
    // A round can finish the sequence with tokens (and its end) still queued: hand those out
    // too.
    while !g.is_finished() || g.has_ready() {
        let ev = g.step(&mut ctx)?;
        if let Some((c, _)) = cluster {
            c.progress();
        }
        let Some(ev) = ev else {
            continue;
        };
        match ev {
            Event::Token { id, logprob } => {
                let piece = text.push(tok, id, logprob.as_ref())?;
                let ended = piece.stopped;
                print(&mut out, piece)?;
                if ended {
                    stopped = true;
                    g.cancel(&mut ctx);
                    let stats = g.stats().clone();
                    if !quiet {
                        finish(&mut out, &a, runner::protocol::DoneReason::Stop, &stats)?;
                    }
                }
            }
            Event::Done { reason, stats } => {
                if !stopped {
                    print(&mut out, text.finish(tok)?)?;
                }
                if !quiet {
                    finish(&mut out, &a, reason, &stats)?;
                }
            }
            Event::Rejected(m) | Event::Error(m) => anyhow::bail!(m),
        }
    }
    if let Some((c, _)) = cluster {
        let peaks = c
            .gather(&[runner::cluster::peak_resident() as i64])
            .map_err(anyhow::Error::msg)?;
        if !quiet {
            let mb: Vec<String> = peaks
                .iter()
                .map(|p| format!("{:.1}", p[0] as f64 / 1e6))
                .collect();
            eprintln!("peak resident MB by rank: {}", mb.join(" "));
        }
    }
    Ok(())
}

fn create(a: CreateArgs) -> Result<()> {
    let name = model_name(&a.name)?;
    let st = open_store()?;
    let opts = store::CreateOptions {
        quantize: a.quantize,
        quantize_draft: a.quantize_draft,
    };
    let start = std::time::Instant::now();
    let r = import::create(&st, &name, &a.file, &opts)?;
    let describe = |p: &store::PartSummary| {
        let precisions: Vec<String> = p
            .precisions
            .iter()
            .map(|(k, n)| format!("{n} {k}"))
            .collect();
        let kind = if p.file_type.is_empty() {
            "unquantized"
        } else {
            &p.file_type
        };
        format!(
            "{} {kind} ({} tensors)",
            p.architecture,
            precisions.join(", ")
        )
    };
    println!("model  {}", describe(&r.target));
    if let Some(d) = &r.draft {
        println!("draft  {}", describe(d));
    }
    println!(
        "created {name} (id {}, {} layers, {:.1} MB) in {:.1}s",
        &r.digest[..12],
        r.layers,
        r.bytes as f64 / 1e6,
        start.elapsed().as_secs_f64()
    );
    Ok(())
}

fn list() -> Result<()> {
    let (st, note) = open_store_swept()?;
    if let Some(n) = note {
        eprintln!("{n}");
    }
    // Ours, then the safetensors models of ollama's store (which the runner loads by name when
    // ours has none of that name), marked as such.
    let mut rows: Vec<(store::Listed, &str)> = st.list()?.into_iter().map(|m| (m, "")).collect();
    let ollama = store::Store::ollama_root()
        .filter(|r| r != st.root() && r.is_dir())
        .map(store::Store::open);
    if let Some(o) = &ollama {
        let ours: std::collections::HashSet<String> =
            rows.iter().map(|(m, _)| m.name.to_string()).collect();
        for m in o.list().unwrap_or_default() {
            if !ours.contains(&m.name.to_string()) && o.is_safetensors(&m.name) {
                rows.push((m, "  (ollama)"));
            }
        }
    }
    println!("{:<40} {:<14} {:>10}  MODIFIED", "NAME", "ID", "SIZE");
    for (m, whose) in rows {
        let age = m.modified.elapsed().map(|d| d.as_secs()).unwrap_or(0);
        let ago = match age {
            s if s < 60 => format!("{s} seconds ago"),
            s if s < 3600 => format!("{} minutes ago", s / 60),
            s if s < 86400 => format!("{} hours ago", s / 3600),
            s => format!("{} days ago", s / 86400),
        };
        println!(
            "{:<40} {:<14} {:>7.1} MB  {ago}{whose}",
            m.name.to_string(),
            &m.digest[..12],
            m.size as f64 / 1e6
        );
    }
    Ok(())
}

fn show(a: ShowArgs) -> Result<()> {
    let name = model_name(&a.name)?;
    let (st, r) = resolve_stored(&name)?
        .map_err(|searched| anyhow::anyhow!("model {name} not found in {searched}"))?;
    if a.modelfile {
        print!("{}", store::show::modelfile(&st, &r)?);
    } else {
        print!("{}", store::show::describe_with(&st, &r, a.verbose)?);
    }
    Ok(())
}

fn rm(a: RmArgs) -> Result<()> {
    let st = open_store()?;
    for n in &a.names {
        let name = model_name(n)?;
        let (blobs, bytes) = st.remove(&name)?;
        println!(
            "deleted {name} ({blobs} unused blobs, {:.1} MB, removed)",
            bytes as f64 / 1e6
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::parse_bytes;

    #[test]
    fn bytes_are_read_with_their_units() {
        assert_eq!(parse_bytes("1000"), Ok(1000));
        assert_eq!(parse_bytes("512MB"), Ok(512_000_000));
        assert_eq!(parse_bytes("64GiB"), Ok(64 << 30));
        assert_eq!(parse_bytes(" 1.5g "), Ok(3 << 29));
        assert_eq!(parse_bytes("2 KiB"), Ok(2048));
        for bad in ["", "GiB", "-1", "12 parsecs", "0", "1e40"] {
            assert!(parse_bytes(bad).is_err(), "{bad}");
        }
    }
}
