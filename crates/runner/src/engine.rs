//! The engine thread (docs/ARCHITECTURE.md, D3): the one OS thread that owns MLX, the model, the caches and
//! the sampler. HTTP handlers send it jobs over a channel and receive token events back.
//!
//! Sequences live in slots. Up to `parallel` run at once, stepped round-robin (a prefill chunk
//! or a decode step each turn), so a long prompt never stalls other streams and no request
//! starves; the rest wait in arrival order. Each step dispatches its successor before reading
//! its own token, so the device keeps working while the host hands results out.

use crate::depth::DepthController;
use crate::generation::{seq_of, Ctx, Event, GenerateError, Generation, GenerationParams};
use crate::memory;
use crate::metrics::Metrics;
use crate::replica::{CacheOp, RestoreOp};
use base::protocol::Stats;
use cache::disk::{DiskConfig, DiskStats, DiskTier};
use cache::prefix::PrefixCache;
use models::draft::ngram::Ngram;
use models::{DraftOptions, Drafter, DtypeChoice, KvCacheType, LoadedModel, ModelFiles, Tokenizer};
use sample::Sampler;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, Sender, TryRecvError};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc::UnboundedSender, oneshot};

#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// The target's files: a checkpoint directory or a stored model.
    pub model: ModelFiles,
    pub dtype: DtypeChoice,
    /// Context length; defaults to the model's maximum, cut to what the memory holds
    /// ([`crate::memory::plan`]). One asked for that cannot be held fails the load.
    pub ctx_size: Option<usize>,
    /// Sequences stepped concurrently.
    pub parallel: usize,
    pub prefill_chunk: usize,
    /// Bytes the prefix cache may hold; `None`: a share of what the memory plan leaves.
    pub cache_budget: Option<usize>,
    /// Bytes the runner may use in all, weights included; `None`: what the machine has
    /// available once the weights are loaded.
    pub memory_limit: Option<usize>,
    /// Prompt tokens between sliding-window snapshots, and the disk tier's block length.
    pub cache_interval: usize,
    /// The prefix cache's disk tier (what a runner started again resumes from); `None`: off.
    pub cache_disk: Option<DiskConfig>,
    /// What the KV caches (target's and drafter's) store keys and values as; `Auto`: the
    /// compute dtype.
    pub kv_cache: KvCacheType,
    /// The drafter (`--draft`, or the draft a stored model carries); GLM's own MTP layer is
    /// used when there is none.
    pub draft: Option<DraftSource>,
    /// `None`: adaptive; `Some(0)` turns drafting off.
    pub draft_depth: Option<usize>,
    /// The deepest round the adaptive controller considers.
    pub max_draft_depth: usize,
    pub draft_position: models::gemma4_assistant::QueryPosition,
    /// The model split by layers over the ranks of a hostfile, this process leading
    /// (docs/DISTRIBUTED.md, "Serving").
    pub cluster: Option<crate::replica::LeadConfig>,
}

/// Where a drafter comes from.
#[derive(Debug, Clone)]
pub enum DraftSource {
    /// A checkpoint: a gemma4 assistant or a separate small model with the target's tokenizer.
    Model(ModelFiles),
    /// Prompt lookup: drafts from the sequence's own context (`--draft ngram`).
    Ngram,
}

impl DraftSource {
    /// What the drafter's outputs depend on, for the disk tier's key.
    pub fn identity(&self) -> String {
        match self {
            DraftSource::Model(f) => f.identity(),
            DraftSource::Ngram => "ngram".into(),
        }
    }
}

/// Loads the drafter the configuration asks for (or the target's built-in one), preparing the
/// target's caches for it and for the configuration's cache type.
pub fn load_drafter(
    cfg: &EngineConfig,
    target: &mut LoadedModel,
) -> Result<Option<Box<dyn Drafter>>, String> {
    let kv = cfg.kv_cache.0;
    target.model.set_cache_format(kv);
    if cfg.draft_depth == Some(0) {
        return Ok(None);
    }
    match &cfg.draft {
        Some(DraftSource::Model(files)) => {
            let opts = DraftOptions {
                dtype: cfg.dtype,
                cache_format: kv,
                slack: cfg.draft_depth.unwrap_or(cfg.max_draft_depth).max(1),
                position: cfg.draft_position,
            };
            models::load_draft_files(files, target, opts)
                .map(Some)
                .map_err(|e| format!("draft {}: {e}", files.origin.display()))
        }
        Some(DraftSource::Ngram) => Ok(Some(Box::new(Ngram::default()))),
        None => Ok(target.model.builtin_drafter()),
    }
}

