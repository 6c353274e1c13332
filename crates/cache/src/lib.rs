//! Attention caches, owned by the caller and passed into a model's forward call (the model is
//! weights plus a function; the runner owns the state, so that the prefix tree,
//! snapshots and speculation rollback can manipulate it).
//!
//! Three kinds, all storing `[B, H, T, D]` arrays with time on axis 2:
//! - [`KvCache`]: keys and values of full-attention layers, growing in steps;
//! - [`RotatingKvCache`]: keys and values of sliding-window layers, bounded by the window;
//! - [`LatentCache`]: one array per layer, for MLA's compressed latent plus rope key.
//!
//! Every cache has an explicit `offset` (tokens seen) and `rewind(n)`.

pub mod disk;
mod growing;
mod mask;
pub mod prefix;
mod rotating;
pub mod trie;

pub use growing::{KvCache, LatentCache};
pub use mask::AttnMask;
pub use rotating::RotatingKvCache;

use mlx::fast::{Attention, KvSlots, SdpaLayout};
use mlx::{Array, RowFormat, Rows};

/// Errors of cache bookkeeping (MLX errors pass through).
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    #[error(transparent)]
    Mlx(#[from] mlx::Error),
    #[error("cannot rewind {n} tokens: {why}")]
    Rewind { n: usize, why: String },
    #[error("cache update with {got} tokens, expected a [B, H, L, D] array")]
    Shape { got: String },
}

pub type Result<T> = std::result::Result<T, CacheError>;

/// A cache update's attention (laid out as asked), the cache slots it read (what a KV-shared
/// layer attends to) and the mask it used over them.
#[derive(Debug, Clone)]
pub struct Attended {
    pub out: Array,
    pub kv: KvSlots,
    pub mask: AttnMask,
}

/// The attention of an update under the cache's mask.
pub(crate) fn attention<'a>(scale: f32, mask: &'a AttnMask, layout: SdpaLayout) -> Attention<'a> {
    Attention::new(scale, mask.as_sdpa()).with_layout(layout)
}

/// A cache's write of `new` at slot `at` of the buffers `into` and attention over them, one op
/// (`sdpa_write`). `into` is taken, not borrowed: the op takes the buffers over only if
/// nothing else holds them when it runs, so the caller must hand over its handles and keep
/// the returned slots' buffers instead.
pub(crate) fn write_attend(
    q: &Array,
    new: (&Rows, &Rows),
    into: KvSlots,
    at: usize,
    scale: f32,
    mask: AttnMask,
    layout: SdpaLayout,
) -> Result<Attended> {
    let (out, kv) = mlx::fast::sdpa_write(q, new, &into, at, attention(scale, &mask, layout))?;
    drop(into);
    Ok(Attended { out, kv, mask })
}

/// Allocation granularity along time, as in mlx-lm: growing by a step at a time keeps the
/// number of reallocations (each a copy of the whole buffer) logarithmic-free and small.
pub const STEP: usize = 256;

/// One layer's cache, of whichever kind the layer needs.
#[derive(Debug, Clone)]
pub enum LayerCache {
    Kv(KvCache),
    Rotating(RotatingKvCache),
    Latent(LatentCache),
}

impl LayerCache {
    pub fn offset(&self) -> usize {
        match self {
            LayerCache::Kv(c) => c.offset(),
            LayerCache::Rotating(c) => c.offset(),
            LayerCache::Latent(c) => c.offset(),
        }
    }

    pub fn rewind(&mut self, n: usize) -> Result<()> {
        match self {
            LayerCache::Kv(c) => c.rewind(n),
            LayerCache::Rotating(c) => c.rewind(n),
            LayerCache::Latent(c) => c.rewind(n),
        }
    }

    /// Bytes held by the cache's buffers (allocated, not just filled).
    pub fn nbytes(&self) -> usize {
        match self {
            LayerCache::Kv(c) => c.nbytes(),
            LayerCache::Rotating(c) => c.nbytes(),
            LayerCache::Latent(c) => c.nbytes(),
        }
    }

    /// Bytes one position costs in this cache (its dtype, heads and widths); 0 before the
    /// first update, which is what fixes them.
    pub fn bytes_per_position(&self) -> usize {
        match self {
            LayerCache::Kv(c) => c.bytes_per_position(),
            LayerCache::Rotating(c) => c.bytes_per_position(),
            LayerCache::Latent(c) => c.bytes_per_position(),
        }
    }

    /// The same empty cache storing its keys and values (or rows) as `format` says: the
    /// runner's `--kv-cache-type`.
    pub fn with_format(self, format: RowFormat) -> LayerCache {
        match self {
            LayerCache::Kv(_) => LayerCache::Kv(KvCache::with_format(format)),
            LayerCache::Rotating(r) => LayerCache::Rotating(r.with_format(format)),
            LayerCache::Latent(_) => LayerCache::Latent(LatentCache::with_format(format)),
        }
    }

    /// How the cache stores its keys and values (or rows).
    pub fn format(&self) -> RowFormat {
        match self {
            LayerCache::Kv(c) => c.format(),
            LayerCache::Rotating(c) => c.format(),
            LayerCache::Latent(c) => c.format(),
        }
    }

    /// The most positions the cache keeps between updates: a sliding window's ring; `None`
    /// for a cache that keeps every position.
    pub fn most_positions(&self) -> Option<usize> {
        match self {
            LayerCache::Rotating(c) => Some(c.ring()),
            LayerCache::Kv(_) | LayerCache::Latent(_) => None,
        }
    }
}

/// `x` stored as `format` says.
pub(crate) fn encode(x: &Array, format: RowFormat) -> Result<Rows> {
    time_len(x)?;
    Ok(Rows::encode(x, format)?)
}

/// The time length of a `[B, H, L, D]` update.
pub(crate) fn time_len(x: &mlx::Array) -> Result<usize> {
    let s = x.shape();
    if s.len() != 4 {
        return Err(CacheError::Shape {
            got: format!("{s:?}"),
        });
    }
    Ok(s[2] as usize)
}
