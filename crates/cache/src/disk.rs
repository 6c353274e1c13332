//! The prefix cache's disk tier: blocks of cache state written to files, so that a runner
//! started again (after `keep_alive` unloaded it, a crash, a parent's restart) resumes a prompt
//! it saw before instead of prefilling it again.
//!
//! A sequence's tokens are cut into blocks of `block` positions. Block `k` is one safetensors
//! file named by a chained hash: `h0 = sha256(model key, cache layout)`, `hk = sha256(hk-1,
//! tokens of block k)`, so the name is the content address of the whole token prefix up to the
//! block's end, for this model and this set of caches. Two conversations that share a system
//! prompt share its blocks; nothing needs an index to be found: a prompt's block names are
//! computed from the prompt.
//!
//! A block holds, per layer, what that layer needs: the block's own positions for caches that
//! keep every position (full-attention keys and values, MLA latents), and for sliding-window
//! layers the block's own positions their window still held at the block's end (taken from the
//! snapshot there: the ring itself has dropped them by the time the sequence ends), with the
//! count of positions the window held there. A restore rebuilds a window from the runs of the
//! last blocks, as many positions as it held, so no position is written twice. Its metadata
//! repeats the chain (root, parent, first position, tokens) and a sha256 of the tensor data; a
//! read checks all of it, and a file that fails (truncated, corrupt, misplaced) is skipped with
//! a warning and removed, never loaded. Another model's or an older format's blocks have other
//! names: they are never read, and age out.
//!
//! Writes are queued to a writer thread (no MLX there: the engine thread turns arrays into
//! bytes), bounded in bytes so a slow disk drops blocks rather than holding memory. The writer
//! takes an advisory lock on the directory, evicts the least recently used files (by mtime,
//! which a restore renews) until the new block fits the budget, and writes through a temporary
//! file and a rename, so several runners may share one directory and none ever sees a partial
//! file; the directory never holds more than the budget.

use crate::prefix::{held_by_all, needs_checkpoints, CacheCheckpoint, Restored};
use crate::{CacheError, KvCache, LatentCache, LayerCache, Result};
use mlx::{Array, RowFormat, Rows};
use sha2::{Digest, Sha256};
use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

/// Written into every block; a file of another format is skipped.
const FORMAT: &str = "mlx-runner prefix block 2";
const SUFFIX: &str = "block";
/// The most bytes of blocks waiting for the writer; more are dropped.
const MOST_PENDING: u64 = 256 << 20;
/// A temporary file older than this was left by a writer that died.
const STALE_TEMP: Duration = Duration::from_secs(600);

/// Where the tier lives and how much it may hold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiskConfig {
    pub dir: PathBuf,
    /// Bytes of block files in the directory at most (all models sharing it together).
    pub budget: u64,
}

type Hash = [u8; 32];

fn chain_root(model: &str, layout: &str) -> Hash {
    let mut h = Sha256::new();
    h.update(FORMAT.as_bytes());
    h.update([0]);
    h.update(model.as_bytes());
    h.update([0]);
    h.update(layout.as_bytes());
    h.finalize().into()
}

fn chain_next(parent: &Hash, tokens: &[u32]) -> Hash {
    let mut h = Sha256::new();
    h.update(parent);
    for t in tokens {
        h.update(t.to_le_bytes());
    }
    h.finalize().into()
}

/// What identifies a set of caches beyond the model: each layer's kind (and a window's size
/// and capacity), so that a sequence with a drafter's caches and one without never share.
fn layout(caches: &[LayerCache]) -> String {
    caches
        .iter()
        .map(|c| {
            let kind = match c {
                LayerCache::Kv(_) => "kv".to_string(),
                LayerCache::Latent(_) => "latent".to_string(),
                LayerCache::Rotating(r) => format!("window{}+{}", r.window(), r.ring()),
            };
            // The cache type too: a runner of another --kv-cache-type never reads these.
            format!("{kind}:{}", c.format().name())
        })
        .collect::<Vec<_>>()
        .join(",")
}