pub struct CompletionJob {
    pub params: GenerationParams,
    pub events: UnboundedSender<Event>,
    /// Set by the HTTP side when the client goes away or a stop string ends the text.
    pub cancel: Arc<AtomicBool>,
    pub received: Instant,
}

pub enum Job {
    Complete(Box<CompletionJob>),
    /// Ends every stream and stops the engine.
    Shutdown,
}

/// State the engine publishes for the HTTP side.
#[derive(Default)]
pub struct Shared {
    pub tokenizer: OnceLock<Arc<Tokenizer>>,
    pub context_length: AtomicUsize,
    /// The width of the model's logits (for structured output's masks).
    pub vocab_size: AtomicUsize,
    /// Structured output's view of the vocabulary, built on the first request that needs it.
    pub grammar: OnceLock<std::result::Result<Arc<grammar::Vocabulary>, String>>,
    /// MLX active + cache bytes, refreshed by the engine after every turn.
    pub memory: AtomicU64,
    /// The memory plan's: what was available after the weights, and the prefix cache's share.
    pub memory_available: AtomicU64,
    pub cache_budget: AtomicU64,
    pub cache_memory: AtomicU64,
    /// The disk tier's counters and its budget, once it is open.
    pub disk: OnceLock<(Arc<DiskStats>, u64)>,
    pub metrics: Metrics,
    pub architecture: OnceLock<&'static str>,
    /// What a prompt needs to hold images and audio, for a model that takes them (set at
    /// load).
    pub media: OnceLock<models::media::MediaPrompt>,
    /// Set when a rank of a split model was lost: the runner must end.
    pub rank_lost: Arc<AtomicBool>,
}

impl Shared {
    pub fn ready(&self) -> bool {
        self.tokenizer.get().is_some()
    }
}

pub struct EngineHandle {
    pub jobs: Sender<Job>,
    pub shared: Arc<Shared>,
    /// Resolves once with the outcome of loading the model.
    pub loaded: oneshot::Receiver<Result<(), String>>,
    pub thread: std::thread::JoinHandle<()>,
}

/// Starts the engine thread, which loads the model and then serves jobs.
pub fn spawn(cfg: EngineConfig) -> std::io::Result<EngineHandle> {
    let (tx, rx) = std::sync::mpsc::channel();
    let (loaded_tx, loaded) = oneshot::channel();
    let shared = Arc::new(Shared::default());
    let s = Arc::clone(&shared);
    let thread = std::thread::Builder::new()
        .name("mlx-engine".into())
        .spawn(move || engine_main(cfg, rx, s, loaded_tx))?;
    Ok(EngineHandle {
        jobs: tx,
        shared,
        loaded,
        thread,
    })
}

