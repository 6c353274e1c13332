//! A split model served over HTTP: rank 0 leads, the other ranks replay its forward passes.
//!
//! Rank 0's engine runs unchanged on a [`Leader`]: a model that, before each packed forward
//! pass, tells the other ranks what the pass is (each row's sequence, position and length, the
//! tokens, the sequences that ended since), then runs its own stage. Every other rank runs
//! [`follow`]: it keeps each live sequence's caches for its own layers and replays each pass on
//! them. The model's stage passes the hidden states along the ranks and the last rank's final
//! hidden states back to rank 0, which alone holds the head, samples and speaks HTTP
//! (docs/DISTRIBUTED.md, "Serving").
//!
//! The prefix cache runs in lockstep: rank 0's engine tells the others, through a
//! [`Lockstep`], each lookup, restore, snapshot and store of its own prefix cache, in order
//! with the passes; they repeat each on a trie of their own layers' data, and evict what rank
//! 0's budget evicts. A restore is voted on: where any rank cannot restore, all start cold
//! (docs/DISTRIBUTED.md, "The prefix cache").

use crate::cluster::{Cluster, Job, JoinOptions};
use cache::disk::DiskTier;
use cache::prefix::{needs_checkpoints, CacheCheckpoint, PrefixCache};
use cache::LayerCache;
use mlx::{Array, Dtype};
use models::draft::DraftFollower;
use models::parallel::{Ends, Mode};
use models::{
    CausalLm, Drafter, DtypeChoice, LoadedModel, MediaSpan, ModelError, ModelFiles, PackedRow,
};
use serde::{Deserialize, Serialize};
use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// How rank 0 leads a split model.
#[derive(Debug, Clone)]
pub struct LeadConfig {
    pub join: JoinOptions,
    /// Rank 0's command line, which the other ranks follow.
    pub argv: Vec<String>,
    /// How long a forward pass may wait on the other ranks.
    pub rank_timeout: Duration,
    /// By layers or by tensors.
    pub mode: Mode,
    /// The content key of the draft model, for the other ranks to compare with theirs
    /// ([`crate::cluster::Job::draft`]).
    pub draft: Option<String>,
}

/// Joins the ranks of `cfg` as rank 0 (starting those on this machine), shares the job, and
/// loads rank 0's stage of the model in `files` (with the embedding and the head), wrapped
/// in a [`Leader`], with the [`Lockstep`] its prefix cache tells the other ranks through.
/// `broken` is set when a rank is lost later.
pub fn lead(
    files: &ModelFiles,
    dtype: DtypeChoice,
    cfg: &LeadConfig,
    broken: Arc<AtomicBool>,
) -> Result<(LoadedModel, Lockstep), String> {
    // Rank 0 samples for every sequence: the job's seed is unused.
    let job = Job {
        draft: cfg.draft.clone(),
        ..Job::of(cfg.argv.clone(), files, 0)?
    };
    let cluster = Rc::new(Cluster::lead(&cfg.join, &job)?);
    let (mut loaded, held) = cluster.load_stage(files, dtype, Ends::First, cfg.mode)?;
    for (rank, h) in held.iter().enumerate() {
        tracing::info!(
            rank,
            layers = format!("{}..{}", h.layers.start, h.layers.end),
            weights = %crate::memory::Bytes(h.weights),
            "split model"
        );
    }
    let rotates = any_rotates(&cluster, &*loaded.model)?;
    let line = Rc::new(Line {
        cluster,
        pending: RefCell::default(),
        limit: cfg.rank_timeout,
        broken,
    });
    let lockstep = Lockstep {
        line: Rc::clone(&line),
        rotates,
        mode: cfg.mode,
    };
    loaded.model = Box::new(Leader {
        inner: loaded.model,
        line,
        released: RefCell::default(),
    });
    Ok((loaded, lockstep))
}

/// Whether any rank's layers include a sliding-window one (every rank asks, together): its
/// caches restore only where snapshots were taken, so every rank's prefix cache must act as
/// though its own did.
fn any_rotates(cluster: &Cluster, model: &dyn CausalLm) -> Result<bool, String> {
    let mine = needs_checkpoints(&model.make_caches()) as i64;
    Ok(cluster.gather(&[mine])?.iter().any(|r| r[0] != 0))
}