fn tokens_text(tokens: &[u32]) -> String {
    tokens
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// A file the directory holds.
#[derive(Debug, Clone, Copy)]
struct Held {
    bytes: u64,
    used: SystemTime,
}

#[derive(Default)]
struct Index {
    files: HashMap<String, Held>,
    /// Names queued for the writer.
    pending: HashSet<String>,
}

/// A block's name and its depth in its chain (1 for the first block).
type Named = (String, usize);

enum Work {
    /// A new block, below `parent` (`None` for a chain's first).
    Write {
        name: Named,
        parent: Option<String>,
        block: RawBlock,
    },
    /// Renew the files' place in the eviction order (a sequence used them).
    Touch(Vec<Named>),
}

/// The time a block is marked as last used: deeper blocks a little older, so that eviction
/// takes a chain from its end (whose blocks nothing else needs) rather than from its start
/// (which would leave the rest unreachable, and every sharer of the prefix without it). The
/// writer keeps every block older than its parent, so the oldest file is always a leaf.
fn used_at(now: SystemTime, depth: usize) -> SystemTime {
    now.checked_sub(Duration::from_micros(depth as u64))
        .unwrap_or(now)
}

/// Counts of what the tier did, for metrics.
#[derive(Debug, Default)]
pub struct DiskStats {
    pub written: AtomicU64,
    pub dropped: AtomicU64,
    pub skipped: AtomicU64,
    pub evicted: AtomicU64,
    /// Bytes of block files in the directory, as the writer last saw it.
    pub bytes: AtomicU64,
}

pub struct DiskTier {
    dir: PathBuf,
    model: String,
    block: usize,
    budget: u64,
    index: Arc<Mutex<Index>>,
    pending: Arc<AtomicU64>,
    stats: Arc<DiskStats>,
    work: Option<Sender<Work>>,
    writer: Option<std::thread::JoinHandle<()>>,
}

/// What a restore read from disk.
pub struct DiskRestore {
    pub restored: Restored,
    /// Blocks read.
    pub blocks: usize,
}

impl DiskTier {
    /// Opens (creating) the tier's directory for the model `model` (a key naming the weights,
    /// the drafter and the compute dtype: what the caches' contents depend on), in blocks of
    /// `block` positions.
    pub fn open(config: &DiskConfig, model: &str, block: usize) -> std::io::Result<DiskTier> {
        std::fs::create_dir_all(&config.dir)?;
        // Fail now, not in the writer, when the directory cannot be locked or written.
        File::create(config.dir.join(".lock"))?;
        let stats = Arc::new(DiskStats::default());
        let index = Arc::new(Mutex::new(Index::default()));
        {
            let lock = DirLock::take(&config.dir, LOCK_WAIT).ok();
            let mut files = scan(&config.dir)?;
            if lock.is_some() {
                evict(&config.dir, &mut files, config.budget, 0, None, &stats);
            }
            stats
                .bytes
                .store(files.values().map(|h| h.bytes).sum(), Ordering::Relaxed);
            index.lock().unwrap_or_else(|e| e.into_inner()).files = files;
            drop(lock);
        }
        let (tx, rx) = std::sync::mpsc::channel();
        let pending = Arc::new(AtomicU64::new(0));
        let writer = {
            let (dir, budget) = (config.dir.clone(), config.budget);
            let (index, pending, stats) = (index.clone(), pending.clone(), stats.clone());
            std::thread::Builder::new()
                .name("prefix-disk".into())
                .spawn(move || writer_main(rx, dir, budget, index, pending, stats))?
        };
        Ok(DiskTier {
            dir: config.dir.clone(),
            model: model.to_string(),
            block: block.max(1),
            budget: config.budget,
            index,
            pending,
            stats,
            work: Some(tx),
            writer: Some(writer),
        })
    }

    pub fn stats(&self) -> &Arc<DiskStats> {
        &self.stats
    }

    pub fn budget(&self) -> u64 {
        self.budget
    }

    pub fn block(&self) -> usize {
        self.block
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(format!("{name}.{SUFFIX}"))
    }

    fn index(&self) -> std::sync::MutexGuard<'_, Index> {
        self.index.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The block names of `tokens`' whole blocks, in order, with each one's parent.
    fn chain(&self, fresh: &[LayerCache], tokens: &[u32]) -> Vec<(Hash, Hash)> {
        let mut h = chain_root(&self.model, &layout(fresh));
        tokens
            .chunks_exact(self.block)
            .map(|b| {
                let parent = h;
                h = chain_next(&parent, b);
                (parent, h)
            })
            .collect()
    }

    /// Positions of `prompt` the directory could restore for caches like `fresh` (whole blocks
    /// held in a row from the start, leaving the last prompt token to evaluate).
    pub fn depth(&self, prompt: &[u32], fresh: &[LayerCache]) -> usize {
        let limit = prompt.len().saturating_sub(1);
        self.chain(fresh, &prompt[..limit])
            .iter()
            .take_while(|(_, h)| self.holds(&hex::encode(h)))
            .count()
            * self.block
    }

    /// Whether the directory holds block `name`: the index, or (another runner may have
    /// written it since this one last looked) the file itself.
    fn holds(&self, name: &str) -> bool {
        if self.index().files.contains_key(name) {
            return true;
        }
        match std::fs::metadata(self.path(name)) {
            Ok(md) if md.is_file() => {
                let used = md.modified().unwrap_or(SystemTime::UNIX_EPOCH);
                let held = Held {
                    bytes: md.len(),
                    used,
                };
                self.index().files.insert(name.to_string(), held);
                true
            }
            _ => false,
        }
    }

    /// Caches for `prompt` restored from the directory when it holds more of the prompt than
    /// `beyond` positions; `None` otherwise. A block that fails its checks is skipped (with a
    /// warning, and removed) and the restore ends before it.
    pub fn restore(
        &self,
        prompt: &[u32],
        fresh: Vec<LayerCache>,
        beyond: usize,
    ) -> Option<DiskRestore> {
        if self.depth(prompt, &fresh) <= beyond {
            return None;
        }
        let limit = prompt.len().saturating_sub(1);
        let chain = self.chain(&fresh, &prompt[..limit]);
        let root = hex::encode(chain_root(&self.model, &layout(&fresh)));
        let mut blocks: Vec<Block> = Vec::new();
        for (k, (parent, h)) in chain.iter().enumerate() {
            let name = hex::encode(h);
            if !self.holds(&name) {
                break;
            }
            let start = k * self.block;
            let want = Expect {
                root: &root,
                parent: &hex::encode(parent),
                start,
                tokens: &prompt[start..start + self.block],
                fresh: &fresh,
            };
            match read_block(&self.path(&name), &want) {
                Ok(b) => {
                    blocks.push(b);
                    spend_windows(&mut blocks, &fresh);
                }
                Err(Skip::Gone) => {
                    self.index().files.remove(&name);
                    break;
                }
                Err(Skip::Unreadable(why)) => {
                    tracing::warn!(
                        "prefix cache file {} not read: {why}",
                        self.path(&name).display()
                    );
                    break;
                }
                Err(Skip::Bad(why)) => {
                    tracing::warn!(
                        "prefix cache file {} skipped: {why}",
                        self.path(&name).display()
                    );
                    self.stats.skipped.fetch_add(1, Ordering::Relaxed);
                    self.index().files.remove(&name);
                    let _ = std::fs::remove_file(self.path(&name));
                    break;
                }
            }
        }
        let cached = blocks.len() * self.block;
        if cached <= beyond {
            return None;
        }
        let caches = match assemble(fresh, &blocks, cached) {
            Ok(c) => c,
            Err(e) => {
                // Blocks that pass their checks but do not fit together: removed, so that
                // every later request with this prefix does not read them again.
                tracing::warn!("prefix cache blocks skipped: they do not fit together: {e}");
                self.stats.skipped.fetch_add(1, Ordering::Relaxed);
                for (_, h) in &chain[..blocks.len()] {
                    let name = hex::encode(h);
                    self.index().files.remove(&name);
                    let _ = std::fs::remove_file(self.path(&name));
                }
                return None;
            }
        };
        let names = chain[..blocks.len()]
            .iter()
            .enumerate()
            .map(|(k, (_, h))| (hex::encode(h), k + 1))
            .collect();
        if let Some(w) = &self.work {
            let _ = w.send(Work::Touch(names));
        }
        Some(DiskRestore {
            restored: Restored {
                caches,
                cached,
                matched: cached,
            },
            blocks: blocks.len(),
        })
    }

    /// Queues the whole blocks of a finished sequence the directory does not hold yet: `tokens`
    /// are what `caches` hold, `checkpoints` the sliding-window snapshots it took (a block of a
    /// model with sliding-window layers needs one at its end). Returns the blocks queued.
    pub fn store(
        &self,
        tokens: &[u32],
        caches: &[LayerCache],
        checkpoints: &[(usize, CacheCheckpoint)],
    ) -> Result<usize> {
        let held = held_by_all(caches, tokens.len());
        let rotating = needs_checkpoints(caches);
        let aligned = caches.iter().all(|c| c.offset() == held);
        let root = hex::encode(chain_root(&self.model, &layout(caches)));
        let chain = self.chain(caches, &tokens[..held]);
        // Blocks already held are renewed first, so that the new ones hang below a prefix
        // that counts as just used (see [`used_at`]).
        let names: Vec<String> = chain.iter().map(|(_, h)| hex::encode(h)).collect();
        let held_now: Vec<bool> = names.iter().map(|n| self.holds(n)).collect();
        let pending: Vec<bool> = {
            let index = self.index();
            names.iter().map(|n| index.pending.contains(n)).collect()
        };
        // The held blocks a restore could reach (the run from the first): renewed. One past a
        // gap is not, so that it ages out.
        let known: Vec<Named> = names
            .iter()
            .zip(&held_now)
            .take_while(|(_, &h)| h)
            .enumerate()
            .map(|(k, (n, _))| (n.clone(), k + 1))
            .collect();
        let Some(work) = &self.work else {
            return Ok(0);
        };
        let mut queued = 0;
        for (k, (parent, h)) in chain.iter().enumerate() {
            let name = hex::encode(h);
            if held_now[k] || pending[k] {
                continue;
            }
            let (start, end) = (k * self.block, (k + 1) * self.block);
            let live;
            let checkpoint = if !rotating {
                None
            } else if let Some((_, c)) = checkpoints.iter().find(|(p, _)| *p == end) {
                Some(c)
            } else if aligned && end == held {
                live = CacheCheckpoint::of(caches);
                Some(&live)
            } else {
                // Without this block the later ones cannot be reached.
                break;
            };
            if self.pending.load(Ordering::Relaxed) >= MOST_PENDING.min(self.budget) {
                self.stats.dropped.fetch_add(1, Ordering::Relaxed);
                break;
            }
            let meta = Meta {
                root: &root,
                parent: &hex::encode(parent),
                start,
                tokens: &tokens[start..end],
            };
            let block = block_tensors(caches, checkpoint, start, end, &meta)?;
            if block.bytes() > self.budget {
                break;
            }
            if queued == 0 && !known.is_empty() {
                let _ = work.send(Work::Touch(known.clone()));
            }
            self.pending.fetch_add(block.bytes(), Ordering::Relaxed);
            self.index().pending.insert(name.clone());
            let parent = (k > 0).then(|| hex::encode(parent));
            if work
                .send(Work::Write {
                    name: (name, k + 1),
                    parent,
                    block,
                })
                .is_err()
            {
                break;
            }
            queued += 1;
        }
        if queued == 0 && !known.is_empty() {
            let _ = work.send(Work::Touch(known));
        }
        Ok(queued)
    }

    /// Waits until every queued block is written (tests, shutdown).
    pub fn flush(&self) {
        while !self.index().pending.is_empty() {
            std::thread::sleep(Duration::from_millis(5));
            if self.writer.as_ref().is_none_or(|w| w.is_finished()) {
                return;
            }
        }
    }
}

impl Drop for DiskTier {
    /// Lets the writer finish what is queued (bounded by [`MOST_PENDING`]), so that blocks of
    /// the last requests before a shutdown are kept.
    fn drop(&mut self) {
        drop(self.work.take());
        if let Some(w) = self.writer.take() {
            let _ = w.join();
        }
    }
}

/// The chain fields a block carries.
struct Meta<'a> {
    root: &'a str,
    parent: &'a str,
    start: usize,
    tokens: &'a [u32],
}