fn engine_main(
    cfg: EngineConfig,
    rx: Receiver<Job>,
    shared: Arc<Shared>,
    loaded: oneshot::Sender<Result<(), String>>,
) {
    if let Err(e) = mlx::init_thread() {
        let _ = loaded.send(Err(e.to_string()));
        return;
    }
    let loaded_model = match &cfg.cluster {
        None => models::load_files(&cfg.model, cfg.dtype)
            .map(|m| (m, None))
            .map_err(|e| e.to_string()),
        Some(lead) => {
            crate::replica::lead(&cfg.model, cfg.dtype, lead, Arc::clone(&shared.rank_lost))
                .map(|(m, l)| (m, Some(l)))
        }
    };
    let (mut model, lockstep) = match loaded_model {
        Ok(m) => m,
        Err(e) => {
            let _ = loaded.send(Err(e));
            return;
        }
    };
    // A split model's drafter runs on rank 0 (the gemma4 assistant's layers split with the
    // model, rank 0 leading their passes); verify blocks are forward passes like any other,
    // and the other ranks rewind where rank 0 did. Its prefix cache runs in lockstep
    // (`lockstep`), its disk tier too: each rank writes and reads blocks of its own caches.
    // A failure from here on lets the model go before it is reported: a split model's other
    // ranks are told to stop and have ended by then, so rank 0's error is its last word.
    let mut draft = load_drafter(&cfg, &mut model);
    // The other ranks load their part of a drafter split with the model (the assistant's
    // layers) meanwhile: every rank says whether it could.
    if let Some(l) = &lockstep {
        let verdict = draft.as_ref().map(|_| ()).map_err(Clone::clone);
        if let Err(e) = l.agree("loading the drafter", verdict) {
            // The other ranks end on a failed agreement: nothing to tell them at the drop.
            shared.rank_lost.store(true, Ordering::SeqCst);
            draft = Err(e);
        }
    }
    let draft = match draft {
        Ok(d) => d,
        Err(e) => {
            drop(model);
            let _ = loaded.send(Err(e));
            return;
        }
    };
    // Before the memory plan, which counts what the weights took.
    // Split over ranks, the towers run on rank 0, which sends the other ranks the soft tokens
    // with each pass that places them (crate::replica).
    let towers = models::media::Towers::load(&cfg.model, cfg.dtype);
    let (towers, media) = match towers {
        Ok(v) => v,
        Err(e) => {
            drop(model);
            let _ = loaded.send(Err(format!("media towers: {e}")));
            return;
        }
    };
    let _ = shared.media.set(media);
    if let Some(d) = &draft {
        tracing::info!(drafter = d.name(), "speculative decoding on");
    }
    let plan = match plan_memory(&cfg, &model, draft.as_deref()) {
        Ok(p) => p,
        Err(e) => {
            drop((draft, model));
            let _ = loaded.send(Err(e));
            return;
        }
    };
    let ctx_len = plan.context;
    shared.context_length.store(ctx_len, Ordering::Relaxed);
    shared
        .memory_available
        .store(plan.available as u64, Ordering::Relaxed);
    shared
        .cache_budget
        .store(plan.prefix_budget as u64, Ordering::Relaxed);
    shared
        .vocab_size
        .store(model.model.vocab_size(), Ordering::Relaxed);
    let _ = shared.architecture.set(model.model.architecture());
    let rotates = lockstep
        .as_ref()
        .is_some_and(crate::replica::Lockstep::rotates);
    let controllers = (0..BATCH_BUCKETS)
        .map(|_| DepthController::new(cfg.max_draft_depth, cfg.draft_depth))
        .collect();
    let drafter = match (draft.as_deref(), &cfg.draft) {
        (Some(_), Some(source)) => source.identity(),
        (Some(d), None) => d.name().to_string(),
        (None, _) => "-".into(),
    };
    let place = lockstep
        .as_ref()
        .map(crate::replica::Lockstep::place)
        .unwrap_or_default();
    let disk = open_disk(&cfg, model.model.architecture(), &drafter, &place);
    if let Some(d) = &disk {
        let _ = shared.disk.set((Arc::clone(d.stats()), d.budget()));
    }
    let mut engine = Engine {
        towers,
        disk,
        draft,
        controllers,
        prefix: PrefixCache::new(plan.prefix_budget, cfg.cache_interval).rotating(rotates),
        lockstep,
        sampler: Sampler::new(ctx_len),
        model,
        cfg,
        shared,
        active: Vec::new(),
        queue: VecDeque::new(),
        next_slot: 0,
        chunk_seconds: None,
    };
    engine.publish_memory();
    // The tokenizer going public is what makes the runner ready.
    let _ = engine
        .shared
        .tokenizer
        .set(Arc::clone(&engine.model.tokenizer));
    let _ = loaded.send(Ok(()));
    engine.run(rx);
}

/// The disk tier, when configured and usable (a directory that cannot be used turns it off with
/// a warning: it is a cache, not a reason to refuse to serve). `drafter` names the drafter
/// whose caches this process keeps beside the model's ("-" for none); `place` is this
/// process's share of a split model (empty for a whole one).
pub fn open_disk(
    cfg: &EngineConfig,
    architecture: &str,
    drafter: &str,
    place: &str,
) -> Option<DiskTier> {
    let d = cfg.cache_disk.as_ref().filter(|d| d.budget > 0)?;
    // What the caches' contents depend on: the code (our version, MLX's), the weights, the
    // drafter's, the compute dtype, the cache type, the device and which share of a split
    // model this process holds (two stages' caches may have the same layout and other
    // contents; the layout of the caches themselves is part of each block's name).
    let key = format!(
        "{} {}|{}|{}|{}|{:?}|{:?}|{}{place}",
        env!("CARGO_PKG_VERSION"),
        mlx::version(),
        architecture,
        cfg.model.identity(),
        drafter,
        cfg.dtype,
        cfg.kv_cache,
        mlx::default_device(),
    );
    match DiskTier::open(d, &key, cfg.cache_interval.max(1)) {
        Ok(t) => {
            tracing::info!(
                dir = %d.dir.display(),
                budget = %memory::Bytes(d.budget as usize),
                held = %memory::Bytes(t.stats().bytes.load(Ordering::Relaxed) as usize),
                "prefix cache disk tier"
            );
            Some(t)
        }
        Err(e) => {
            tracing::warn!(
                "prefix cache disk tier off: cannot use {}: {e}",
                d.dir.display()
            );
            None
        }
    }
}

