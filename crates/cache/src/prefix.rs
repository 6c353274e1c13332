//! The prefix cache: past sequences' cache state in a [`Trie`], so that a request whose prompt
//! starts like an earlier prompt (or an earlier prompt plus its answer) resumes from there
//! instead of prefilling it again.
//!
//! Caches that keep every position (full-attention KV, MLA latents) store their data per trie
//! edge and can be restored to any position. The rotating sliding-window cache keeps only its
//! last `window` tokens, so it can only be restored where a snapshot of its whole state was
//! taken: during prefill at regular intervals, just before the end of the prompt, at branch
//! points, and at the end of every sequence. A hit therefore resumes at the deepest snapshot at
//! or before the matched length, and reports how many matched tokens it had to recompute.
//!
//! The runner keeps the live state in each sequence's own caches; the trie holds only copies,
//! taken when a sequence ends (what it computed, whether it finished or was cancelled). Nothing
//! live is ever evicted.

use crate::trie::{Checkpoint, Match, Segment, Trie};
use crate::{CacheError, KvCache, LatentCache, LayerCache, Result, RotatingKvCache};
use mlx::{Array, Rows};
use std::rc::Rc;

/// One layer's data for a run of positions.
#[derive(Debug, Clone)]
enum LayerRun {
    Kv(Rows, Rows),
    Latent(Rows),
    /// Rotating layers keep nothing per position (see [`CacheCheckpoint`]).
    None,
}

impl LayerRun {
    fn slice(&self, start: usize, end: usize) -> Result<LayerRun> {
        let s = |a: &Rows| -> Result<Rows> { Ok(a.time(start, end)?) };
        Ok(match self {
            LayerRun::Kv(k, v) => LayerRun::Kv(s(k)?, s(v)?),
            LayerRun::Latent(r) => LayerRun::Latent(s(r)?),
            LayerRun::None => LayerRun::None,
        })
    }

    fn bytes(&self) -> usize {
        match self {
            LayerRun::Kv(k, v) => k.nbytes() + v.nbytes(),
            LayerRun::Latent(r) => r.nbytes(),
            LayerRun::None => 0,
        }
    }
}

/// Positions `offset..offset + len` of a stored copy (shared by the pieces a split makes).
#[derive(Debug, Clone)]
struct Piece {
    offset: usize,
    len: usize,
    /// Per-layer data for `full` positions.
    data: Rc<Vec<LayerRun>>,
    full: usize,
}

impl Piece {
    fn layer(&self, i: usize, take: usize) -> Result<LayerRun> {
        self.data[i].slice(self.offset, self.offset + take.min(self.len))
    }
}

/// Every layer's data for a run of positions, kept as a list of pieces so that splitting and
/// joining never touch the arrays.
#[derive(Debug, Clone)]
pub struct CacheRun {
    len: usize,
    pieces: Vec<Piece>,
}

impl Segment for CacheRun {
    fn len(&self) -> usize {
        self.len
    }

    fn split(self, at: usize) -> (Self, Self) {
        let (mut head, mut tail) = (Vec::new(), Vec::new());
        let mut pos = 0;
        for p in self.pieces {
            let n = p.len;
            if pos + n <= at {
                head.push(p);
            } else if pos >= at {
                tail.push(p);
            } else {
                let cut = at - pos;
                head.push(Piece {
                    len: cut,
                    ..p.clone()
                });
                tail.push(Piece {
                    offset: p.offset + cut,
                    len: n - cut,
                    ..p
                });
            }
            pos += n;
        }
        let len = |v: &Vec<Piece>| v.iter().map(|p| p.len).sum();
        (
            CacheRun {
                len: len(&head),
                pieces: head,
            },
            CacheRun {
                len: len(&tail),
                pieces: tail,
            },
        )
    }

    fn join(mut self, next: Self) -> Self {
        self.len += next.len;
        self.pieces.extend(next.pieces);
        self
    }