/// What a block read for a restore must be.
struct Expect<'a> {
    root: &'a str,
    parent: &'a str,
    start: usize,
    tokens: &'a [u32],
    fresh: &'a [LayerCache],
}

/// One block's per-layer data.
struct Block {
    layers: Vec<BlockLayer>,
    /// Positions it covers.
    len: usize,
}

enum BlockLayer {
    Kv(Rows, Rows),
    Latent(Rows),
    /// A sliding-window layer's keys and values of the block's own positions that its window
    /// still held at the block's end (all of them where the window holds a block; the last
    /// ones, ending at the block's end, where it is shorter), in time order, and how many
    /// positions the window held there (what a restore at the block's end gives it back).
    Window(Rows, Rows, usize),
    /// A window state a later block supersedes, let go.
    Spent,
}

fn tensor_names(i: usize, c: &LayerCache) -> Vec<String> {
    match c {
        LayerCache::Kv(_) => vec![format!("{i}.keys"), format!("{i}.values")],
        LayerCache::Latent(_) => vec![format!("{i}.rows")],
        LayerCache::Rotating(_) => vec![
            format!("{i}.window_keys"),
            format!("{i}.window_values"),
            format!("{i}.window_held"),
        ],
    }
}

/// The tensors that hold `rows` under the name `base`: itself for dense rows; `base.q`,
/// `base.scales` and `base.biases` for quantized ones.
fn named<'a>(base: &str, rows: &'a Rows) -> Vec<(String, &'a Array)> {
    match rows {
        Rows::Dense(a) => vec![(base.to_string(), a)],
        Rows::Affine(q) => [
            Some((format!("{base}.q"), &q.weight)),
            Some((format!("{base}.scales"), &q.scales)),
            q.biases.as_ref().map(|b| (format!("{base}.biases"), b)),
        ]
        .into_iter()
        .flatten()
        .collect(),
    }
}