/// A rank other than 0 of a split model served over HTTP, its stage loaded: replays rank 0's
/// passes until rank 0 stops.
///
/// `disk` opens this rank's disk tier (given its share of the model, see [`Lockstep::place`],
/// and whether this rank drafts) where rank 0's runner has one. `draft` loads this rank's part
/// of a drafter split with the model (`None` where rank 0's drafter runs on rank 0 alone);
/// every rank agrees on it, as rank 0 reports its own drafter ([`Lockstep::agree`]).
pub fn serve_following(
    cluster: &Cluster,
    mut model: Box<dyn CausalLm>,
    kv_cache: mlx::RowFormat,
    mode: Mode,
    disk: impl FnOnce(&str, &str, bool) -> Option<DiskTier>,
    draft: impl FnOnce(&mut dyn CausalLm) -> Result<Option<Box<dyn DraftFollower>>, String>,
) -> Result<(), FollowError> {
    model.set_cache_format(kv_cache);
    let rotates = any_rotates(cluster, &*model).map_err(FollowError::Failed)?;
    let drafter = draft(&mut *model);
    let verdict = drafter.as_ref().map(|_| ()).map_err(Clone::clone);
    if cluster.agree("loading the drafter", verdict).is_err() {
        return Err(FollowError::Refused);
    }
    let drafter = drafter.map_err(FollowError::Failed)?;
    // A share of the drafter changes what this rank's caches hold (the assistant's one key
    // past the window), so the tier's key names it as rank 0's does.
    let disk = disk(
        model.architecture(),
        &place(cluster, mode),
        drafter.is_some(),
    );
    follow(&*model, cluster, rotates, disk, drafter.as_deref()).map_err(FollowError::Failed)
}

/// How a rank following rank 0 ended badly.
#[derive(Debug)]
pub enum FollowError {
    /// This rank's own failure, for it to report.
    Failed(String),
    /// Some rank could not load its part, which rank 0 reports for every rank.
    Refused,
}

/// One pass, as rank 0 describes it to the others.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Call {
    Forward {
        tokens: Vec<i32>,
        rows: Vec<Row>,
        /// Sequences that ended since the last call: their caches go.
        released: Vec<u64>,
        /// Rank 0's prefix-cache calls since the last call, before the pass (and before the
        /// releases: a sequence's store reads its caches).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        cache: Vec<CacheOp>,
    },
    /// A request's prefix restored on rank 0 (after the prefix-cache calls before it): each
    /// rank restores the same and says whether it could.
    Restore {
        cache: Vec<CacheOp>,
        restore: RestoreOp,
    },
    /// A pass of a drafter split with the target (the gemma4 assistant's layers): each rank
    /// runs its part over its caches of `rows`' sequences (rewound to where rank 0's are) on
    /// the input that follows the call in one broadcast (`[1, rows, width]`, float32 on the
    /// wire, `dtype` in the layers).
    Draft {
        rows: Vec<DraftAt>,
        width: usize,
        dtype: String,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        cache: Vec<CacheOp>,
    },
    /// Rank 0 is stopping: the others repeat its last prefix-cache calls (a sequence's blocks
    /// for the disk tier among them) and end.
    Stop {
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        cache: Vec<CacheOp>,
    },
}

/// One of rank 0's prefix-cache calls, which the other ranks repeat on their own tries
/// (`key`: how many caches rank 0's sequence holds, which picks the trie).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum CacheOp {
    /// A request that restored nothing looked `prompt` up (which marks what matched as used).
    Lookup { key: usize, prompt: Vec<u32> },
    /// Sequence `seq` snapshotted its rotating caches at position `at`.
    Snapshot { seq: u64, at: usize },
    /// Sequence `seq` ended and was stored: `tokens`, the snapshots at `checkpoints`
    /// (the last, where rank 0 took one there, of its caches as they end), then `evicted`
    /// leaves evicted, leaving `nodes` in rank 0's tries.
    Store {
        seq: u64,
        key: usize,
        tokens: Vec<u32>,
        checkpoints: Vec<usize>,
        evicted: usize,
        nodes: usize,
    },
    /// Sequence `seq` ended holding `tokens`, with snapshots at `checkpoints`: its blocks go
    /// to the disk tier (each rank's own directory entries; a rank without a tier ignores it).
    Disk {
        seq: u64,
        tokens: Vec<u32>,
        checkpoints: Vec<usize>,
    },
}

