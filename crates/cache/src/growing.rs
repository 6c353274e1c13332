//! Caches that keep every position: full attention (keys + values) and MLA (one latent array).

use crate::{encode, time_len, write_attend, Attended, AttnMask, CacheError, Result, STEP};
use mlx::fast::{KvSlots, SdpaLayout};
use mlx::{Array, RowFormat, Rows};

/// A `[B, H, T, D]` buffer (dense or quantized rows) that grows along time in steps of
/// [`STEP`] and holds `len` valid positions `0..len` in order.
#[derive(Debug, Clone, Default)]
pub(crate) struct Growing {
    data: Option<Rows>,
    len: usize,
}

impl Growing {
    fn capacity(&self) -> usize {
        self.data.as_ref().map_or(0, Rows::time_len)
    }

    /// Makes room for `x`'s `L` positions after the `len` held; returns the buffer they go
    /// into, at slots `len..len+L`.
    fn reserve(&mut self, x: &Rows) -> Result<&Rows> {
        let end = self.len + x.time_len();
        if end > self.capacity() {
            // The new buffer holds the valid prefix plus room up to the next step boundary.
            let fresh = x.zeros(end.div_ceil(STEP) * STEP - self.len)?;
            self.data = Some(match &self.data {
                // Keep only the valid prefix: positions past `len` were rewound away.
                Some(d) => Rows::concat(&[&d.time(0, self.len)?, &fresh])?,
                None => fresh,
            });
        }
        self.data.as_ref().ok_or_else(|| CacheError::Shape {
            got: "no buffer".into(),
        })
    }

    /// Writes `x` at positions `len..len+L` and returns the valid view.
    pub(crate) fn append(&mut self, x: &Rows) -> Result<Rows> {
        let start = self.len;
        let updated = self.reserve(x)?.slice_update(x, start)?;
        self.data = Some(updated);
        self.len = start + x.time_len();
        self.view()
    }

    /// A buffer holding exactly `data`'s positions (restoring a snapshot).
    pub(crate) fn from_data(data: Rows) -> Growing {
        let len = data.time_len();
        Growing {
            data: Some(data),
            len,
        }
    }

    /// Positions `start..end` as fresh arrays of exactly that size (a snapshot that does not
    /// keep the live buffer alive).
    pub(crate) fn copy_range(&self, start: usize, end: usize) -> Result<Rows> {
        let d = self.data.as_ref().ok_or_else(|| CacheError::Shape {
            got: "empty cache".into(),
        })?;
        if end > self.len || start > end {
            return Err(CacheError::Shape {
                got: format!("positions {start}..{end} of a cache holding {}", self.len),
            });
        }
        // `contiguous`, not `copy`: MLX's copy shares the buffer, so a stored "copy" of a few
        // positions would keep the live cache's whole allocation alive, unaccounted.
        Ok(d.time(start, end)?.contiguous()?)
    }

    pub(crate) fn view(&self) -> Result<Rows> {
        match &self.data {
            Some(d) => Ok(d.time(0, self.len)?),
            None => Err(CacheError::Shape {
                got: "empty cache".into(),
            }),
        }
    }

    pub(crate) fn rewind(&mut self, n: usize) -> Result<()> {
        if n > self.len {
            return Err(CacheError::Rewind {
                n,
                why: format!("the cache holds only {} tokens", self.len),
            });
        }
        self.len -= n;
        Ok(())
    }

    pub(crate) fn nbytes(&self) -> usize {
        self.data.as_ref().map_or(0, Rows::nbytes)
    }

    /// Bytes of one position (every row and head of it); 0 before the first write.
    pub(crate) fn bytes_per_position(&self) -> usize {
        match self.capacity() {
            0 => 0,
            c => self.nbytes() / c,
        }
    }
}

/// Keys and values of a full-attention layer: every position is kept.
#[derive(Debug, Clone, Default)]
pub struct KvCache {
    keys: Growing,
    values: Growing,
    /// How keys and values are stored.
    format: RowFormat,
}

impl KvCache {
    pub fn new() -> Self {
        Self::default()
    }

    /// A cache storing keys and values as `format` says.
    pub fn with_format(format: RowFormat) -> Self {
        KvCache {
            format,
            ..Self::default()
        }
    }

    /// Appends `[B, H, L, D]` keys and values; returns all keys and values so far (their
    /// values: quantized rows dequantized).
    pub fn update(&mut self, keys: &Array, values: &Array) -> Result<(Array, Array)> {
        let s = self.update_slots(keys, values)?;
        Ok((s.keys.dense()?, s.values.dense()?))
    }