/// A block's tensors as bytes and its chain fields, made on the engine thread; the writer
/// checksums and encodes them ([`RawBlock::encode`]).
struct RawBlock {
    tensors: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)>,
    metadata: HashMap<String, String>,
}

impl RawBlock {
    fn bytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.3.len() as u64).sum()
    }

    /// The file's bytes: the tensors (in name order) and the metadata with their sha256.
    fn encode(mut self) -> std::result::Result<Vec<u8>, String> {
        let mut sum = Sha256::new();
        for t in &self.tensors {
            sum.update(&t.3);
        }
        self.metadata
            .insert("sha256".into(), hex::encode(sum.finalize()));
        let views = self
            .tensors
            .iter()
            .map(|(n, d, s, b)| {
                safetensors::tensor::TensorView::new(*d, s.clone(), b)
                    .map(|v| (n.clone(), v))
                    .map_err(|e| format!("{n}: {e}"))
            })
            .collect::<std::result::Result<Vec<_>, _>>()?;
        safetensors::serialize(views, &Some(self.metadata)).map_err(|e| e.to_string())
    }
}

/// Block `start..end`: those positions of every layer that keeps positions, the sliding-window
/// layers' state at `end` from `checkpoint`.
fn block_tensors(
    caches: &[LayerCache],
    checkpoint: Option<&CacheCheckpoint>,
    start: usize,
    end: usize,
    meta: &Meta,
) -> Result<RawBlock> {
    let mut rows: Vec<(String, Rows)> = Vec::new();
    for (i, c) in caches.iter().enumerate() {
        let names = tensor_names(i, c);
        match c {
            LayerCache::Kv(kv) => {
                let (k, v) = kv.copy_range(start, end)?;
                rows.push((names[0].clone(), k));
                rows.push((names[1].clone(), v));
            }
            LayerCache::Latent(l) => rows.push((names[0].clone(), l.copy_range(start, end)?)),
            LayerCache::Rotating(_) => {
                let state = checkpoint
                    .and_then(|cp| cp.layers.get(i).cloned().flatten())
                    .map(|r| r.linear_state())
                    .transpose()?
                    .flatten()
                    .ok_or_else(|| CacheError::Rewind {
                        n: end,
                        why: format!("no sliding-window state of layer {i} at position {end}"),
                    })?;
                // The block's own positions only: a later block's window is rebuilt from the
                // blocks before it (see `assemble`), so no position is written twice. (Whole
                // windows in every block made a gemma4 31B block 170 MB, and the writer's
                // queue dropped blocks of a 2k-token prompt.)
                let held = state.0.time_len();
                let own = held.min(end - start);
                // A tensor, not metadata, so that the checksum covers it.
                let count = Array::from_slice(&[held as i32], &[1, 1, 1, 1])?;
                rows.push((names[2].clone(), Rows::Dense(count)));
                rows.push((names[0].clone(), state.0.time(held - own, held)?));
                rows.push((names[1].clone(), state.1.time(held - own, held)?));
            }
        }
    }
    let mut tensors: Vec<(String, &Array)> = rows.iter().flat_map(|(n, r)| named(n, r)).collect();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    let refs: Vec<&Array> = tensors.iter().map(|(_, a)| *a).collect();
    mlx::eval(&refs)?;
    let mut data = Vec::with_capacity(tensors.len());
    for (name, a) in &tensors {
        let dtype = mlx::io::safetensors_dtype(a.dtype()).ok_or_else(|| CacheError::Shape {
            got: format!("{name}: dtype {:?}", a.dtype()),
        })?;
        let shape: Vec<usize> = a.shape().iter().map(|&d| d as usize).collect();
        data.push((name.clone(), dtype, shape, a.to_bytes()?));
    }
    let metadata = [
        ("format", FORMAT.to_string()),
        ("root", meta.root.to_string()),
        ("parent", meta.parent.to_string()),
        ("start", meta.start.to_string()),
        ("tokens", tokens_text(meta.tokens)),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    Ok(RawBlock {
        tensors: data,
        metadata,
    })
}

enum Skip {
    /// Removed meanwhile (another runner evicted it): a miss, not a fault.
    Gone,
    /// Not readable now (permissions, an I/O error): a miss; the file is left alone.
    Unreadable(String),
    /// Its contents fail a check: removed.
    Bad(String),
}

/// Reads and checks one block (see the module docs).
fn read_block(path: &Path, want: &Expect) -> std::result::Result<Block, Skip> {
    let buf = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(Skip::Gone),
        Err(e) => return Err(Skip::Unreadable(e.to_string())),
    };
    let bad = |why: String| Skip::Bad(why);
    let (_, header) = safetensors::SafeTensors::read_metadata(&buf)
        .map_err(|e| bad(format!("not a safetensors file: {e}")))?;
    let meta = header.metadata().clone().unwrap_or_default();
    let field = |k: &str| meta.get(k).map(String::as_str).unwrap_or("");
    if field("format") != FORMAT {
        return Err(bad(format!("format {:?}, not {FORMAT:?}", field("format"))));
    }
    let tokens = tokens_text(want.tokens);
    let start = want.start.to_string();
    for (k, expected) in [
        ("root", want.root),
        ("parent", want.parent),
        ("start", start.as_str()),
        ("tokens", tokens.as_str()),
    ] {
        if field(k) != expected {
            return Err(bad(format!(
                "its {k} is not this prefix's (another model's or another prompt's block)"
            )));
        }
    }
    let st = safetensors::SafeTensors::deserialize(&buf)
        .map_err(|e| bad(format!("not a safetensors file: {e}")))?;
    let mut names: Vec<String> = st.names().into_iter().cloned().collect();
    names.sort();
    let mut sum = Sha256::new();
    for n in &names {
        sum.update(st.tensor(n).map_err(|e| bad(e.to_string()))?.data());
    }
    if hex::encode(sum.finalize()) != field("sha256") {
        return Err(bad("its data does not match its checksum".into()));
    }
    let array = |name: &str| -> std::result::Result<Array, Skip> {
        let t = st
            .tensor(name)
            .map_err(|_| bad(format!("it has no tensor {name}")))?;
        let dtype = mlx::io::dtype_of(t.dtype())
            .ok_or_else(|| bad(format!("tensor {name} has dtype {:?}", t.dtype())))?;
        let shape: Vec<i32> = t.shape().iter().map(|&d| d as i32).collect();
        if shape.len() != 4 {
            return Err(bad(format!("tensor {name} has shape {shape:?}")));
        }
        Array::from_bytes(t.data(), &shape, dtype).map_err(|e| bad(format!("tensor {name}: {e}")))
    };
    let mut used = 0;
    // The rows named `base` (dense, or quantized as `base.q` + scales + biases in a quantized
    // cache's block).
    let mut rows = |base: &str, format: RowFormat| -> std::result::Result<Rows, Skip> {
        let q = format!("{base}.q");
        let (arrays, bits) = match format {
            RowFormat::Affine { bits } if names.contains(&q) => (
                vec![
                    array(&q)?,
                    array(&format!("{base}.scales"))?,
                    array(&format!("{base}.biases"))?,
                ],
                Some(bits),
            ),
            _ => (vec![array(base)?], None),
        };
        used += arrays.len();
        Rows::from_arrays(arrays, bits).map_err(|e| bad(format!("tensor {base}: {e}")))
    };
    let positions = |a: &Rows, name: &str, ok: &dyn Fn(usize) -> bool| {
        let t = a.time_len();
        if ok(t) {
            Ok(())
        } else {
            Err(bad(format!("tensor {name} holds {t} positions")))
        }
    };
    let block = want.tokens.len();
    // The windows' length tensors, beside the rows `used` counts.
    let mut counts = 0;
    let mut layers = Vec::with_capacity(want.fresh.len());
    for (i, c) in want.fresh.iter().enumerate() {
        let n = tensor_names(i, c);
        let f = c.format();
        layers.push(match c {
            LayerCache::Kv(_) => {
                let (k, v) = (rows(&n[0], f)?, rows(&n[1], f)?);
                positions(&k, &n[0], &|t| t == block)?;
                positions(&v, &n[1], &|t| t == block)?;
                BlockLayer::Kv(k, v)
            }
            LayerCache::Latent(_) => {
                let r = rows(&n[0], f)?;
                positions(&r, &n[0], &|t| t == block)?;
                BlockLayer::Latent(r)
            }
            LayerCache::Rotating(_) => {
                let (k, v) = (rows(&n[0], f)?, rows(&n[1], f)?);
                positions(&k, &n[0], &|t| t >= 1 && t <= block)?;
                positions(&v, &n[1], &|t| t == k.time_len())?;
                let count = array(&n[2])?;
                counts += 1;
                let held = (count.size() == 1 && count.dtype() == mlx::Dtype::I32)
                    .then(|| count.item::<i32>().ok())
                    .flatten()
                    .and_then(|h| usize::try_from(h).ok())
                    .filter(|&h| h >= k.time_len() && h <= want.start + block)
                    .ok_or_else(|| bad(format!("tensor {} is not a window's length", n[2])))?;
                BlockLayer::Window(k, v, held)
            }
        });
    }
    if used + counts != names.len() {
        return Err(bad(format!(
            "it has {} tensors, these caches {}",
            names.len(),
            used + counts
        )));
    }
    Ok(Block { layers, len: block })
}