/// A request's prefix restore: `prompt` (as far as rank 0's lookup read it) restored to `at`
/// tokens, then cut back `back` (a drafter's margin, an image's start), for sequence `seq`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RestoreOp {
    pub seq: u64,
    pub key: usize,
    pub prompt: Vec<u32>,
    pub at: usize,
    pub back: usize,
}

/// A sequence a drafter pass reads, and the positions its target caches hold on rank 0.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct DraftAt {
    pub seq: u64,
    pub position: usize,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Row {
    /// [`PackedRow::seq`]: 0 is a row of this pass only.
    pub seq: u64,
    /// Positions its caches hold before the pass.
    pub position: usize,
    pub len: usize,
    /// The media whose soft tokens take the place of some of its tokens: their embeddings
    /// follow the call, one broadcast each, in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub media: Vec<Media>,
}

/// A media item of a row ([`models::MediaSpan`]) as a call names it: where it sits, what it
/// is, and the shape of its embeddings (`[len, width]`, float32 on the wire).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Media {
    pub at: usize,
    pub image: bool,
    pub len: usize,
    pub width: usize,
}

/// Calls cross in one broadcast of this many bytes (a longer one takes a second).
const FRAME: usize = 4096;

fn send(cluster: &Cluster, call: &Call) -> Result<(), String> {
    let body = serde_json::to_vec(call).map_err(|e| e.to_string())?;
    let mut frame = vec![0u8; FRAME];
    frame[..4].copy_from_slice(&(body.len() as u32).to_le_bytes());
    let head = body.len().min(FRAME - 4);
    frame[4..4 + head].copy_from_slice(&body[..head]);
    cluster.broadcast_bytes(&frame)?;
    if body.len() > head {
        cluster.broadcast_bytes(&body[head..])?;
    }
    Ok(())
}

fn receive(cluster: &Cluster) -> Result<Call, String> {
    let frame = cluster.broadcast_bytes(&[0u8; FRAME])?;
    let len = u32::from_le_bytes([frame[0], frame[1], frame[2], frame[3]]) as usize;
    let head = len.min(FRAME - 4);
    let mut body = frame[4..4 + head].to_vec();
    if len > head {
        body.extend(cluster.broadcast_bytes(&vec![0u8; len - head])?);
    }
    serde_json::from_slice(&body)
        .map_err(|e| format!("rank 0 sent a call this rank cannot read: {e}"))
}

/// Rank 0's line to the other ranks, which its model ([`Leader`]), its prefix cache
/// ([`Lockstep`]) and a drafter split with the model share: calls go out in the order they
/// are made, and the prefix cache's ride with the next of the others.
pub struct Line {
    cluster: Rc<Cluster>,
    /// The prefix-cache calls the next call carries.
    pending: RefCell<Vec<CacheOp>>,
    /// How long a call may wait on the other ranks.
    limit: Duration,
    /// Set once a call failed between ranks: MLX's ring does not recover from a lost peer,
    /// so the runner must end (its parent starts it again).
    broken: Arc<AtomicBool>,
}

impl Line {
    fn lost(&self) -> bool {
        self.broken.load(Ordering::SeqCst)
    }

    fn failed(&self, e: impl std::fmt::Display) -> ModelError {
        self.broken.store(true, Ordering::SeqCst);
        ModelError::Invalid(format!("the model's other ranks failed: {e}"))
    }

    fn take_pending(&self) -> Vec<CacheOp> {
        std::mem::take(&mut *self.pending.borrow_mut())
    }