    /// Appends `[B, H, L, D]` keys and values; returns all keys and values so far, as stored.
    pub fn update_slots(&mut self, keys: &Array, values: &Array) -> Result<KvSlots> {
        let (keys, values) = (encode(keys, self.format)?, encode(values, self.format)?);
        Ok(KvSlots::of(
            self.keys.append(&keys)?,
            self.values.append(&values)?,
        ))
    }

    /// Appends `[B, H, L, D]` keys and values, and attends queries `q` (`[B, Hq, L, D]`) over
    /// all keys so far, in one op where the CPU kernels take it (the write, the views and
    /// attention; MLX's ops otherwise): the attention, the slots it read (what a KV-shared layer
    /// attends to) and its mask.
    pub fn update_attend(
        &mut self,
        q: &Array,
        keys: &Array,
        values: &Array,
        scale: f32,
        layout: SdpaLayout,
    ) -> Result<Attended> {
        let l = time_len(keys)?;
        let (keys, values) = (&encode(keys, self.format)?, &encode(values, self.format)?);
        let at = self.keys.len;
        if self.values.len != at {
            return Err(CacheError::Shape {
                got: format!("{at} keys but {} values", self.values.len),
            });
        }
        let into = KvSlots {
            keys: self.keys.reserve(keys)?.clone(),
            values: self.values.reserve(values)?.clone(),
            len: at + l,
        };
        let a = write_attend(q, (keys, values), into, at, scale, self.mask(l), layout)?;
        self.keys.data = Some(a.kv.keys.clone());
        self.values.data = Some(a.kv.values.clone());
        self.keys.len = at + l;
        self.values.len = at + l;
        Ok(a)
    }

    /// The mask for the `l` queries of the last update: keys are positions `0..offset`, the
    /// queries the last `l` of them, so a lower-right causal mask is exact.
    pub fn mask(&self, l: usize) -> AttnMask {
        if l <= 1 {
            AttnMask::None
        } else {
            AttnMask::Causal
        }
    }

    pub fn offset(&self) -> usize {
        self.keys.len
    }

    /// Forgets the last `n` tokens.
    pub fn rewind(&mut self, n: usize) -> Result<()> {
        self.keys.rewind(n)?;
        self.values.rewind(n)
    }

    pub fn nbytes(&self) -> usize {
        self.keys.nbytes() + self.values.nbytes()
    }

    /// Bytes of one position's keys and values; 0 before the first update.
    pub fn bytes_per_position(&self) -> usize {
        self.keys.bytes_per_position() + self.values.bytes_per_position()
    }

    /// A cache holding `keys` and `values` (`[B, H, T, D]`) as positions `0..T`, storing what
    /// comes next as `format` says (restored rows are stored as the cache would have stored
    /// them: the attention kernel reads new rows and held ones of one form).
    pub fn from_state(keys: Rows, values: Rows, format: RowFormat) -> Result<KvCache> {
        if keys.time_len() != values.time_len() {
            return Err(CacheError::Shape {
                got: format!("{} keys but {} values", keys.time_len(), values.time_len()),
            });
        }
        Ok(KvCache {
            format,
            keys: Growing::from_data(restore_full(keys, format)?),
            values: Growing::from_data(restore_full(values, format)?),
        })
    }

    /// How keys and values are stored.
    pub fn format(&self) -> RowFormat {
        self.format
    }

    /// A cache holding runs of keys and values (`[B, H, t, D]` each) joined in order.
    pub fn from_runs(keys: &[&Rows], values: &[&Rows], format: RowFormat) -> Result<KvCache> {
        Self::from_state(Rows::concat(keys)?, Rows::concat(values)?, format)
    }

    /// All keys and values held (their values), or `None` when empty.
    pub fn state(&self) -> Result<Option<(Array, Array)>> {
        if self.keys.len == 0 {
            return Ok(None);
        }
        Ok(Some((
            self.keys.view()?.dense()?,
            self.values.view()?.dense()?,
        )))
    }

    /// All keys and values held as stored (what a reader of another layer's cache attends
    /// over, such as the gemma4 assistant), or `None` when empty.
    pub fn slots(&self) -> Result<Option<KvSlots>> {
        if self.keys.len == 0 {
            return Ok(None);
        }
        Ok(Some(KvSlots::of(self.keys.view()?, self.values.view()?)))
    }

    /// Copies of positions `start..end`, as stored.
    pub fn copy_range(&self, start: usize, end: usize) -> Result<(Rows, Rows)> {
        Ok((
            self.keys.copy_range(start, end)?,
            self.values.copy_range(start, end)?,
        ))
    }
}