/// Caches at position `upto` from consecutive blocks.
fn assemble(fresh: Vec<LayerCache>, blocks: &[Block], upto: usize) -> Result<Vec<LayerCache>> {
    let mut out = Vec::with_capacity(fresh.len());
    for (i, layer) in fresh.into_iter().enumerate() {
        let parts = blocks.iter().map(|b| &b.layers[i]);
        out.push(match layer {
            LayerCache::Kv(fresh) => {
                let (mut ks, mut vs) = (Vec::new(), Vec::new());
                for p in parts {
                    if let BlockLayer::Kv(k, v) = p {
                        ks.push(k);
                        vs.push(v);
                    }
                }
                LayerCache::Kv(KvCache::from_runs(&ks, &vs, fresh.format())?)
            }
            LayerCache::Latent(fresh) => {
                let rs: Vec<&Rows> = parts
                    .filter_map(|p| match p {
                        BlockLayer::Latent(r) => Some(r),
                        _ => None,
                    })
                    .collect();
                LayerCache::Latent(LatentCache::from_runs(&rs, &fresh)?)
            }
            LayerCache::Rotating(r) => {
                let (ks, vs, need) = window_runs(blocks, i);
                let (k, v) = match (Rows::concat(&ks), Rows::concat(&vs)) {
                    (Ok(k), Ok(v)) if !ks.is_empty() && k.time_len() >= need => (k, v),
                    _ => {
                        return Err(CacheError::Rewind {
                            n: upto,
                            why: format!("no sliding-window state of layer {i}"),
                        })
                    }
                };
                let t = k.time_len();
                let (k, v) = (k.time(t - need, t)?, v.time(t - need, t)?);
                LayerCache::Rotating(r.with_linear_state(k, v, upto)?)
            }
        });
    }
    Ok(out)
}