    /// Each piece's share of its copy's bytes.
    fn bytes(&self) -> usize {
        self.pieces
            .iter()
            .map(|p| p.data.iter().map(LayerRun::bytes).sum::<usize>() * p.len / p.full.max(1))
            .sum()
    }
}

/// The whole state of every rotating layer at one position (`None` for other layers).
#[derive(Debug, Clone)]
pub struct CacheCheckpoint {
    pub(crate) layers: Vec<Option<RotatingKvCache>>,
}

impl CacheCheckpoint {
    /// Snapshots the rotating layers of `caches` (their arrays are shared, not copied: the live
    /// cache copies on its next write).
    pub fn of(caches: &[LayerCache]) -> CacheCheckpoint {
        CacheCheckpoint {
            layers: caches
                .iter()
                .map(|c| match c {
                    LayerCache::Rotating(r) => Some(r.clone()),
                    _ => None,
                })
                .collect(),
        }
    }
}

impl Checkpoint for CacheCheckpoint {
    fn bytes(&self) -> usize {
        self.layers
            .iter()
            .flatten()
            .map(RotatingKvCache::nbytes)
            .sum()
    }
}

/// Positions every one of `caches` holds, at most `tokens` (a drafter's caches may trail the
/// target's by a few tokens).
pub(crate) fn held_by_all(caches: &[LayerCache], tokens: usize) -> usize {
    caches
        .iter()
        .map(LayerCache::offset)
        .min()
        .unwrap_or(0)
        .min(tokens)
}

/// Whether restoring these caches needs a checkpoint (any layer is rotating).
pub fn needs_checkpoints(caches: &[LayerCache]) -> bool {
    caches.iter().any(|c| matches!(c, LayerCache::Rotating(_)))
}

/// What [`PrefixCache::restore`] found.
pub struct Restored {
    pub caches: Vec<LayerCache>,
    /// Prompt tokens the caches already hold.
    pub cached: usize,
    /// Prompt tokens that matched the trie (≥ `cached`; the difference was recomputed because
    /// no rotating-cache snapshot sat closer to the end of the match).
    pub matched: usize,
}

type CacheTrie = Trie<CacheRun, CacheCheckpoint>;

/// Tries by the number of caches their sequences held: a sequence that drafts with its own
/// draft caches and one that does not (a request for logprobs) store the same prefix with
/// different layers, and one trie keeps one entry per prefix, so each set of caches gets its
/// own; they share the budget and one use clock, so eviction is least recently used across
/// all of them.
pub struct PrefixCache {
    tries: Vec<(usize, CacheTrie)>,
    budget: usize,
    interval: usize,
    /// Snapshot and restore where snapshots were taken even if none of this process's caches
    /// rotates: a split model whose other ranks hold sliding-window layers.
    rotates: bool,
}

/// What [`PrefixCache::insert`] stored: what a split model's other ranks repeat with
/// [`PrefixCache::insert_exact`] to keep the same trie.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stored {
    /// Tokens stored (what every cache held).
    pub held: usize,
    /// Positions of the snapshots offered, in the order offered.
    pub checkpoints: Vec<usize>,
    /// Leaves evicted afterwards to keep the budget.
    pub evicted: usize,
    /// Nodes in the tries afterwards: the same on a rank that kept in step.
    pub nodes: usize,
}

impl PrefixCache {
    /// `budget` bytes of snapshots; rotating-cache snapshots every `interval` prompt tokens.
    pub fn new(budget: usize, interval: usize) -> PrefixCache {
        PrefixCache {
            tries: Vec::new(),
            budget,
            interval: interval.max(1),
            rotates: false,
        }
    }

    /// Snapshots as though some layer rotated, whatever `caches` a call passes (see
    /// [`PrefixCache::needs_checkpoints`]).
    pub fn rotating(mut self, rotates: bool) -> PrefixCache {
        self.rotates = rotates;
        self
    }

