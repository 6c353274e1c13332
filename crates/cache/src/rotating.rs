//! The sliding-window cache.
//!
//! The buffer always holds a run of consecutive positions `offset - count .. offset`, laid out as
//! a rotation of its `S` slots starting at slot `start`. Single-token writes go into the ring
//! (overwriting the oldest token once `capacity` slots are full); a batched write of `L` tokens
//! first linearises the buffer, keeping `capacity - 1` old tokens (`window - 1` without slack,
//! exactly what the first new query can see), and appends the `L` new ones, with an explicit
//! window mask, so that a batched write equals `L` single steps.
//!
//! `capacity = window + slack`: the slack keeps history past the window so that speculation can
//! rewind tokens that were written into the ring. mlx-lm's `RotatingKVCache` refuses to trim
//! once it has wrapped (and then silently keeps rejected draft tokens, docs/MODELS.md §4); here a
//! rewind succeeds whenever the tokens the next query needs are still held, and is an error
//! otherwise, never a silent divergence.

use crate::{
    attention, encode, growing::restore_full, time_len, write_attend, Attended, AttnMask,
    CacheError, Result, STEP,
};
use mlx::fast::{KvSlots, SdpaLayout};
use mlx::{Array, RowFormat, Rows};

#[derive(Debug, Clone)]
pub struct RotatingKvCache {
    window: usize,
    capacity: usize,
    keys: Option<Rows>,
    values: Option<Rows>,
    /// Slot of the oldest held token.
    start: usize,
    /// Tokens held.
    count: usize,
    /// Tokens seen; the next token's position.
    offset: usize,
    /// How keys and values are stored.
    format: RowFormat,
}

fn slots_of(buf: &Rows) -> usize {
    buf.time_len()
}

fn time(a: &Rows, start: usize, end: usize) -> Result<Rows> {
    Ok(a.time(start, end)?)
}

impl RotatingKvCache {
    /// A cache for a layer whose queries see at most `window` keys (including themselves).
    pub fn new(window: usize) -> Self {
        Self::with_slack(window, 0)
    }

    /// As [`RotatingKvCache::new`], keeping `slack` extra tokens of history so that up to
    /// `slack + 1` ring-written tokens can be rewound.
    pub fn with_slack(window: usize, slack: usize) -> Self {
        let window = window.max(1);
        RotatingKvCache {
            window,
            capacity: window + slack,
            keys: None,
            values: None,
            start: 0,
            count: 0,
            offset: 0,
            format: RowFormat::AsComputed,
        }
    }

    /// The same cache storing keys and values as `format` says.
    pub fn with_format(self, format: RowFormat) -> Self {
        RotatingKvCache { format, ..self }
    }

    /// How keys and values are stored.
    pub fn format(&self) -> RowFormat {
        self.format
    }

    pub fn window(&self) -> usize {
        self.window
    }

    pub fn offset(&self) -> usize {
        self.offset
    }

    fn slots(&self) -> usize {
        self.keys.as_ref().map_or(0, slots_of)
    }

    pub fn nbytes(&self) -> usize {
        self.keys.as_ref().map_or(0, Rows::nbytes) + self.values.as_ref().map_or(0, Rows::nbytes)
    }

    /// Bytes of one slot's keys and values; 0 before the first update.
    pub fn bytes_per_position(&self) -> usize {
        match self.slots() {
            0 => 0,
            s => self.nbytes() / s,
        }
    }

    /// The slots the ring keeps between updates: its window and the slack for rewinds. (A
    /// prefill chunk is appended before the ring is cut back, so it briefly holds a chunk
    /// more.)
    pub fn ring(&self) -> usize {
        self.capacity
    }

    /// The last `keep` held tokens of `a` in time order, followed by `pad` empty slots.
    fn linear(&self, a: &Rows, keep: usize, pad: usize) -> Result<Rows> {
        let s = self.slots();
        let first = self.start + self.count - keep; // logical index of the first kept token
        let parts: Vec<Rows> = if keep == 0 {
            vec![]
        } else if first >= s {
            vec![time(a, first - s, first - s + keep)?]
        } else if first + keep <= s {
            vec![time(a, first, first + keep)?]
        } else {
            vec![time(a, first, s)?, time(a, 0, first + keep - s)?]
        };
        let mut parts = parts;
        if pad > 0 {
            parts.push(a.zeros(pad)?);
        }
        let refs: Vec<&Rows> = parts.iter().collect();
        Ok(Rows::concat(&refs)?)
    }

    /// Rewrites the buffers as the last `keep` tokens in time order plus `pad` empty slots.
    fn relinearize(&mut self, keep: usize, pad: usize) -> Result<()> {
        if let (Some(k), Some(v)) = (&self.keys, &self.values) {
            let (k, v) = (self.linear(k, keep, pad)?, self.linear(v, keep, pad)?);
            self.keys = Some(k);
            self.values = Some(v);
        }
        self.start = 0;
        self.count = keep;
        Ok(())
    }