/// Lets go of the window runs that no restore at the last block's end reads (see
/// [`window_runs`]).
fn spend_windows(blocks: &mut [Block], fresh: &[LayerCache]) {
    for (i, c) in fresh.iter().enumerate() {
        if !matches!(c, LayerCache::Rotating(_)) {
            continue;
        }
        let used = window_runs(blocks, i).0.len();
        let older = blocks.len() - used;
        for b in &mut blocks[..older] {
            b.layers[i] = BlockLayer::Spent;
        }
    }
}

/// Layer `i`'s window runs of the last blocks, oldest first, and how many positions the window
/// held at the last block's end: from the last block back until the runs hold that many, while
/// each run reaches back to its block's start (so that they join without a gap).
fn window_runs(blocks: &[Block], i: usize) -> (Vec<&Rows>, Vec<&Rows>, usize) {
    let (mut ks, mut vs) = (Vec::new(), Vec::new());
    let need = match blocks.last().map(|b| &b.layers[i]) {
        Some(BlockLayer::Window(_, _, held)) => *held,
        _ => 0,
    };
    let mut got = 0;
    for b in blocks.iter().rev() {
        if got >= need {
            break;
        }
        let BlockLayer::Window(k, v, _) = &b.layers[i] else {
            break;
        };
        ks.push(k);
        vs.push(v);
        got += k.time_len();
        if k.time_len() < b.len {
            break;
        }
    }
    ks.reverse();
    vs.reverse();
    (ks, vs, need)
}