    /// Whether sequences of `caches` restore only where snapshots were taken.
    pub fn needs_checkpoints(&self, caches: &[LayerCache]) -> bool {
        self.rotates || needs_checkpoints(caches)
    }

    pub fn bytes(&self) -> usize {
        self.tries.iter().map(|(_, t)| t.bytes()).sum()
    }

    /// Nodes stored in all the tries: what they hold, in a number that does not depend on
    /// the caches' widths.
    pub fn nodes(&self) -> usize {
        self.tries.iter().map(|(_, t)| t.node_count()).sum()
    }

    /// The trie for sequences of `layers` caches, its clock raised to the others'.
    fn trie(&mut self, layers: usize) -> &mut CacheTrie {
        let now = self.tries.iter().map(|(_, t)| t.clock()).max().unwrap_or(0);
        let i = match self.tries.iter().position(|(n, _)| *n == layers) {
            Some(i) => i,
            None => {
                self.tries.push((layers, Trie::new()));
                self.tries.len() - 1
            }
        };
        let t = &mut self.tries[i].1;
        t.clock_at_least(now);
        t
    }

    /// Removes the least recently used leaves of all the tries until the budget holds;
    /// returns how many.
    fn evict(&mut self) -> usize {
        let mut n = 0;
        while self.bytes() > self.budget && self.evict_oldest() {
            n += 1;
        }
        n
    }

    /// Removes the least recently used leaf of all the tries: which one depends on the uses
    /// alone, not on bytes, so that tries kept alike on several ranks evict alike.
    fn evict_oldest(&mut self) -> bool {
        let oldest = self
            .tries
            .iter_mut()
            .filter_map(|(_, t)| Some((t.next_victim_used()?, t)))
            .min_by_key(|(used, _)| *used);
        match oldest {
            Some((_, t)) => {
                t.evict_one();
                true
            }
            None => false,
        }
    }

    pub fn budget(&self) -> usize {
        self.budget
    }

    /// Caches for `prompt`, restored to the longest usable stored prefix (leaving at least the
    /// last prompt token to evaluate); `fresh` are empty caches of the right kinds.
    pub fn restore(&mut self, prompt: &[u32], fresh: Vec<LayerCache>) -> Result<Restored> {
        let checkpointed = self.needs_checkpoints(&fresh);
        let trie = self.trie(fresh.len());
        let m = trie.lookup(prompt);
        let trie: &CacheTrie = trie;
        let limit = m.len.min(prompt.len().saturating_sub(1));
        let cached = if checkpointed {
            trie.checkpoints_on(&m)
                .into_iter()
                .filter(|&p| p <= limit)
                .max()
                .unwrap_or(0)
        } else {
            limit
        };
        if cached == 0 || !restorable(trie, &m, cached, fresh.len(), checkpointed) {
            return Ok(Restored {
                caches: fresh,
                cached: 0,
                matched: m.len,
            });
        }
        let caches = build(trie, &m, cached, fresh)?;
        Ok(Restored {
            caches,
            cached,
            matched: m.len,
        })
    }

    /// Where a new sequence should snapshot its rotating caches during prefill: every
    /// `interval` tokens, just before the last prompt token, and at the point where its prompt
    /// left the stored prefix (a branch point later requests are likely to share).
    pub fn plan(&self, prompt_len: usize, cached: usize, matched: usize) -> Vec<usize> {
        let mut v: Vec<usize> = (1..)
            .map(|k| k * self.interval)
            .take_while(|&p| p < prompt_len)
            .filter(|&p| p > cached)
            .collect();
        if prompt_len > 1 && prompt_len - 1 > cached {
            v.push(prompt_len - 1);
        }
        if matched > cached && matched < prompt_len {
            v.push(matched);
        }
        v.sort_unstable();
        v.dedup();
        v
    }