    /// Writes `[B, H, L, D]` keys and values for the next `L` positions; returns the keys and
    /// values attention should see, in slot order (use [`RotatingKvCache::mask`] with them).
    pub fn update(&mut self, keys: &Array, values: &Array) -> Result<(Array, Array)> {
        let s = self.update_slots(keys, values)?;
        Ok((s.keys.dense()?, s.values.dense()?))
    }

    /// As [`RotatingKvCache::update`], returning the keys and values as stored.
    pub fn update_slots(&mut self, keys: &Array, values: &Array) -> Result<KvSlots> {
        let l = time_len(keys)?;
        let (keys, values) = (&encode(keys, self.format)?, &encode(values, self.format)?);
        if l == 1 {
            self.write_one(keys, values)?;
        } else {
            self.write_many(keys, values, l)?;
        }
        self.offset += l;
        let (k, v) = self.view()?;
        Ok(KvSlots::of(k, v))
    }

    /// Makes the ring ready for one more token (shaped like `k` and `v`) and counts it held;
    /// returns the slot it goes into.
    fn slot_for_one(&mut self, k: &Rows, v: &Rows) -> Result<usize> {
        if self.keys.is_none() {
            let n = self.capacity.min(STEP);
            self.keys = Some(k.zeros(n)?);
            self.values = Some(v.zeros(n)?);
        }
        if self.slots() > self.capacity {
            // A batched write left more than the ring holds: drop the oldest.
            self.relinearize(
                self.count.min(self.capacity - 1),
                self.capacity - self.count.min(self.capacity - 1),
            )?;
        }
        let s = self.slots();
        Ok(if self.count < s {
            self.count += 1;
            (self.start + self.count - 1) % s
        } else if s < self.capacity {
            let grow = STEP.min(self.capacity - s);
            self.relinearize(self.count, grow)?;
            self.count += 1;
            self.count - 1
        } else {
            let slot = self.start;
            self.start = (self.start + 1) % s;
            slot
        })
    }

    fn write_one(&mut self, k: &Rows, v: &Rows) -> Result<()> {
        let slot = self.slot_for_one(k, v)?;
        let (keys, values) = (self.keys.as_ref(), self.values.as_ref());
        if let (Some(keys), Some(values)) = (keys, values) {
            let (nk, nv) = (keys.slice_update(k, slot)?, values.slice_update(v, slot)?);
            self.keys = Some(nk);
            self.values = Some(nv);
        }
        Ok(())
    }

    /// As [`RotatingKvCache::update`], and attends queries `q` (`[B, Hq, L, D]`) over the keys
    /// held, with the window's mask: a single token's write, the views and attention are one op
    /// where the CPU kernels take it. Returns the attention, the slots it read (what a
    /// KV-shared layer attends to) and its mask.
    pub fn update_attend(
        &mut self,
        q: &Array,
        keys: &Array,
        values: &Array,
        scale: f32,
        layout: SdpaLayout,
    ) -> Result<Attended> {
        let l = time_len(keys)?;
        if l != 1 {
            // A batched write relinearises the ring (see `write_many`): no single slot range.
            let kv = self.update_slots(keys, values)?;
            let mask = self.mask(l)?;
            let out = mlx::fast::sdpa_slots(q, &kv, attention(scale, &mask, layout))?;
            return Ok(Attended { out, kv, mask });
        }
        let (keys, values) = (&encode(keys, self.format)?, &encode(values, self.format)?);
        let slot = self.slot_for_one(keys, values)?;
        self.offset += 1;
        let mask = self.mask(1)?;
        let (Some(k), Some(v)) = (&self.keys, &self.values) else {
            return Err(CacheError::Shape {
                got: "empty cache".into(),
            });
        };
        let into = KvSlots {
            keys: k.clone(),
            values: v.clone(),
            // The filled prefix while the ring is linear, else every slot (see `view`).
            len: if self.start == 0 {
                self.count
            } else {
                slots_of(k)
            },
        };
        let a = write_attend(q, (keys, values), into, slot, scale, mask, layout)?;
        self.keys = Some(a.kv.keys.clone());
        self.values = Some(a.kv.values.clone());
        Ok(a)
    }

    fn write_many(&mut self, k: &Rows, v: &Rows, l: usize) -> Result<()> {
        let keep = self.count.min(self.capacity - 1);
        let (nk, nv) = match (&self.keys, &self.values) {
            (Some(ok), Some(ov)) if keep > 0 => {
                let (ok, ov) = (self.linear(ok, keep, 0)?, self.linear(ov, keep, 0)?);
                (Rows::concat(&[&ok, k])?, Rows::concat(&[&ov, v])?)
            }
            _ => (k.clone(), v.clone()),
        };
        self.keys = Some(nk);
        self.values = Some(nv);
        self.start = 0;
        self.count = keep + l;
        Ok(())
    }