/// An exclusive advisory lock on the directory (held by whichever runner is writing).
struct DirLock(File);

impl DirLock {
    /// The lock, waiting at most `wait` for another runner to let it go (one stopped or stuck
    /// on a slow disk while holding it must not hang this one's start or shutdown).
    fn take(dir: &Path, wait: Duration) -> std::io::Result<DirLock> {
        let f = File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(dir.join(".lock"))?;
        let start = std::time::Instant::now();
        loop {
            match f.try_lock() {
                Ok(()) => return Ok(DirLock(f)),
                Err(std::fs::TryLockError::WouldBlock) if start.elapsed() < wait => {
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(std::fs::TryLockError::WouldBlock) => {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        format!(
                            "another runner has held {} for {wait:?}",
                            dir.join(".lock").display()
                        ),
                    ))
                }
                Err(std::fs::TryLockError::Error(e)) => return Err(e),
            }
        }
    }
}

/// How long a runner waits for the directory's lock: at start (then it goes on without the
/// first eviction) and per batch of writes (then the batch is dropped).
const LOCK_WAIT: Duration = Duration::from_secs(2);

impl Drop for DirLock {
    fn drop(&mut self) {
        let _ = self.0.unlock();
    }
}

/// The block files in `dir` (and what dead writers left behind, removed).
fn scan(dir: &Path) -> std::io::Result<HashMap<String, Held>> {
    let mut files = HashMap::new();
    for e in std::fs::read_dir(dir)? {
        let Ok(e) = e else { continue };
        let name = e.file_name().to_string_lossy().into_owned();
        let Ok(md) = e.metadata() else { continue };
        if !md.is_file() {
            continue;
        }
        let used = md.modified().unwrap_or(SystemTime::UNIX_EPOCH);
        if name.ends_with(".tmp") {
            if used.elapsed().unwrap_or_default() > STALE_TEMP {
                let _ = std::fs::remove_file(e.path());
            }
            continue;
        }
        if let Some(stem) = name.strip_suffix(&format!(".{SUFFIX}")) {
            files.insert(
                stem.to_string(),
                Held {
                    bytes: md.len(),
                    used,
                },
            );
        }
    }
    Ok(files)
}

/// Removes the least recently used files until `incoming` more bytes fit in `budget`, taking
/// only files last used before `before` (the incoming block's own time: a block is not worth
/// more than the ones it would push out); returns whether they fit.
fn evict(
    dir: &Path,
    files: &mut HashMap<String, Held>,
    budget: u64,
    incoming: u64,
    before: Option<SystemTime>,
    stats: &DiskStats,
) -> bool {
    let mut total: u64 = files.values().map(|h| h.bytes).sum();
    if total + incoming <= budget {
        return true;
    }
    let mut order: Vec<(SystemTime, String)> = files
        .iter()
        .filter(|(_, h)| before.is_none_or(|b| h.used < b))
        .map(|(n, h)| (h.used, n.clone()))
        .collect();
    order.sort();
    for (_, name) in order {
        if total + incoming <= budget {
            break;
        }
        let path = dir.join(format!("{name}.{SUFFIX}"));
        match std::fs::remove_file(&path) {
            Ok(()) => stats.evicted.fetch_add(1, Ordering::Relaxed),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => 0,
            // A file that cannot be removed still counts against the budget.
            Err(_) => continue,
        };
        if let Some(h) = files.remove(&name) {
            total -= h.bytes;
        }
    }
    total + incoming <= budget
}