/// MLA's cache: per token one row holding the normalised latent `c` and the rotated rope key
/// (`kv_lora_rank + qk_rope_head_dim` values, shared by all heads), stored as `[B, 1, T, r+dr]`.
#[derive(Debug, Clone, Default)]
pub struct LatentCache {
    rows: Growing,
    /// How rows are stored.
    format: RowFormat,
    /// Values at the start of each row that attention reads apart (MLA's latent, its values):
    /// quantization groups never straddle them (0: no such part).
    part: usize,
}

impl LatentCache {
    pub fn new() -> Self {
        Self::default()
    }

    /// A cache storing rows as `format` says.
    pub fn with_format(format: RowFormat) -> Self {
        LatentCache {
            format,
            ..Self::default()
        }
    }

    /// The same cache whose rows' first `n` values are read apart (MLA's values): a quantized
    /// cache's groups never straddle them.
    pub fn with_values(self, n: usize) -> Self {
        LatentCache { part: n, ..self }
    }

    /// An empty cache made like this one (its format and value part).
    pub fn fresh_like(&self) -> Self {
        LatentCache {
            format: self.format,
            part: self.part,
            ..Self::default()
        }
    }

    /// How rows are stored.
    pub fn format(&self) -> RowFormat {
        self.format
    }

    /// Appends `[B, 1, L, r+dr]` rows; returns all rows so far, as stored.
    pub fn update(&mut self, rows: &Array) -> Result<Rows> {
        time_len(rows)?;
        let d = rows.shape()[3].max(0) as usize;
        let part = if self.part == 0 { d } else { self.part };
        self.rows
            .append(&Rows::encode_parts(rows, self.format, part)?)
    }

    pub fn mask(&self, l: usize) -> AttnMask {
        if l <= 1 {
            AttnMask::None
        } else {
            AttnMask::Causal
        }
    }

    pub fn offset(&self) -> usize {
        self.rows.len
    }

    pub fn rewind(&mut self, n: usize) -> Result<()> {
        self.rows.rewind(n)
    }

    pub fn nbytes(&self) -> usize {
        self.rows.nbytes()
    }

    /// Bytes of one position's row; 0 before the first update.
    pub fn bytes_per_position(&self) -> usize {
        self.rows.bytes_per_position()
    }

    /// A cache holding `rows` (`[B, 1, T, r+dr]`) as positions `0..T`, storing what comes
    /// next as `format` says.
    pub fn from_state(rows: Rows, format: RowFormat) -> Result<LatentCache> {
        Self::from_state_like(rows, &LatentCache::with_format(format))
    }

    /// A cache made like `like` (its format and value part) holding `rows` as positions
    /// `0..T`.
    fn from_state_like(rows: Rows, like: &LatentCache) -> Result<LatentCache> {
        let part = if like.part == 0 {
            rows.width()
        } else {
            like.part
        };
        Ok(LatentCache {
            format: like.format,
            rows: Growing::from_data(restore(rows, like.format, part)?),
            part: like.part,
        })
    }

    /// A cache holding runs of rows (`[B, 1, t, r+dr]` each) joined in order, made like
    /// `like`.
    pub fn from_runs(rows: &[&Rows], like: &LatentCache) -> Result<LatentCache> {
        Self::from_state_like(Rows::concat(rows)?, like)
    }

    /// A copy of positions `start..end`, as stored.
    pub fn copy_range(&self, start: usize, end: usize) -> Result<Rows> {
        self.rows.copy_range(start, end)
    }
}

/// Restored rows as a cache of `format` would have stored them (a snapshot of another form is
/// re-encoded, which a snapshot taken from a cache of this format never needs); `part` as
/// [`Rows::encode_parts`] takes it.
pub(crate) fn restore(rows: Rows, format: RowFormat, part: usize) -> Result<Rows> {
    let same = match (format, rows.format()) {
        (RowFormat::AsComputed, _) => true,
        (a, b) => a == b,
    };
    // Rows no group fits are stored as float16 by a quantized cache.
    let unfit = matches!(format, RowFormat::Affine { .. })
        && rows.bits().is_none()
        && RowFormat::group_for_parts(rows.width(), part).is_none()
        && rows.format() == RowFormat::Float(mlx::Dtype::F16);
    if same || unfit {
        return Ok(rows);
    }
    Ok(Rows::encode_parts(&rows.dense()?, format, part)?)
}

/// [`restore`] for rows read whole.
pub(crate) fn restore_full(rows: Rows, format: RowFormat) -> Result<Rows> {
    let d = rows.width();
    restore(rows, format, d)
}