    /// The held keys and values in slot order: the filled prefix when the buffer is linear,
    /// the whole ring otherwise.
    fn view(&self) -> Result<(Rows, Rows)> {
        let (Some(k), Some(v)) = (&self.keys, &self.values) else {
            return Err(CacheError::Shape {
                got: "empty cache".into(),
            });
        };
        if self.start == 0 {
            Ok((time(k, 0, self.count)?, time(v, 0, self.count)?))
        } else {
            Ok((k.clone(), v.clone()))
        }
    }

    /// The held keys and values in slot order with each slot's position, or `None` when empty
    /// (the gemma4 assistant reads the target's window this way).
    pub fn state(&self) -> Result<Option<(Array, Array, Vec<i32>)>> {
        if self.count == 0 {
            return Ok(None);
        }
        let (k, v) = self.view()?;
        Ok(Some((k.dense()?, v.dense()?, self.key_positions())))
    }

    /// As [`RotatingKvCache::state`], the keys and values as stored.
    pub fn held_slots(&self) -> Result<Option<(KvSlots, Vec<i32>)>> {
        if self.count == 0 {
            return Ok(None);
        }
        let (k, v) = self.view()?;
        Ok(Some((KvSlots::of(k, v), self.key_positions())))
    }

    /// The held keys and values in time order (oldest first), or `None` when empty: the
    /// whole state of the cache besides its window, capacity and offset.
    pub fn linear_state(&self) -> Result<Option<(Rows, Rows)>> {
        match (&self.keys, &self.values) {
            (Some(k), Some(v)) if self.count > 0 => Ok(Some((
                self.linear(k, self.count, 0)?,
                self.linear(v, self.count, 0)?,
            ))),
            _ => Ok(None),
        }
    }

    /// A cache shaped like this one (its window and capacity) holding `keys` and `values`
    /// (`[B, H, T, D]`, time order, as [`RotatingKvCache::linear_state`] gives them) as the
    /// `T` positions before `offset`.
    pub fn with_linear_state(&self, keys: Rows, values: Rows, offset: usize) -> Result<Self> {
        // Stored as this cache stores (the kernel reads new rows and held ones of one form).
        let (keys, values) = (
            restore_full(keys, self.format)?,
            restore_full(values, self.format)?,
        );
        let count = keys.time_len();
        if values.time_len() != count || count == 0 || count > offset {
            return Err(CacheError::Shape {
                got: format!(
                    "{count} keys and {} values held at position {offset}",
                    values.time_len()
                ),
            });
        }
        Ok(RotatingKvCache {
            window: self.window,
            capacity: self.capacity,
            keys: Some(keys),
            values: Some(values),
            start: 0,
            count,
            offset,
            format: self.format,
        })
    }

    /// Positions of the slots [`RotatingKvCache::update`] returned (`-1` for an empty slot).
    pub fn key_positions(&self) -> Vec<i32> {
        let s = self.slots();
        let base = (self.offset - self.count) as i32;
        if self.start == 0 {
            return (0..self.count as i32).map(|i| base + i).collect();
        }
        (0..s)
            .map(|slot| {
                let logical = (slot + s - self.start) % s;
                if logical < self.count {
                    base + logical as i32
                } else {
                    -1
                }
            })
            .collect()
    }

    /// The mask for the `l` queries of the last update (positions `offset - l .. offset`).
    /// [`RotatingKvCache::mask`] where the last `l` queries also see the later keys of their own
    /// block (absolute `[start, end)` positions; see [`AttnMask::from_positions_blocks`]).
    pub fn mask_blocks(&self, l: usize, blocks: &[(i32, i32)]) -> Result<AttnMask> {
        if blocks.is_empty() {
            return self.mask(l);
        }
        Ok(AttnMask::from_positions_blocks(
            &self.key_positions(),
            (self.offset - l) as i32,
            l as i32,
            Some(self.window as i32),
            blocks,
        )?)
    }

    pub fn mask(&self, l: usize) -> Result<AttnMask> {
        // One query over keys that are all held and all inside its window sees every key (their
        // order in the buffer does not matter to attention).
        if l == 1 && self.count <= self.window && (self.start == 0 || self.count == self.slots()) {
            return Ok(AttnMask::None);
        }
        Ok(AttnMask::from_positions(
            &self.key_positions(),
            (self.offset - l) as i32,
            l as i32,
            Some(self.window as i32),
        )?)
    }

    /// Forgets the last `n` tokens. Fails, changing nothing, when the tokens the next query
    /// would need were already overwritten.
    pub fn rewind(&mut self, n: usize) -> Result<()> {
        if n > self.count {
            return Err(CacheError::Rewind {
                n,
                why: format!("the cache holds only {} tokens", self.count),
            });
        }
        let needed = (self.window - 1).min(self.offset - n);
        if self.count - n < needed {
            return Err(CacheError::Rewind {
                n,
                why: format!(
                    "the sliding window needs the {needed} tokens before position {}, but only {} are still held (raise the cache's slack)",
                    self.offset - n,
                    self.count - n
                ),
            });
        }
        self.count -= n;
        self.offset -= n;
        Ok(())
    }
}