/// The memory plan for this model and configuration, logged; its error is the load's.
fn plan_memory(
    cfg: &EngineConfig,
    model: &LoadedModel,
    draft: Option<&dyn Drafter>,
) -> Result<memory::MemoryPlan, String> {
    let cost = memory::measure(model, draft)?;
    let weights = mlx::memory::active();
    let (available, source) = match cfg.memory_limit {
        Some(limit) if limit <= weights => {
            return Err(format!(
                "the weights alone take {}, more than --memory-limit {}",
                memory::Bytes(weights),
                memory::Bytes(limit)
            ))
        }
        Some(limit) => (limit - weights, "--memory-limit less the weights"),
        None => match base::machine::machine_available() {
            Some(a) => (a, "available on this machine after loading the weights"),
            None => (
                mlx::memory::limit().saturating_sub(weights),
                "MLX's memory limit less the weights",
            ),
        },
    };
    let plan = memory::plan(&memory::PlanInput {
        available,
        source,
        cost,
        sequences: cfg.parallel.max(1),
        chunk: cfg.prefill_chunk.max(1),
        max_context: model.model.max_context(),
        asked_context: cfg.ctx_size,
        asked_budget: cfg.cache_budget,
    })?;
    if let Some(max) = plan.clamped_from {
        tracing::warn!(
            "context cut from the model's {max} tokens to {}: {} of KV cache for {} is what \
             fits in half of the {} {source} (--ctx-size, --parallel or --memory-limit change \
             it)",
            plan.context,
            memory::Bytes(plan.live_caches),
            memory::sequences(cfg.parallel.max(1)),
            memory::Bytes(available),
        );
    }
    tracing::info!(
        context = plan.context,
        kv_cache = %memory::Bytes(plan.live_caches),
        prefix_cache_budget = %memory::Bytes(plan.prefix_budget),
        available = %memory::Bytes(available),
        "memory plan"
    );
    Ok(plan)
}

/// Tells a split model's other ranks (`l`) of the snapshots `gen` took since it last did.
fn report_snapshots(l: &crate::replica::Lockstep, gen: &mut Generation) {
    let seq = gen.seq();
    for at in gen.unreported_snapshots() {
        l.queue(CacheOp::Snapshot { seq, at });
    }
}

/// Batch sizes with a depth controller of their own: 1, 2, 3–4, 5–8, more.
const BATCH_BUCKETS: usize = 5;

fn bucket(rows: usize) -> usize {
    match rows {
        0 | 1 => 0,
        2 => 1,
        3 | 4 => 2,
        5..=8 => 3,
        _ => 4,
    }
}

struct Active {
    gen: Generation,
    job: CompletionJob,
    /// Speculative rounds so far.
    rounds: usize,
    /// An engine error left its caches in an unknown state: keep nothing of it.
    failed: bool,
}

impl Active {
    /// The client went away, or a stop string ended the text off-engine.
    fn cancelled(&self) -> bool {
        self.job.cancel.load(Ordering::Relaxed) || self.job.events.is_closed()
    }
}

struct Engine {
    model: LoadedModel,
    /// The media towers (vision, audio), for a model that takes them.
    towers: models::media::Towers,
    sampler: Sampler,
    draft: Option<Box<dyn Drafter>>,
    /// Depth controllers by how many sequences decode or draft in a step ([`bucket`]): what a
    /// drafted token costs depends on the batch around it (each row's drafter runs on its own,
    /// while the target's step is shared), so each batch size learns its own depth, from the
    /// whole step's time; a large batch learns to draft shallower, down to not at all.
    controllers: Vec<DepthController>,
    prefix: PrefixCache,
    /// A split model's line to its other ranks, which repeat the prefix cache's calls.
    lockstep: Option<crate::replica::Lockstep>,
    /// Blocks of finished sequences on disk, for runners started later (and this one, once
    /// memory evicted them).
    disk: Option<DiskTier>,
    cfg: EngineConfig,
    shared: Arc<Shared>,
    active: Vec<Active>,
    queue: VecDeque<CompletionJob>,
    next_slot: usize,
    /// What a step with a prefill chunk takes (a moving average, seconds): the time a media
    /// encoder may take in a step that other sequences share.
    chunk_seconds: Option<f64>,
}