fn shared(i: &Mutex<Index>) -> std::sync::MutexGuard<'_, Index> {
    i.lock().unwrap_or_else(|e| e.into_inner())
}

fn writer_main(
    rx: Receiver<Work>,
    dir: PathBuf,
    budget: u64,
    index: Arc<Mutex<Index>>,
    pending: Arc<AtomicU64>,
    stats: Arc<DiskStats>,
) {
    while let Ok(first) = rx.recv() {
        // Everything queued so far, under one lock and one scan of the directory.
        let mut batch = vec![first];
        batch.extend(rx.try_iter());
        let lock = match DirLock::take(&dir, LOCK_WAIT) {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!("prefix cache directory {} unusable: {e}", dir.display());
                for w in batch {
                    if let Work::Write {
                        name: (name, _),
                        block,
                        ..
                    } = w
                    {
                        pending.fetch_sub(block.bytes(), Ordering::Relaxed);
                        shared(&index).pending.remove(&name);
                        stats.dropped.fetch_add(1, Ordering::Relaxed);
                    }
                }
                continue;
            }
        };
        // Other runners may have written or evicted since: the directory is the truth.
        let mut files = scan(&dir).unwrap_or_else(|_| shared(&index).files.clone());
        for w in batch {
            match w {
                Work::Touch(names) => {
                    let now = SystemTime::now();
                    for (n, depth) in names {
                        let path = dir.join(format!("{n}.{SUFFIX}"));
                        let used = used_at(now, depth);
                        if let Ok(f) = File::options().write(true).open(&path) {
                            let _ = f.set_modified(used);
                        }
                        if let Some(h) = files.get_mut(&n) {
                            h.used = used;
                        }
                    }
                }
                Work::Write {
                    name: (name, depth),
                    parent,
                    block,
                } => {
                    let queued = block.bytes();
                    pending.fetch_sub(queued, Ordering::Relaxed);
                    let bytes = match block.encode() {
                        Ok(b) => b,
                        Err(e) => {
                            tracing::warn!("prefix cache block not written: {e}");
                            stats.dropped.fetch_add(1, Ordering::Relaxed);
                            shared(&index).pending.remove(&name);
                            continue;
                        }
                    };
                    let len = bytes.len() as u64;
                    // Below its parent's time; without its parent it could never be read.
                    let mut used = Some(used_at(SystemTime::now(), depth));
                    if let Some(p) = &parent {
                        used = files
                            .get(p)
                            .and_then(|h| h.used.checked_sub(Duration::from_micros(1)))
                            .and_then(|u| used.map(|n| n.min(u)));
                    }
                    let fits = |u: &SystemTime, files: &mut HashMap<String, Held>| {
                        evict(&dir, files, budget, len, Some(*u), &stats)
                    };
                    if let Some(h) = files.get_mut(&name) {
                        // Another runner wrote it meanwhile: this use renews it.
                        let now = used_at(SystemTime::now(), depth);
                        if let Ok(f) = File::options()
                            .write(true)
                            .open(dir.join(format!("{name}.{SUFFIX}")))
                        {
                            let _ = f.set_modified(now);
                        }
                        h.used = h.used.max(now);
                    } else {
                        match used.filter(|u| fits(u, &mut files)) {
                            None => {
                                stats.dropped.fetch_add(1, Ordering::Relaxed);
                            }
                            Some(used) => match write_file(&dir, &name, &bytes, used) {
                                Ok(()) => {
                                    stats.written.fetch_add(1, Ordering::Relaxed);
                                    files.insert(name.clone(), Held { bytes: len, used });
                                }
                                Err(e) => {
                                    tracing::warn!("prefix cache block not written: {e}");
                                    stats.dropped.fetch_add(1, Ordering::Relaxed);
                                }
                            },
                        }
                    }
                    let mut g = shared(&index);
                    g.pending.remove(&name);
                    g.files = files.clone();
                }
            }
        }
        let mut g = shared(&index);
        stats
            .bytes
            .store(files.values().map(|h| h.bytes).sum(), Ordering::Relaxed);
        g.files = files;
        drop(g);
        drop(lock);
    }
}

/// Writes a block through a temporary file and a rename: readers see all of it or none.
fn write_file(dir: &Path, name: &str, bytes: &[u8], used: SystemTime) -> std::io::Result<()> {
    use std::io::Write;
    let tmp = dir.join(format!(".{name}.{}.tmp", std::process::id()));
    let result = (|| {
        let mut f = File::create(&tmp)?;
        f.write_all(bytes)?;
        f.set_modified(used)?;
        std::fs::rename(&tmp, dir.join(format!("{name}.{SUFFIX}")))
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}
