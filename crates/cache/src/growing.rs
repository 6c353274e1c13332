//! Caches that keep every position: full attention (keys + values) and MLA (one latent array).

use crate::{cast, time_len, write_attend, Attended, AttnMask, CacheError, Result, STEP};
use mlx::fast::{KvSlots, SdpaLayout};
use mlx::{Array, Dtype, Ix};

/// A `[B, H, T, D]` buffer that grows along time in steps of [`STEP`] and holds `len` valid
/// positions `0..len` in order.
#[derive(Debug, Clone, Default)]
pub(crate) struct Growing {
    data: Option<Array>,
    len: usize,
}

impl Growing {
    fn capacity(&self) -> usize {
        self.data.as_ref().map_or(0, |d| d.shape()[2] as usize)
    }

    /// Makes room for `x`'s `L` positions (`[B, H, L, D]`) after the `len` held; returns the
    /// buffer they go into, at slots `len..len+L`.
    fn reserve(&mut self, x: &Array) -> Result<&Array> {
        let l = time_len(x)?;
        let end = self.len + l;
        if end > self.capacity() {
            let s = x.shape();
            // The new buffer holds the valid prefix plus room up to the next step boundary.
            let fresh_len = end.div_ceil(STEP) * STEP - self.len;
            let fresh = Array::zeros(&[s[0], s[1], fresh_len as i32, s[3]], x.dtype())?;
            self.data = Some(match &self.data {
                // Keep only the valid prefix: positions past `len` were rewound away.
                Some(d) => {
                    let kept = d.index(&[
                        Ix::full(),
                        Ix::full(),
                        Ix::slice(None, Some(self.len as i32), 1),
                    ])?;
                    mlx::concatenate(&[&kept, &fresh], 2)?
                }
                None => fresh,
            });
        }
        self.data.as_ref().ok_or_else(|| CacheError::Shape {
            got: "no buffer".into(),
        })
    }

    /// Writes `x` (`[B, H, L, D]`) at positions `len..len+L` and returns the valid view.
    pub(crate) fn append(&mut self, x: &Array) -> Result<Array> {
        let (start, end) = (self.len, self.len + time_len(x)?);
        let updated = self.reserve(x)?.slice_update(
            x,
            &[
                Ix::full(),
                Ix::full(),
                Ix::slice(Some(start as i32), Some(end as i32), 1),
            ],
        )?;
        self.data = Some(updated);
        self.len = end;
        self.view()
    }

    /// A buffer holding exactly `data`'s positions (restoring a snapshot).
    pub(crate) fn from_data(data: Array) -> Result<Growing> {
        let len = time_len(&data)?;
        Ok(Growing {
            data: Some(data),
            len,
        })
    }

    /// Positions `start..end` as a fresh array of exactly that size (a snapshot that does not
    /// keep the live buffer alive).
    pub(crate) fn copy_range(&self, start: usize, end: usize) -> Result<Array> {
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
        Ok(d.index(&[
            Ix::full(),
            Ix::full(),
            Ix::slice(Some(start as i32), Some(end as i32), 1),
        ])?
        .contiguous()?)
    }

    pub(crate) fn view(&self) -> Result<Array> {
        match &self.data {
            Some(d) => Ok(d.index(&[
                Ix::full(),
                Ix::full(),
                Ix::slice(None, Some(self.len as i32), 1),
            ])?),
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
        self.data.as_ref().map_or(0, Array::nbytes)
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
    /// What keys and values are stored as (`None`: as they come).
    dtype: Option<Dtype>,
}

impl KvCache {
    pub fn new() -> Self {
        Self::default()
    }

    /// A cache storing keys and values as `dtype` (`None`: as they come).
    pub fn with_dtype(dtype: Option<Dtype>) -> Self {
        KvCache {
            dtype,
            ..Self::default()
        }
    }

    /// Appends `[B, H, L, D]` keys and values; returns all keys and values so far.
    pub fn update(&mut self, keys: &Array, values: &Array) -> Result<(Array, Array)> {
        let (keys, values) = (cast(keys, self.dtype)?, cast(values, self.dtype)?);
        Ok((self.keys.append(&keys)?, self.values.append(&values)?))
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
        let (keys, values) = (&cast(keys, self.dtype)?, &cast(values, self.dtype)?);
        let at = self.keys.len;
        let l = time_len(keys)?;
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
    /// comes next in their dtype.
    pub fn from_state(keys: Array, values: Array) -> Result<KvCache> {
        let values = cast(&values, Some(keys.dtype()))?;
        Ok(KvCache {
            dtype: Some(keys.dtype()),
            keys: Growing::from_data(keys)?,
            values: Growing::from_data(values)?,
        })
    }

    /// What keys and values are stored as (`None`: as they come).
    pub fn dtype(&self) -> Option<Dtype> {
        self.dtype
    }

    /// A cache holding runs of keys and values (`[B, H, t, D]` each) joined in order.
    pub fn from_runs(keys: &[&Array], values: &[&Array]) -> Result<KvCache> {
        Self::from_state(mlx::concatenate(keys, 2)?, mlx::concatenate(values, 2)?)
    }

    /// All keys and values held, or `None` when empty.
    pub fn state(&self) -> Result<Option<(Array, Array)>> {
        if self.keys.len == 0 {
            return Ok(None);
        }
        Ok(Some((self.keys.view()?, self.values.view()?)))
    }

    /// Copies of positions `start..end`.
    pub fn copy_range(&self, start: usize, end: usize) -> Result<(Array, Array)> {
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
    /// What rows are stored as (`None`: as they come).
    dtype: Option<Dtype>,
}

impl LatentCache {
    pub fn new() -> Self {
        Self::default()
    }

    /// A cache storing rows as `dtype` (`None`: as they come).
    pub fn with_dtype(dtype: Option<Dtype>) -> Self {
        LatentCache {
            dtype,
            ..Self::default()
        }
    }

    /// What rows are stored as (`None`: as they come).
    pub fn dtype(&self) -> Option<Dtype> {
        self.dtype
    }

    /// Appends `[B, 1, L, r+dr]` rows; returns all rows so far (in the cache's dtype).
    pub fn update(&mut self, rows: &Array) -> Result<Array> {
        self.rows.append(&cast(rows, self.dtype)?)
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
    /// next in their dtype.
    pub fn from_state(rows: Array) -> Result<LatentCache> {
        Ok(LatentCache {
            dtype: Some(rows.dtype()),
            rows: Growing::from_data(rows)?,
        })
    }

    /// A cache holding runs of rows (`[B, 1, t, r+dr]` each) joined in order.
    pub fn from_runs(rows: &[&Array]) -> Result<LatentCache> {
        Self::from_state(mlx::concatenate(rows, 2)?)
    }

    /// A copy of positions `start..end`.
    pub fn copy_range(&self, start: usize, end: usize) -> Result<Array> {
        self.rows.copy_range(start, end)
    }
}