    /// `f` (a call and what follows it) watched for at most the limit (`what` names it in
    /// the error); an error marks the line broken.
    fn watched<T, E>(&self, what: &str, f: impl FnOnce() -> Result<T, E>) -> Result<T, E> {
        self.cluster.watch(Some(self.limit), what);
        let out = f();
        if out.is_err() {
            self.broken.store(true, Ordering::SeqCst);
        }
        self.cluster.watch(None, "serving");
        out
    }
}

/// Rank 0's model: its stage, telling the other ranks each pass before running it.
pub struct Leader {
    inner: Box<dyn CausalLm>,
    line: Rc<Line>,
    released: RefCell<Vec<u64>>,
}

/// A pass of a drafter split with the target: a call naming its rows, the input broadcast
/// after it, then every rank's part of the layers, their outputs summed between the ranks.
impl models::draft::DraftPeers for Line {
    fn pass(
        &self,
        rows: &[(u64, usize)],
        input: &Array,
        own: &mut dyn FnMut() -> models::Result<Array>,
    ) -> models::Result<Array> {
        if self.lost() {
            return Err(self.failed("a rank was lost earlier"));
        }
        let x = input.astype(Dtype::F32)?;
        let call = Call::Draft {
            rows: rows
                .iter()
                .map(|&(seq, position)| DraftAt { seq, position })
                .collect(),
            width: input.shape().last().copied().unwrap_or(0) as usize,
            dtype: format!("{:?}", input.dtype()).to_lowercase(),
            // In order with the passes, as a forward pass carries them.
            cache: self.take_pending(),
        };
        self.watched("a draft pass", || {
            send(&self.cluster, &call)
                .and_then(|_| self.cluster.broadcast(&x))
                .map_err(|e| self.failed(e))?;
            let z = own().map_err(|e| self.failed(e))?;
            z.eval().map_err(|e| self.failed(e))?;
            Ok(z)
        })
    }
}

impl Drop for Leader {
    fn drop(&mut self) {
        if !self.line.lost() {
            let cache = self.line.take_pending();
            let _ = send(&self.line.cluster, &Call::Stop { cache });
        }
    }
}

impl CausalLm for Leader {
    fn make_caches(&self) -> Vec<LayerCache> {
        self.inner.make_caches()
    }

    fn forward(&self, tokens: &Array, caches: &mut [LayerCache]) -> models::Result<Array> {
        let len = tokens.shape().last().copied().unwrap_or(0) as usize;
        self.forward_packed(tokens, &mut [PackedRow::text(len, caches)])
    }

    fn forward_packed(&self, tokens: &Array, rows: &mut [PackedRow<'_>]) -> models::Result<Array> {
        let line = &self.line;
        if line.lost() {
            return Err(line.failed("a rank was lost earlier"));
        }
        let call = Call::Forward {
            tokens: tokens.astype(Dtype::I32)?.to_vec::<i32>()?,
            rows: rows
                .iter()
                .map(|r| Row {
                    seq: r.seq,
                    position: r.caches.first().map_or(0, LayerCache::offset),
                    len: r.len,
                    media: r
                        .media
                        .iter()
                        .map(|m| Media {
                            at: m.at,
                            image: m.kind == models::MediaKind::Image,
                            len: m.len(),
                            width: m.embeds.shape().last().copied().unwrap_or(0) as usize,
                        })
                        .collect(),
                })
                .collect(),
            released: std::mem::take(&mut *self.released.borrow_mut()),
            cache: line.take_pending(),
        };
        line.watched("a forward pass", || {
            send(&line.cluster, &call).map_err(|e| line.failed(e))?;
            // The ranks that embed (all of them split by tensors; with per-layer inputs, every
            // stage) splice the soft tokens in as rank 0 does.
            for m in rows.iter().flat_map(|r| r.media) {
                line.cluster
                    .broadcast(&m.embeds.astype(Dtype::F32)?)
                    .map_err(|e| line.failed(e))?;
            }
            self.inner
                .forward_packed(tokens, rows)
                .map_err(|e| line.failed(e))
        })
    }

    fn logits(&self, hidden: &Array) -> models::Result<Array> {
        self.inner.logits(hidden)
    }

    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }

    fn max_context(&self) -> usize {
        self.inner.max_context()
    }

    fn architecture(&self) -> &'static str {
        self.inner.architecture()
    }

    fn set_cache_slack(&mut self, slack: usize) {
        self.inner.set_cache_slack(slack)
    }

    fn set_cache_format(&mut self, format: mlx::RowFormat) {
        self.inner.set_cache_format(format)
    }

    fn release(&self, seq: u64) {
        self.released.borrow_mut().push(seq);
    }

    fn builtin_drafter(&self) -> Option<Box<dyn Drafter>> {
        self.inner.builtin_drafter()
    }

    fn leading(&self) -> Option<(&dyn CausalLm, Rc<dyn models::draft::DraftPeers>)> {
        let line: Rc<dyn models::draft::DraftPeers> = self.line.clone();
        Some((&*self.inner, line))
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// Rank 0's prefix cache's line to the other ranks: its calls wait for the next call to the
/// ranks (a pass, or a restore), which carries them in order; a restore asks every rank.
pub struct Lockstep {
    line: Rc<Line>,
    rotates: bool,
    mode: Mode,
}

/// A rank's share of a split model, as the disk tier's key names it.
fn place(cluster: &Cluster, mode: Mode) -> String {
    format!(
        " rank {} of {} by {}",
        cluster.rank(),
        cluster.size(),
        mode.name()
    )
}

impl Lockstep {
    /// Whether some rank's layers rotate (see [`PrefixCache::rotating`]).
    pub fn rotates(&self) -> bool {
        self.rotates
    }

    /// This rank's share of the model, for the disk tier's key: " rank R of N by MODE".
    pub fn place(&self) -> String {
        place(&self.line.cluster, self.mode)
    }

    /// Every rank's verdict on `what` (rank 0's drafter loaded, the others' shares of it).
    pub fn agree(&self, what: &str, verdict: Result<(), String>) -> Result<(), String> {
        self.line.cluster.agree(what, verdict)
    }

    pub fn queue(&self, op: CacheOp) {
        self.line.pending.borrow_mut().push(op);
    }

    /// Every rank restores as `restore` says: `true` where all could, `false` where some
    /// could not (every rank then starts the sequence cold). An error is a lost rank.
    pub fn restore(&self, restore: RestoreOp) -> Result<bool, String> {
        let line = &self.line;
        if line.lost() {
            return Err("a rank was lost earlier".into());
        }
        let call = Call::Restore {
            cache: line.take_pending(),
            restore,
        };
        let votes = line.watched("a prefix-cache restore", || {
            send(&line.cluster, &call).and_then(|_| line.cluster.gather(&[0]))
        })?;
        Ok(votes.iter().all(|r| r[0] == 0))
    }
}

/// A rank other than 0: replays rank 0's passes on `model` (this rank's stage) until rank 0
/// stops, and its prefix-cache calls on a prefix cache of its own (`rotates`: some rank's
/// layers do). An error (a lost rank, a pass out of step) ends it.
pub fn follow(
    model: &dyn CausalLm,
    cluster: &Cluster,
    rotates: bool,
    disk: Option<DiskTier>,
    drafter: Option<&dyn DraftFollower>,
) -> Result<(), String> {
    // Dropped on the way out, which lets the disk tier's writer finish its queue.
    let mut f = Following {
        model,
        live: HashMap::new(),
        snapshots: HashMap::new(),
        // Rank 0's budget decides what goes (each store says what it evicted).
        prefix: PrefixCache::new(usize::MAX, 1).rotating(rotates),
        disk,
    };
    loop {
        match receive(cluster)? {
            Call::Stop { cache } => {
                for op in cache {
                    f.apply(op);
                }
                return Ok(());
            }
            Call::Restore { cache, restore } => {
                for op in cache {
                    f.apply(op);
                }
                let seq = restore.seq;
                let restored = f.restore(restore);
                let votes = cluster.gather(&[(!restored) as i64])?;
                if votes.iter().any(|r| r[0] != 0) {
                    f.live.remove(&seq);
                }
            }
            Call::Forward {
                tokens,
                rows,
                released,
                cache,
            } => {
                for op in cache {
                    f.apply(op);
                }
                for seq in released {
                    f.live.remove(&seq);
                    f.snapshots.remove(&seq);
                }
                f.replay(cluster, tokens, rows)?;
            }
            Call::Draft {
                rows,
                width,
                dtype,
                cache,
            } => {
                for op in cache {
                    f.apply(op);
                }
                let input = receive_input(cluster, rows.len(), width, &dtype)?;
                let drafter = drafter.ok_or_else(|| {
                    "rank 0 drafts with a drafter split over the ranks, which this rank has not \
                     loaded"
                        .to_string()
                })?;
                f.draft(drafter, &rows, &input)?;
            }
        }
    }
}

/// A drafter pass's input, as rank 0 broadcasts it after the call, in the layers' `dtype`.
fn receive_input(
    cluster: &Cluster,
    rows: usize,
    width: usize,
    dtype: &str,
) -> Result<Array, String> {
    let dtype = Dtype::from_name(dtype).ok_or_else(|| format!("rank 0 sent dtype {dtype:?}"))?;
    let zeros =
        Array::zeros(&[1, rows as i32, width as i32], Dtype::F32).map_err(|e| e.to_string())?;
    cluster
        .broadcast(&zeros)?
        .astype(dtype)
        .map_err(|e| e.to_string())
}

/// A following rank's state: each live sequence's caches of this rank's layers, the
/// snapshots they took, and the prefix cache kept in step with rank 0's.
struct Following<'m> {
    model: &'m dyn CausalLm,
    live: HashMap<u64, Vec<LayerCache>>,
    snapshots: HashMap<u64, Vec<(usize, CacheCheckpoint)>>,
    prefix: PrefixCache,
    /// This rank's blocks on disk, where rank 0 has a disk tier.
    disk: Option<DiskTier>,
}