impl Engine {
    fn run(&mut self, rx: Receiver<Job>) {
        loop {
            // Wait for work when idle; otherwise take whatever has arrived and keep stepping.
            let incoming = if self.active.is_empty() && self.queue.is_empty() {
                match rx.recv() {
                    Ok(j) => vec![j],
                    Err(_) => return,
                }
            } else {
                let mut v = Vec::new();
                loop {
                    match rx.try_recv() {
                        Ok(j) => v.push(j),
                        Err(TryRecvError::Empty) => break,
                        Err(TryRecvError::Disconnected) => {
                            v.push(Job::Shutdown);
                            break;
                        }
                    }
                }
                v
            };
            for job in incoming {
                match job {
                    Job::Complete(j) => self.queue.push_back(*j),
                    Job::Shutdown => {
                        self.shutdown();
                        return;
                    }
                }
            }
            self.admit();
            self.turn();
            self.publish_memory();
        }
    }

    /// Empty caches for one sequence: the target's, then the drafter's own.
    fn fresh_caches(&self) -> Vec<cache::LayerCache> {
        let mut c = self.model.model.make_caches();
        if let Some(d) = &self.draft {
            let own = d.make_caches(&c);
            c.extend(own);
        }
        c
    }

    fn publish_memory(&self) {
        let m = mlx::memory::active() + mlx::memory::cache();
        self.shared.memory.store(m as u64, Ordering::Relaxed);
    }

    fn admit(&mut self) {
        while self.active.len() < self.cfg.parallel.max(1) {
            let Some(job) = self.queue.pop_front() else {
                break;
            };
            if job.cancel.load(Ordering::Relaxed) {
                self.shared
                    .metrics
                    .requests_cancelled
                    .fetch_add(1, Ordering::Relaxed);
                continue;
            }
            let slot = self.next_slot;
            self.next_slot += 1;
            // The prefix cache knows a prompt by its key: its images by their contents.
            let key = job.params.cache_key(&job.params.prompt);
            let prompt = &key;
            let fresh = self.fresh_caches();
            let layers = fresh.len();
            let mut restored = match self.prefix.restore(prompt, fresh) {
                Ok(r) => r,
                Err(e) => {
                    tracing::warn!("prefix cache restore failed, starting cold: {e}");
                    self.cold(0)
                }
            };
            let m = &self.shared.metrics;
            if let Some(disk) = &self.disk {
                if let Some(d) = disk.restore(prompt, self.fresh_caches(), restored.cached) {
                    m.disk_hits.fetch_add(1, Ordering::Relaxed);
                    m.disk_tokens
                        .fetch_add(d.restored.cached as u64, Ordering::Relaxed);
                    let matched = restored.matched.max(d.restored.matched);
                    restored = cache::prefix::Restored {
                        matched,
                        ..d.restored
                    };
                }
            }
            // A drafter may need to start a few positions before what was stored (GLM's MTP row
            // at the last stored position pairs it with the stored sequence's next token, which
            // this prompt need not share: greedy output would not change, but acceptance and
            // seeded draws would depend on what was stored).
            // Nor may it end inside an image (an image is encoded whole, in one chunk).
            let margin = self.draft.as_ref().map_or(0, |d| d.restore_margin());
            let keep = job
                .params
                .restorable(restored.cached.saturating_sub(margin));
            let found = restored.cached;
            if restored.cached > keep {
                let back = restored.cached - keep;
                if restored.caches.iter_mut().all(|c| c.rewind(back).is_ok()) {
                    restored.cached -= back;
                } else {
                    restored = self.cold(restored.matched);
                }
            }
            if let Some(l) = &self.lockstep {
                // The other ranks look the prompt up as far as this lookup read it, and
                // restore what was restored here if they can.
                let seen = prompt[..prompt.len().min(restored.matched + 1)].to_vec();
                if restored.cached == 0 {
                    l.queue(CacheOp::Lookup {
                        key: layers,
                        prompt: seen,
                    });
                } else {
                    let op = RestoreOp {
                        seq: seq_of(slot),
                        key: layers,
                        prompt: seen,
                        at: found,
                        back: found - restored.cached,
                    };
                    // A lost rank: the next pass fails every stream and the runner ends.
                    let agreed = match l.restore(op) {
                        Ok(true) => true,
                        Ok(false) => {
                            tracing::warn!(
                                "another rank could not restore the cached prefix: starting cold"
                            );
                            false
                        }
                        Err(e) => {
                            tracing::error!("the model's other ranks failed: {e}");
                            false
                        }
                    };
                    if !agreed {
                        restored = self.cold(restored.matched);
                    }
                }
            }
            // Every item the restored prefix does not hold runs through its tower once.
            for item in job.params.media.iter().filter(|i| i.at >= restored.cached) {
                match item.input.kind() {
                    models::MediaKind::Image => &m.images_encoded,
                    models::MediaKind::Audio => &m.audio_encoded,
                }
                .fetch_add(1, Ordering::Relaxed);
            }
            if restored.cached > 0 {
                m.cache_hits.fetch_add(1, Ordering::Relaxed);
                m.cached_tokens
                    .fetch_add(restored.cached as u64, Ordering::Relaxed);
                let usable = restored.matched.min(prompt.len().saturating_sub(1));
                m.recomputed_tokens
                    .fetch_add((usable - restored.cached) as u64, Ordering::Relaxed);
            } else {
                m.cache_misses.fetch_add(1, Ordering::Relaxed);
            }
            let mut params = job.params.clone();
            if self.prefix.needs_checkpoints(&restored.caches) {
                params.checkpoints =
                    self.prefix
                        .plan(prompt.len(), restored.cached, restored.matched);
                params.snapshot_every = Some(self.cfg.cache_interval.max(1));
            }
            let shared = Arc::clone(&self.shared);
            self.with_ctx(0, |ctx, active, _| {
                match Generation::with_caches(ctx, slot, params, restored.caches, restored.cached) {
                    Ok(gen) => active.push(Active {
                        gen,
                        job,
                        rounds: 0,
                        failed: false,
                    }),
                    Err(e) => {
                        // A split model's other ranks may hold its restored caches.
                        ctx.model.release(seq_of(slot));
                        let m = &shared.metrics;
                        let counter = match e {
                            GenerateError::BadRequest(_) => &m.bad_requests,
                            _ => &m.requests_failed,
                        };
                        counter.fetch_add(1, Ordering::Relaxed);
                        let _ = job.events.send(e.into());
                    }
                }
            });
        }
    }