    /// Stores a finished (or cancelled) sequence: `tokens` are what its `caches` hold, and
    /// `checkpoints` the rotating-cache snapshots it took. Evicts down to the budget.
    pub fn insert(
        &mut self,
        tokens: &[u32],
        caches: &[LayerCache],
        mut checkpoints: Vec<(usize, CacheCheckpoint)>,
    ) -> Result<Stored> {
        // Keep only what every cache holds (a drafter may trail the target by a few tokens).
        let held = held_by_all(caches, tokens.len());
        let tokens = &tokens[..held];
        if tokens.is_empty() {
            return Ok(Stored::default());
        }
        let aligned = caches.iter().all(|c| c.offset() == held);
        checkpoints.retain(|(p, _)| *p <= held);
        if self.needs_checkpoints(caches) && aligned {
            checkpoints.push((held, CacheCheckpoint::of(caches)));
        }
        let positions = checkpoints.iter().map(|(p, _)| *p).collect();
        self.store(caches.len(), tokens, caches, checkpoints)?;
        let evicted = self.evict();
        Ok(Stored {
            held,
            checkpoints: positions,
            evicted,
            nodes: self.nodes(),
        })
    }

    /// `tokens` (which `caches` hold) and `checkpoints` into the trie for sequences of `key`
    /// caches.
    fn store(
        &mut self,
        key: usize,
        tokens: &[u32],
        caches: &[LayerCache],
        checkpoints: Vec<(usize, CacheCheckpoint)>,
    ) -> Result<()> {
        let mut failed = None;
        self.trie(key).insert(
            tokens,
            |start, end| match copy_run(caches, start, end) {
                Ok(run) => run,
                Err(e) => {
                    failed = Some(e);
                    CacheRun {
                        len: end - start,
                        pieces: Vec::new(),
                    }
                }
            },
            checkpoints,
        );
        if let Some(e) = failed {
            // The trie now has an edge without data: drop everything rather than serve it.
            *self.trie(key) = Trie::new();
            return Err(e);
        }
        Ok(())
    }

    /// A split model's other ranks keep the same trie as rank 0 (its own layers' data in it),
    /// repeating rank 0's lookups, restores and stores in order; rank 0's budget decides what
    /// goes. These are those calls, `key` being the number of caches rank 0's sequences hold
    /// (which picks the trie).
    ///
    /// The lookup of a request that restored nothing (it still marks what it matched as used).
    pub fn touch(&mut self, key: usize, prompt: &[u32]) {
        self.trie(key).lookup(prompt);
    }

    /// Caches restored to exactly `at` tokens of `prompt` (looked up as rank 0 looked it up),
    /// or `None` where this rank's trie cannot: rank 0 then starts cold as well.
    pub fn restore_exact(
        &mut self,
        key: usize,
        prompt: &[u32],
        fresh: Vec<LayerCache>,
        at: usize,
    ) -> Result<Option<Vec<LayerCache>>> {
        let rotating = needs_checkpoints(&fresh);
        let trie = self.trie(key);
        let m = trie.lookup(prompt);
        let trie: &CacheTrie = trie;
        if at == 0 || at > m.len || !restorable(trie, &m, at, fresh.len(), rotating) {
            return Ok(None);
        }
        build(trie, &m, at, fresh).map(Some)
    }

    /// [`PrefixCache::insert`] as rank 0 did it: `tokens` exactly, the snapshots at the
    /// positions it offered, then `evicted` leaves evicted.
    pub fn insert_exact(
        &mut self,
        key: usize,
        tokens: &[u32],
        caches: &[LayerCache],
        checkpoints: Vec<(usize, CacheCheckpoint)>,
        evicted: usize,
    ) -> Result<()> {
        let stored = if tokens.is_empty() {
            Ok(())
        } else {
            self.store(key, tokens, caches, checkpoints)
        };
        for _ in 0..evicted {
            self.evict_oldest();
        }
        stored
    }
}