impl Following<'_> {
    /// One of rank 0's prefix-cache calls. A call this rank cannot repeat in full (caches
    /// it lacks, a copy that failed) leaves its trie short of rank 0's: later restores there
    /// fail the vote and start cold, never wrong.
    fn apply(&mut self, op: CacheOp) {
        match op {
            CacheOp::Lookup { key, prompt } => self.prefix.touch(key, &prompt),
            CacheOp::Snapshot { seq, at } => {
                if let Some(c) = self.live.get(&seq).and_then(|c| snapshot(c, at)) {
                    self.snapshots.entry(seq).or_default().push((at, c));
                }
            }
            CacheOp::Disk {
                seq,
                tokens,
                checkpoints,
            } => {
                let (Some(disk), Some(caches)) = (&self.disk, self.live.get(&seq)) else {
                    return;
                };
                let taken = self.snapshots.get(&seq).map_or(&[][..], Vec::as_slice);
                let cps = checkpoints_at(taken, caches, &checkpoints);
                if let Err(e) = disk.store(&tokens, caches, &cps) {
                    tracing::warn!("prefix cache blocks not written: {e}");
                }
            }
            CacheOp::Store {
                seq,
                key,
                tokens,
                checkpoints,
                evicted,
                nodes,
            } => {
                let taken = self.snapshots.remove(&seq).unwrap_or_default();
                let caches = self.live.get(&seq).map_or(&[][..], Vec::as_slice);
                let held = caches.iter().map(LayerCache::offset).min().unwrap_or(0);
                let tokens = if held >= tokens.len() {
                    &tokens[..]
                } else {
                    &[][..]
                };
                let cps = checkpoints_at(&taken, caches, &checkpoints);
                if let Err(e) = self.prefix.insert_exact(key, tokens, caches, cps, evicted) {
                    tracing::warn!("prefix cache insert failed: {e}");
                }
                // Not an error (a restore this rank cannot make is voted cold), but worth
                // knowing: it costs hits, or memory.
                if self.prefix.nodes() != nodes {
                    tracing::warn!(
                        "prefix cache out of step with rank 0: {} nodes here, {nodes} there",
                        self.prefix.nodes()
                    );
                }
            }
        }
    }

    /// Caches restored as `r` says into the sequence's place; whether it could. Where rank 0
    /// restored from its disk tier (more than its memory held), this rank's memory does not
    /// hold `r.at` either, and its own blocks on disk must give it.
    fn restore(&mut self, r: RestoreOp) -> bool {
        self.live.remove(&r.seq);
        self.snapshots.remove(&r.seq);
        let fresh = self.model.make_caches();
        let from_memory = match self.prefix.restore_exact(r.key, &r.prompt, fresh, r.at) {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!("prefix cache restore failed: {e}");
                None
            }
        };
        let Some(mut caches) = from_memory.or_else(|| self.restore_from_disk(&r)) else {
            return false;
        };
        if r.back > 0 && !caches.iter_mut().all(|c| c.rewind(r.back).is_ok()) {
            return false;
        }
        self.live.insert(r.seq, caches);
        true
    }

    /// `r.prompt` from this rank's blocks on disk, cut back to exactly `r.at` positions.
    fn restore_from_disk(&self, r: &RestoreOp) -> Option<Vec<LayerCache>> {
        let disk = self.disk.as_ref()?;
        let d = disk.restore(&r.prompt, self.model.make_caches(), 0)?;
        let (mut caches, held) = (d.restored.caches, d.restored.cached);
        if held < r.at {
            return None;
        }
        if held > r.at && !caches.iter_mut().all(|c| c.rewind(held - r.at).is_ok()) {
            return None;
        }
        Some(caches)
    }

    /// One of rank 0's drafter passes over `rows`' caches, cut back first to where rank 0's
    /// are (after a verify pass, rank 0 rewinds rejected drafts at once, this rank at its next
    /// call).
    fn draft(
        &mut self,
        drafter: &dyn DraftFollower,
        rows: &[DraftAt],
        input: &Array,
    ) -> Result<(), String> {
        for r in rows {
            let caches = self
                .live
                .get_mut(&r.seq)
                .ok_or_else(|| format!("rank 0 drafts for sequence {}, not held here", r.seq))?;
            rewind_to(caches, r.seq, r.position)?;
        }
        let targets: Vec<&[LayerCache]> = rows
            .iter()
            .filter_map(|r| self.live.get(&r.seq).map(Vec::as_slice))
            .collect();
        drafter.pass(input, &targets).map_err(|e| e.to_string())
    }

    /// One of rank 0's passes on each row's caches: a new sequence's fresh, a rewound one's
    /// cut back to where rank 0's are.
    fn replay(
        &mut self,
        cluster: &Cluster,
        tokens: Vec<i32>,
        rows: Vec<Row>,
    ) -> Result<(), String> {
        let model = self.model;
        let mut held: Vec<Vec<LayerCache>> = Vec::with_capacity(rows.len());
        for r in &rows {
            let mut caches = match self.live.remove(&r.seq) {
                Some(c) if r.seq != 0 && r.position > 0 => c,
                _ => model.make_caches(),
            };
            rewind_to(&mut caches, r.seq, r.position)?;
            held.push(caches);
        }
        let media = rows
            .iter()
            .map(|r| r.media.iter().map(|m| receive_media(cluster, m)).collect())
            .collect::<Result<Vec<Vec<MediaSpan>>, String>>()?;
        let n = tokens.len() as i32;
        let tokens = Array::from_slice(&tokens, &[1, n]).map_err(|e| e.to_string())?;
        let mut packed: Vec<PackedRow<'_>> = rows
            .iter()
            .zip(held.iter_mut())
            .zip(&media)
            .map(|((r, caches), media)| PackedRow {
                seq: r.seq,
                len: r.len,
                caches,
                media,
            })
            .collect();
        model
            .forward_packed(&tokens, &mut packed)
            .map_err(|e| e.to_string())?;
        drop(packed);
        for (r, caches) in rows.iter().zip(held) {
            if r.seq != 0 {
                self.live.insert(r.seq, caches);
            }
        }
        Ok(())
    }
}