    /// One turn: every active sequence does one piece of work, in one packed forward pass
    /// ([`crate::step::run`]) that reads the weights once for all of them: decode steps,
    /// speculative rounds' verify blocks (each drafted at its sequence's own depth) and prefill
    /// chunks within one chunk's worth of prompt tokens per pass. Sequences handing out tokens
    /// a round already produced (all of them, then they join the pass), finishing or cancelled
    /// step on their own.
    fn turn(&mut self) {
        let mut batch = Vec::new();
        let mut ended = Vec::new();
        for i in 0..self.active.len() {
            // Tokens a round already produced are handed out all at once: a sequence that
            // spent a turn on each would drift out of step with the others and they would
            // take turns at the forward pass instead of sharing it.
            loop {
                let a = &mut self.active[i];
                if a.cancelled() {
                    self.cancel(i);
                    ended.push(i);
                    break;
                }
                if a.gen.batchable() {
                    batch.push(i);
                    break;
                }
                let more = a.gen.has_ready();
                self.report_all_snapshots();
                let result = self.with_ctx(0, |ctx, active, _| active[i].gen.step(ctx));
                if self.deliver(i, result) {
                    ended.push(i);
                    break;
                }
                if !more {
                    break;
                }
            }
        }
        if !batch.is_empty() {
            self.report_all_snapshots();
            ended.extend(self.step(&batch));
        }
        // Highest index first, so that each swap_remove leaves the others' indices valid.
        ended.sort_unstable_by(|a, b| b.cmp(a));
        for i in ended {
            let a = self.active.swap_remove(i);
            self.retire(a);
        }
    }

    /// Tells a split model's other ranks of the snapshots taken since, before a pass could
    /// move the caches on: each takes its own where rank 0 took one.
    fn report_all_snapshots(&mut self) {
        if let Some(l) = &self.lockstep {
            for a in &mut self.active {
                report_snapshots(l, &mut a.gen);
            }
        }
    }

    /// Fresh caches for a request that restores nothing (`matched` prompt tokens were found).
    fn cold(&self, matched: usize) -> cache::prefix::Restored {
        cache::prefix::Restored {
            caches: self.fresh_caches(),
            cached: 0,
            matched,
        }
    }