/// Whether `trie` can restore `layers` caches to position `at` of `m`: what it stored up to
/// there is for as many caches (each trie holds one set of caches; this only guards that), and
/// where caches rotate, a snapshot of them lies at `at`.
fn restorable(trie: &CacheTrie, m: &Match, at: usize, layers: usize, rotating: bool) -> bool {
    trie.segments_until(m, at)
        .iter()
        .all(|(seg, _)| seg.pieces.iter().all(|p| p.data.len() == layers))
        && match trie.checkpoint_at(m, at) {
            Some(c) => c.layers.len() == layers,
            None => !rotating,
        }
}

/// `fresh` restored from `trie` to position `upto` of `m`.
fn build(
    trie: &CacheTrie,
    m: &Match,
    upto: usize,
    fresh: Vec<LayerCache>,
) -> Result<Vec<LayerCache>> {
    let checkpoint = trie.checkpoint_at(m, upto);
    let segments = trie.segments_until(m, upto);
    let mut out = Vec::with_capacity(fresh.len());
    for (i, layer) in fresh.into_iter().enumerate() {
        // This layer's data for positions 0..upto, in order.
        let mut all: Vec<LayerRun> = Vec::new();
        for (seg, take) in &segments {
            let mut left = *take;
            for p in &seg.pieces {
                if left == 0 {
                    break;
                }
                all.push(p.layer(i, left)?);
                left -= p.len.min(left);
            }
        }
        out.push(match layer {
            LayerCache::Kv(fresh) => {
                let ks: Vec<&Rows> = all
                    .iter()
                    .filter_map(|l| {
                        if let LayerRun::Kv(k, _) = l {
                            Some(k)
                        } else {
                            None
                        }
                    })
                    .collect();
                let vs: Vec<&Rows> = all
                    .iter()
                    .filter_map(|l| {
                        if let LayerRun::Kv(_, v) = l {
                            Some(v)
                        } else {
                            None
                        }
                    })
                    .collect();
                LayerCache::Kv(KvCache::from_runs(&ks, &vs, fresh.format())?)
            }
            LayerCache::Latent(fresh) => {
                let rs: Vec<&Rows> = all
                    .iter()
                    .filter_map(|l| {
                        if let LayerRun::Latent(r) = l {
                            Some(r)
                        } else {
                            None
                        }
                    })
                    .collect();
                LayerCache::Latent(LatentCache::from_runs(&rs, &fresh)?)
            }
            LayerCache::Rotating(_) => {
                let cp = checkpoint
                    .and_then(|c| c.layers.get(i).cloned().flatten())
                    .ok_or_else(|| CacheError::Rewind {
                        n: upto,
                        why: format!("no sliding-window snapshot at position {upto}"),
                    })?;
                LayerCache::Rotating(cp)
            }
        });
    }
    Ok(out)
}

/// Copies positions `start..end` of every layer (rotating layers keep nothing per position).
fn copy_run(caches: &[LayerCache], start: usize, end: usize) -> Result<CacheRun> {
    let layers = caches
        .iter()
        .map(|c| {
            Ok(match c {
                LayerCache::Kv(kv) => {
                    let (k, v) = kv.copy_range(start, end)?;
                    LayerRun::Kv(k, v)
                }
                LayerCache::Latent(l) => LayerRun::Latent(l.copy_range(start, end)?),
                LayerCache::Rotating(_) => LayerRun::None,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    // Computed now: an unevaluated copy is a graph whose input is the live cache's buffer,
    // which it would keep alive (its whole allocation, counted as the copy's few positions)
    // until a restore happened to evaluate it.
    let arrays: Vec<&Array> = layers
        .iter()
        .flat_map(|l| match l {
            LayerRun::Kv(k, v) => [k.arrays(), v.arrays()].concat(),
            LayerRun::Latent(r) => r.arrays(),
            LayerRun::None => vec![],
        })
        .collect();
    mlx::eval(&arrays)?;
    Ok(CacheRun {
        len: end - start,
        pieces: vec![Piece {
            offset: 0,
            len: end - start,
            data: Rc::new(layers),
            full: end - start,
        }],
    })
}