/// Sequence `seq`'s caches cut back to `position` (where rank 0's are); an error where they
/// hold fewer.
fn rewind_to(caches: &mut [LayerCache], seq: u64, position: usize) -> Result<(), String> {
    let at = caches.first().map_or(0, LayerCache::offset);
    if position > at {
        return Err(format!(
            "sequence {seq} is at {position} on rank 0 and at {at} here: out of step"
        ));
    }
    if position < at {
        for c in caches.iter_mut() {
            c.rewind(at - position)
                .map_err(|e| format!("sequence {seq}: rewinding to {position}: {e}"))?;
        }
    }
    Ok(())
}

/// A sequence's snapshots at `positions`, where rank 0 took them: those this rank took there
/// (`taken`), else one of its `caches` as they are now (rank 0's of its caches as they ended).
fn checkpoints_at(
    taken: &[(usize, CacheCheckpoint)],
    caches: &[LayerCache],
    positions: &[usize],
) -> Vec<(usize, CacheCheckpoint)> {
    positions
        .iter()
        .filter_map(|&p| match taken.iter().find(|(q, _)| *q == p) {
            Some((_, c)) => Some((p, c.clone())),
            None => snapshot(caches, p).map(|c| (p, c)),
        })
        .collect()
}

/// The rotating layers of `caches` as they were at position `at` (rank 0 took its snapshot
/// there, perhaps after cutting back drafts these caches still hold): `None` where they
/// cannot go back that far.
fn snapshot(caches: &[LayerCache], at: usize) -> Option<CacheCheckpoint> {
    let mut back = caches.to_vec();
    for c in back.iter_mut() {
        if let LayerCache::Rotating(r) = c {
            let n = r.offset().checked_sub(at)?;
            r.rewind(n).ok()?;
        }
    }
    Some(CacheCheckpoint::of(&back))
}