    /// Runs `f` with the borrowed pieces a step runs on (the depth controller of `bucket`) and
    /// the running sequences.
    fn with_ctx<R>(
        &mut self,
        bucket: usize,
        f: impl FnOnce(&mut Ctx<'_>, &mut Vec<Active>, &EngineConfig) -> R,
    ) -> R {
        let Engine {
            active,
            model,
            sampler,
            draft,
            controllers,
            cfg,
            towers,
            ..
        } = self;
        let mut ctx = Ctx {
            model: &*model.model,
            sampler,
            draft: draft.as_deref().map(|d| (d, &mut controllers[bucket])),
            towers: Some(towers),
        };
        f(&mut ctx, active, cfg)
    }

    /// One step of the sequences at `batch` in one forward pass; returns those that ended.
    fn step(&mut self, batch: &[usize]) -> Vec<usize> {
        let decoding = batch
            .iter()
            .filter(|&&i| !self.active[i].gen.prefilling())
            .count();
        // Until a chunk has been timed, a quarter second.
        let encode_budget = Duration::from_secs_f64(self.chunk_seconds.unwrap_or(0.25));
        let started = Instant::now();
        let result = self.with_ctx(bucket(decoding), |ctx, active, cfg| {
            let mut gens: Vec<&mut Generation> = active
                .iter_mut()
                .enumerate()
                .filter(|(i, _)| batch.contains(i))
                .map(|(_, a)| &mut a.gen)
                .collect();
            crate::step::run(ctx, &mut gens, cfg.prefill_chunk, encode_budget)
        });
        let mut ended = Vec::new();
        match result {
            Ok(step) => {
                let m = &self.shared.metrics;
                let work =
                    |f: fn(&crate::step::Work) -> bool| step.plan.rows.iter().any(|r| f(&r.work));
                if work(|w| matches!(w, crate::step::Work::Encode { .. })) {
                    m.encode_steps.fetch_add(1, Ordering::Relaxed);
                } else if work(|w| matches!(w, crate::step::Work::Prefill { .. })) {
                    let t = started.elapsed().as_secs_f64();
                    self.chunk_seconds = Some(match self.chunk_seconds {
                        Some(c) => 0.8 * c + 0.2 * t,
                        None => t,
                    });
                }
                if step.rows > 0 {
                    m.batch_rows.observe(step.rows as f64);
                    m.batch_tokens.observe(step.tokens as f64);
                }
                for (&i, ev) in batch.iter().zip(step.events) {
                    if self.deliver(i, ev) {
                        ended.push(i);
                    }
                }
            }
            Err(e) => {
                tracing::error!("batched step failed: {e}");
                let message = e.to_string();
                for &i in batch {
                    self.fail(i, Event::Error(message.clone()));
                    ended.push(i);
                }
            }
        }
        ended
    }

    /// Hands sequence `i`'s step result to its stream; returns whether the sequence has ended.
    fn deliver(&mut self, i: usize, result: crate::generation::Result<Option<Event>>) -> bool {
        let event = match result {
            Ok(e) => e,
            Err(e) => {
                tracing::error!("generation failed: {e}");
                self.fail(i, e.into());
                return true;
            }
        };
        let shared = Arc::clone(&self.shared);
        let a = &mut self.active[i];
        Self::count_rounds(&shared.metrics, a);
        match event {
            None => a.gen.is_finished() && !a.gen.has_ready(),
            Some(Event::Done { reason, stats }) => {
                Self::record(&shared, &a.job, &stats, a.rounds);
                let _ = a.job.events.send(Event::Done { reason, stats });
                true
            }
            Some(e) => {
                let _ = a.job.events.send(e);
                // A round that ended at an EOS left its last tokens and its end to hand out
                // (next turn); it is over once they are out.
                a.gen.is_finished() && !a.gen.has_ready()
            }
        }
    }

    /// Ends sequence `i` with an error: its stream is told (`error`), its caches are not kept.
    fn fail(&mut self, i: usize, error: Event) {
        self.shared
            .metrics
            .requests_failed
            .fetch_add(1, Ordering::Relaxed);
        self.with_ctx(0, |ctx, active, _| {
            let a = &mut active[i];
            a.failed = true;
            let _ = a.gen.cancel(ctx);
            let _ = a.job.events.send(error);
        });
    }

    /// Ends sequence `i` because its client went away or a stop string ended its text.
    fn cancel(&mut self, i: usize) {
        self.shared
            .metrics
            .requests_cancelled
            .fetch_add(1, Ordering::Relaxed);
        self.with_ctx(0, |ctx, active, _| {
            let a = &mut active[i];
            let ev = a.gen.cancel(ctx);
            let _ = a.job.events.send(ev);
        });
    }

    /// Speculative rounds a sequence finished, into the metrics.
    fn count_rounds(m: &Metrics, a: &mut Active) {
        for r in a.gen.take_rounds() {
            m.draft_tokens.fetch_add(r.depth as u64, Ordering::Relaxed);
            m.draft_accepted
                .fetch_add(r.accepted as u64, Ordering::Relaxed);
            for j in 0..r.depth {
                let at = j.min(crate::metrics::DRAFT_POSITIONS - 1);
                m.drafted_at[at].fetch_add(1, Ordering::Relaxed);
                if j < r.accepted {
                    m.accepted_at[at].fetch_add(1, Ordering::Relaxed);
                }
            }
            a.rounds += 1;
        }
    }

    fn record(shared: &Shared, job: &CompletionJob, s: &Stats, rounds: usize) {
        let m = &shared.metrics;
        m.prompt_tokens
            .fetch_add(s.prompt_eval_count as u64, Ordering::Relaxed);
        m.generated_tokens
            .fetch_add(s.eval_count as u64, Ordering::Relaxed);
        m.time_to_first_token.observe(s.prompt_eval_ns as f64 / 1e9);
        m.request_duration
            .observe(job.received.elapsed().as_secs_f64());
        if s.eval_count > 1 {
            m.time_per_token
                .observe(s.eval_ns as f64 / 1e9 / (s.eval_count - 1) as f64);
        }
        let rate = |n: usize, ns: u64| n as f64 / (ns.max(1) as f64 / 1e9);
        tracing::info!(
            prompt_tokens = s.prompt_eval_count,
            cached_tokens = s.cached_tokens,
            generated_tokens = s.eval_count,
            prefill_tok_s = format!(
                "{:.1}",
                rate(s.prompt_eval_count - s.cached_tokens, s.prompt_eval_ns)
            ),
            decode_tok_s = format!("{:.1}", rate(s.eval_count.saturating_sub(1), s.eval_ns)),
            draft_tokens = s.draft_tokens,
            draft_accepted = s.draft_accepted,
            mean_depth = format!("{:.2}", s.draft_tokens as f64 / rounds.max(1) as f64),
            "completion"
        );
    }

    /// A finished or cancelled sequence leaves what it computed to the prefix cache.
    /// (The sequence is released after the store: a split model's other ranks store from its
    /// caches, then let them go.)
    fn retire(&mut self, a: Active) {
        let seq = a.gen.seq();
        if !a.failed {
            self.keep(a);
        }
        self.model.model.release(seq);
    }

    fn keep(&mut self, mut a: Active) {
        let seq = a.gen.seq();
        if let Some(l) = &self.lockstep {
            report_snapshots(l, &mut a.gen);
        }
        let r = match a.gen.into_parts(self.draft.as_deref()) {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!("drafter catch-up failed; its cache is not kept: {e}");
                return;
            }
        };
        let (caches, fed, taken) = (r.caches, r.tokens, r.snapshots);
        if let Some(disk) = &self.disk {
            if let Some(l) = &self.lockstep {
                // Every rank writes its own caches' blocks of the sequence.
                l.queue(CacheOp::Disk {
                    seq,
                    tokens: fed.clone(),
                    checkpoints: taken.iter().map(|(at, _)| *at).collect(),
                });
            }
            if let Err(e) = disk.store(&fed, &caches, &taken) {
                tracing::warn!("prefix cache blocks not written: {e}");
            }
        }
        match self.prefix.insert(&fed, &caches, taken) {
            Ok(stored) => {
                if let (Some(l), true) = (&self.lockstep, stored.held > 0) {
                    l.queue(CacheOp::Store {
                        seq,
                        key: caches.len(),
                        tokens: fed[..stored.held].to_vec(),
                        checkpoints: stored.checkpoints,
                        evicted: stored.evicted,
                        nodes: stored.nodes,
                    });
                }
            }
            Err(e) => tracing::warn!("prefix cache insert failed: {e}"),
        }
        self.shared
            .cache_memory
            .store(self.prefix.bytes() as u64, Ordering::Relaxed);
    }

    /// Ends every stream with an error, so that a parent reports a failure rather than a
    /// success with a truncated answer.
    fn shutdown(&mut self) {
        self.with_ctx(0, |ctx, active, _| {
            for mut a in std::mem::take(active) {
                let _ = a.gen.cancel(ctx);
                ctx.model.release(a.gen.seq());
                let _ = a.job.events.send(Event::Error(
                    "the runner is shutting down: the completion was interrupted".into(),
                ));
            }
        });
        for j in self.queue.drain(..) {
            let _ = j
                .events
                .send(Event::Error("the runner is shutting down".into()));
        }
    }
}
