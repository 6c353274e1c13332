//! A split model served over HTTP: rank 0 leads, the other ranks replay its forward passes.
//!
//! Rank 0's engine runs unchanged on a [`Leader`]: a model that, before each packed forward
//! pass, tells the other ranks what the pass is (each row's sequence, position and length, the
//! tokens, the sequences that ended since), then runs its own stage. Every other rank runs
//! [`follow`]: it keeps each live sequence's caches for its own layers and replays each pass on
//! them. The model's stage passes the hidden states along the ranks and the last rank's final
//! hidden states back to rank 0, which alone holds the head, samples and speaks HTTP
//! (docs/DISTRIBUTED.md, "Serving").

use crate::cluster::{Cluster, Job, JoinOptions};
use cache::LayerCache;
use mlx::{Array, Dtype};
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
}

/// Joins the ranks of `cfg` as rank 0 (starting those on this machine), shares the job, and
/// loads rank 0's stage of the model in `files` (with the embedding and the head), wrapped
/// in a [`Leader`]. `broken` is set when a rank is lost later.
pub fn lead(
    files: &ModelFiles,
    dtype: DtypeChoice,
    cfg: &LeadConfig,
    broken: Arc<AtomicBool>,
) -> Result<LoadedModel, String> {
    // Rank 0 samples for every sequence: the job's seed is unused.
    let job = Job::of(cfg.argv.clone(), files, 0)?;
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
    loaded.model = Box::new(Leader::new(loaded.model, cluster, cfg.rank_timeout, broken));
    Ok(loaded)
}

/// A rank other than 0 of a split model served over HTTP, its stage loaded: replays rank 0's
/// passes until rank 0 stops.
pub fn serve_following(
    cluster: &Cluster,
    mut model: Box<dyn CausalLm>,
    kv_cache: mlx::RowFormat,
) -> Result<(), String> {
    model.set_cache_format(kv_cache);
    follow(&*model, cluster)
}

/// One pass, as rank 0 describes it to the others.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Call {
    Forward {
        tokens: Vec<i32>,
        rows: Vec<Row>,
        /// Sequences that ended since the last call: their caches go.
        released: Vec<u64>,
    },
    /// Rank 0 is stopping: the others end.
    Stop,
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

/// Rank 0's model: its stage, telling the other ranks each pass before running it.
pub struct Leader {
    inner: Box<dyn CausalLm>,
    cluster: Rc<Cluster>,
    released: RefCell<Vec<u64>>,
    /// How long a pass may wait on the other ranks.
    limit: Duration,
    /// Set once a pass failed between ranks: MLX's ring does not recover from a lost peer,
    /// so the runner must end (its parent starts it again).
    broken: Arc<AtomicBool>,
}

impl Leader {
    pub fn new(
        inner: Box<dyn CausalLm>,
        cluster: Rc<Cluster>,
        limit: Duration,
        broken: Arc<AtomicBool>,
    ) -> Leader {
        Leader {
            inner,
            cluster,
            released: RefCell::new(Vec::new()),
            limit,
            broken,
        }
    }

    fn failed(&self, e: impl std::fmt::Display) -> ModelError {
        self.broken.store(true, Ordering::SeqCst);
        ModelError::Invalid(format!("the model's other ranks failed: {e}"))
    }
}

impl Drop for Leader {
    fn drop(&mut self) {
        if !self.broken.load(Ordering::SeqCst) {
            let _ = send(&self.cluster, &Call::Stop);
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
        if self.broken.load(Ordering::SeqCst) {
            return Err(self.failed("a rank was lost earlier"));
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
        };
        self.cluster.watch(Some(self.limit), "a forward pass");
        send(&self.cluster, &call).map_err(|e| self.failed(e))?;
        // The ranks that embed (all of them split by tensors; with per-layer inputs, every
        // stage) splice the soft tokens in as rank 0 does.
        for m in rows.iter().flat_map(|r| r.media) {
            self.cluster
                .broadcast(&m.embeds.astype(Dtype::F32)?)
                .map_err(|e| self.failed(e))?;
        }
        let out = self
            .inner
            .forward_packed(tokens, rows)
            .map_err(|e| self.failed(e));
        self.cluster.watch(None, "serving");
        out
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

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// A rank other than 0: replays rank 0's passes on `model` (this rank's stage) until rank 0
/// stops. An error (a lost rank, a pass out of step) ends it.
pub fn follow(model: &dyn CausalLm, cluster: &Cluster) -> Result<(), String> {
    let mut live: HashMap<u64, Vec<LayerCache>> = HashMap::new();
    loop {
        let (tokens, rows, released) = match receive(cluster)? {
            Call::Stop => return Ok(()),
            Call::Forward {
                tokens,
                rows,
                released,
            } => (tokens, rows, released),
        };
        for seq in released {
            live.remove(&seq);
        }
        // Each row's caches, out of the map for the pass: a new sequence's fresh, a rewound
        // one's cut back to where rank 0's are.
        let mut held: Vec<Vec<LayerCache>> = Vec::with_capacity(rows.len());
        for r in &rows {
            let mut caches = match live.remove(&r.seq) {
                Some(c) if r.seq != 0 && r.position > 0 => c,
                _ => model.make_caches(),
            };
            let at = caches.first().map_or(0, LayerCache::offset);
            if r.position > at {
                return Err(format!(
                    "sequence {} is at {} on rank 0 and at {at} here: out of step",
                    r.seq, r.position
                ));
            }
            if r.position < at {
                for c in caches.iter_mut() {
                    c.rewind(at - r.position).map_err(|e| {
                        format!("sequence {}: rewinding to {}: {e}", r.seq, r.position)
                    })?;
                }
            }
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
                live.insert(r.seq, caches);
            }
        }
    }
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
        };
        let text = serde_json::to_vec(&call).unwrap();
        assert_eq!(serde_json::from_slice::<Call>(&text).unwrap(), call);
    }
}