/// A media item's embeddings, as rank 0 broadcasts them after the call that names it.
fn receive_media(cluster: &Cluster, m: &Media) -> Result<MediaSpan, String> {
    let shape = [m.len as i32, m.width as i32];
    let zeros = Array::zeros(&shape, Dtype::F32).map_err(|e| e.to_string())?;
    Ok(MediaSpan {
        at: m.at,
        embeds: cluster.broadcast(&zeros)?,
        kind: if m.image {
            models::MediaKind::Image
        } else {
            models::MediaKind::Audio
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calls_read_back_as_written() {
        let call = Call::Forward {
            tokens: vec![1, 2, 3],
            rows: vec![
                Row {
                    seq: 4,
                    position: 10,
                    len: 3,
                    media: vec![],
                },
                Row {
                    seq: 5,
                    position: 0,
                    len: 300,
                    media: vec![Media {
                        at: 2,
                        image: true,
                        len: 256,
                        width: 64,
                    }],
                },
            ],
            released: vec![2],
            cache: vec![CacheOp::Store {
                seq: 2,
                key: 3,
                tokens: vec![7, 8],
                checkpoints: vec![2],
                evicted: 1,
                nodes: 4,
            }],
        };
        let text = serde_json::to_vec(&call).unwrap();
        assert_eq!(serde_json::from_slice::<Call>(&text).unwrap(), call);
        let stop = Call::Stop {
            cache: vec![CacheOp::Disk {
                seq: 2,
                tokens: vec![7, 8, 9],
                checkpoints: vec![2],
            }],
        };
        let text = serde_json::to_vec(&stop).unwrap();
        assert_eq!(serde_json::from_slice::<Call>(&text).unwrap(), stop);
        let draft = Call::Draft {
            rows: vec![DraftAt {
                seq: 3,
                position: 17,
            }],
            width: 64,
            dtype: "bf16".into(),
            cache: vec![CacheOp::Snapshot { seq: 3, at: 16 }],
        };
        let text = serde_json::to_vec(&draft).unwrap();
        assert_eq!(serde_json::from_slice::<Call>(&text).unwrap(), draft);
    }
}
