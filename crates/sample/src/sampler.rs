//! The slot-pooled sampler.
//!
//! Sequences register in slots with their options and prompt; [`Sampler::sample`] turns one
//! logits row per slot into tokens for any subset of slots at once. Penalty history lives in a
//! pooled `[rows, W]` int32 ring on the device whose shape only changes when a slot with a
//! longer window registers, so steady-state decoding appends with one scatter per call and never
//! reshapes. Everything stays lazy: tokens come back as device arrays the caller evaluates
//! (asynchronously, to overlap the next step).

use crate::distribution::Distribution;
use crate::error::{Result, SampleError};
use crate::pipeline::{distribution, log_softmax, Strategy};
use base::options::Options;
use mlx::{Array, Dtype};
use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};

/// SplitMix64: mixes a seed and a draw counter into the key of one draw, so each slot's
/// sequence of random numbers depends only on its own seed and how many draws it made.
fn splitmix(seed: u64, counter: u64) -> u64 {
    let mut z = seed
        .wrapping_add(counter.wrapping_mul(0x9E37_79B9_7F4A_7C15))
        .wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A seed no one chose: each call a different one.
pub fn fresh_seed() -> u64 {
    std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish()
}

struct Slot {
    opts: Options,
    row: usize,
    /// History window of this slot (≤ the pool width).
    window: usize,
    /// Next ring position to write, and how many entries hold tokens.
    pos: usize,
    len: usize,
    seed: u64,
    draws: u64,
}

impl Slot {
    fn key(&mut self) -> Result<Array> {
        let k = mlx::random::key(splitmix(self.seed, self.draws))?;
        self.draws += 1;
        Ok(k)
    }

    /// `n` uniform numbers in [0, 1) from this slot's next key.
    fn uniforms(&mut self, n: i32) -> Result<Array> {
        let k = self.key()?;
        Ok(mlx::random::uniform(&[n], Dtype::F32, 0.0, 1.0, Some(&k))?)
    }
}

/// What one [`Sampler::sample`] call produced, in the order of the slots it was given.
#[derive(Debug, Clone)]
pub struct Sampled {
    /// `[B]` int32 tokens.
    pub tokens: Array,
    /// `[B]` log-probabilities of the chosen tokens under the raw logits, when any slot asked.
    pub logprobs: Option<Array>,
    /// The most likely alternatives, unordered, K = the largest `top_logprobs` asked.
    pub top: Option<TopLogprobs>,
}

impl Sampled {
    /// Row `i` alone, as a one-slot call would have returned it (`[1]`, `[1, K]`).
    pub fn row(&self, i: usize) -> Result<Sampled> {
        let one = |a: &Array| a.slice_axis(0, i as i32, Some(i as i32 + 1));
        Ok(Sampled {
            tokens: one(&self.tokens)?,
            logprobs: self.logprobs.as_ref().map(one).transpose()?,
            top: match &self.top {
                Some(t) => Some(TopLogprobs {
                    ids: one(&t.ids)?,
                    logprobs: one(&t.logprobs)?,
                }),
                None => None,
            },
        })
    }

    /// Every array it holds, for one evaluation.
    pub fn arrays(&self) -> Vec<&Array> {
        let mut v = vec![&self.tokens];
        v.extend(&self.logprobs);
        if let Some(t) = &self.top {
            v.push(&t.ids);
            v.push(&t.logprobs);
        }
        v
    }
}

/// The log-probabilities, under the raw `logits` (`[R, V]`), of each of `tokens` (each `[R]`,
/// one token per row), and the `k` most likely alternatives of each row (none for `k = 0`,
/// unordered): what a row reports of the token it chose. One log-softmax serves every list.
pub fn logprobs(
    logits: &Array,
    tokens: &[&Array],
    k: i32,
) -> Result<(Vec<Array>, Option<TopLogprobs>)> {
    let lp = log_softmax(logits)?;
    let chosen = tokens
        .iter()
        .map(|t| {
            Ok(lp
                .take_along_axis(&t.astype(Dtype::I32)?.reshape(&[-1, 1])?, -1)?
                .reshape(&[-1])?)
        })
        .collect::<Result<Vec<_>>>()?;
    let v = lp.shape()[1];
    let top = if k > 0 {
        let k = k.min(v);
        let ids = lp
            .negative()?
            .argpartition(k - 1, -1)?
            .slice_axis(-1, 0, Some(k))?;
        let vals = lp.take_along_axis(&ids, -1)?;
        Some(TopLogprobs {
            ids: ids.astype(Dtype::I32)?,
            logprobs: vals,
        })
    } else {
        None
    };
    Ok((chosen, top))
}

/// `[B, K]` token ids and their logprobs.
#[derive(Debug, Clone)]
pub struct TopLogprobs {
    pub ids: Array,
    pub logprobs: Array,
}

pub struct Sampler {
    slots: HashMap<usize, Slot>,
    hist: Option<Array>,
    rows: usize,
    width: usize,
    free_rows: Vec<usize>,
    num_ctx: usize,
    strategy: Strategy,
    allow_fused: bool,
}

impl Sampler {
    /// `num_ctx` resolves `repeat_last_n = -1`.
    pub fn new(num_ctx: usize) -> Sampler {
        Sampler {
            slots: HashMap::new(),
            hist: None,
            rows: 0,
            width: 0,
            free_rows: Vec::new(),
            num_ctx,
            strategy: Strategy::OneSort,
            allow_fused: true,
        }
    }

    /// Turns the fused batch path off, so every call takes the per-slot path (benchmarks and
    /// tests; results are the same either way).
    pub fn set_allow_fused(&mut self, allow: bool) {
        self.allow_fused = allow;
    }

    /// Chooses how top-k and top-p share work (benchmarks only; results are the same).
    pub fn set_strategy(&mut self, s: Strategy) {
        self.strategy = s;
    }

    pub fn contains(&self, slot: usize) -> bool {
        self.slots.contains_key(&slot)
    }

    /// The pool's `[rows, width]` shape (the ring's capacity).
    pub fn pool_shape(&self) -> (usize, usize) {
        (self.rows, self.width)
    }

    /// Registers a sequence, seeding its penalty history with the last `repeat_last_n` tokens
    /// of `prior` (its prompt).
    pub fn add(&mut self, slot: usize, opts: &Options, prior: &[u32]) -> Result<()> {
        opts.validate().map_err(SampleError::Invalid)?;
        if self.slots.contains_key(&slot) {
            return Err(SampleError::DuplicateSlot(slot));
        }
        let opts_n = opts.normalized(self.num_ctx);
        let window = opts_n.window();
        let row = match self.free_rows.pop() {
            Some(r) => r,
            None => {
                self.rows += 1;
                self.rows - 1
            }
        };
        self.ensure_pool(window)?;
        let tail = &prior[prior.len().saturating_sub(window)..];
        let mut row_vals = vec![-1i32; self.width];
        for (i, &t) in tail.iter().enumerate() {
            row_vals[i] = t as i32;
        }
        if self.width > 0 {
            let hist = self
                .hist
                .as_ref()
                .ok_or_else(|| SampleError::Invalid("no history pool".into()))?;
            let upd = Array::from_slice(&row_vals, &[1, self.width as i32])?;
            self.hist = Some(hist.slice_update(
                &upd,
                &[mlx::Ix::slice(Some(row as i32), Some(row as i32 + 1), 1)],
            )?);
        }
        let seed = if opts.seed >= 0 {
            opts.seed as u64
        } else {
            fresh_seed()
        };
        self.slots.insert(
            slot,
            Slot {
                opts: opts_n,
                row,
                window,
                pos: tail.len() % window.max(1),
                len: tail.len(),
                seed,
                draws: 0,
            },
        );
        Ok(())
    }

    pub fn remove(&mut self, slot: usize) -> Result<()> {
        let s = self
            .slots
            .remove(&slot)
            .ok_or(SampleError::UnknownSlot(slot))?;
        self.free_rows.push(s.row);
        self.shrink_pool()
    }

    /// Gives back history memory when wide slots leave: the pool is dropped when no slot is
    /// left, and narrowed to the widest window still in use otherwise (each slot's ring lives
    /// in the first `window` columns of its row, so narrowing never moves an entry).
    fn shrink_pool(&mut self) -> Result<()> {
        if self.slots.is_empty() {
            self.hist = None;
            self.width = 0;
            self.rows = 0;
            self.free_rows.clear();
            return Ok(());
        }
        let widest = self.slots.values().map(|s| s.window).max().unwrap_or(0);
        if widest < self.width {
            self.hist = match (&self.hist, widest) {
                (_, 0) | (None, _) => None,
                (Some(h), w) => Some(h.slice_axis(1, 0, Some(w as i32))?),
            };
            self.width = widest;
        }
        Ok(())
    }

    /// Grows the pool to hold every row and a window of `window` (pads with empty entries).
    fn ensure_pool(&mut self, window: usize) -> Result<()> {
        let width = self.width.max(window);
        let rows = self.rows;
        if width == 0 {
            self.width = 0;
            return Ok(());
        }
        let (have_r, have_w) = self.hist.as_ref().map_or((0, 0), |h| {
            let s = h.shape();
            (s[0] as usize, s[1] as usize)
        });
        if have_r >= rows && have_w >= width {
            return Ok(());
        }
        let new_r = rows.max(have_r).next_power_of_two();
        let fresh = Array::full(&[new_r as i32, width as i32], -1.0, Dtype::I32)?;
        self.hist = Some(match &self.hist {
            Some(h) => fresh.slice_update(
                h,
                &[
                    mlx::Ix::slice(None, Some(have_r as i32), 1),
                    mlx::Ix::slice(None, Some(have_w as i32), 1),
                ],
            )?,
            None => fresh,
        });
        self.width = width;
        self.rows = self.rows.max(new_r);
        // Rows added by rounding up are free for later slots.
        for r in (rows..new_r).rev() {
            self.free_rows.push(r);
        }
        Ok(())
    }

    fn slot(&self, id: usize) -> Result<&Slot> {
        self.slots.get(&id).ok_or(SampleError::UnknownSlot(id))
    }

    /// The history rows `[n, W]` of `rows` (pool row indices).
    fn history_rows(&self, rows: &[usize]) -> Result<Option<Array>> {
        let Some(hist) = &self.hist else {
            return Ok(None);
        };
        let idx: Vec<i32> = rows.iter().map(|&r| r as i32).collect();
        Ok(Some(
            hist.take(&Array::from_slice(&idx, &[idx.len() as i32])?, 0)?,
        ))
    }

    /// Samples one token per slot from `logits: [B, V]` (row i belongs to `slots[i]`), appends
    /// each token to its slot's history, and returns the tokens (and logprobs when asked).
    pub fn sample(&mut self, slots: &[usize], logits: &Array) -> Result<Sampled> {
        let s = logits.shape();
        if s.len() != 2 || s[0] as usize != slots.len() {
            return Err(SampleError::Invalid(format!(
                "logits of shape {s:?} for {} slots (expected [B, V])",
                slots.len()
            )));
        }
        for (i, a) in slots.iter().enumerate() {
            self.slot(*a)?;
            if slots[..i].contains(a) {
                return Err(SampleError::Invalid(format!(
                    "slot {a} appears twice in one call"
                )));
            }
        }
        let first = &self.slot(slots[0])?.opts;
        let fused = slots
            .iter()
            .all(|id| self.slots[id].opts.same_pipeline(first));
        let tokens = if fused {
            self.sample_fused(slots, logits)?
        } else {
            self.sample_per_slot(slots, logits)?
        };
        let (logprobs, top) = self.logprobs(slots, logits, &tokens)?;
        self.append(slots, &tokens)?;
        Ok(Sampled {
            tokens,
            logprobs,
            top,
        })
    }

    fn penalty_rows(&self, slots: &[usize]) -> Result<Option<Array>> {
        let opts = &self.slot(slots[0])?.opts;
        if opts.window() == 0 {
            return Ok(None);
        }
        let rows: Vec<usize> = slots.iter().map(|id| self.slots[id].row).collect();
        self.history_rows(&rows)
    }

    /// One pass over all rows: they share options.
    fn sample_fused(&mut self, slots: &[usize], logits: &Array) -> Result<Array> {
        let hist = self.penalty_rows(slots)?;
        let opts = self.slot(slots[0])?.opts.clone();
        let dist = distribution(logits, hist.as_ref(), &opts, self.strategy)?;
        let u = self.row_uniforms(slots)?;
        dist.sample_with(&u)
    }

    /// Per-slot work, each row with its own options, indexed into the same pool.
    fn sample_per_slot(&mut self, slots: &[usize], logits: &Array) -> Result<Array> {
        let mut out = Vec::with_capacity(slots.len());
        for (i, id) in slots.iter().enumerate() {
            let row = logits.slice_axis(0, i as i32, Some(i as i32 + 1))?;
            let hist = self.penalty_rows(std::slice::from_ref(id))?;
            let opts = self.slot(*id)?.opts.clone();
            let dist = distribution(&row, hist.as_ref(), &opts, self.strategy)?;
            let u = self.row_uniforms(std::slice::from_ref(id))?;
            out.push(dist.sample_with(&u)?);
        }
        let refs: Vec<&Array> = out.iter().collect();
        Ok(mlx::concatenate(&refs, 0)?)
    }

    /// One uniform number per slot, each from that slot's own key stream. Greedy slots make no
    /// draw (their point mass ignores it), so turning sampling on for one slot never shifts
    /// another's stream.
    fn row_uniforms(&mut self, slots: &[usize]) -> Result<Array> {
        let mut parts = Vec::with_capacity(slots.len());
        for id in slots {
            let s = self
                .slots
                .get_mut(id)
                .ok_or(SampleError::UnknownSlot(*id))?;
            parts.push(if s.opts.temperature > 0.0 {
                s.uniforms(1)?
            } else {
                Array::zeros(&[1], Dtype::F32)?
            });
        }
        let refs: Vec<&Array> = parts.iter().collect();
        Ok(mlx::concatenate(&refs, 0)?)
    }

    fn logprobs(
        &self,
        slots: &[usize],
        logits: &Array,
        tokens: &Array,
    ) -> Result<(Option<Array>, Option<TopLogprobs>)> {
        let want = slots
            .iter()
            .any(|id| self.slots[id].opts.logprobs || self.slots[id].opts.top_logprobs > 0);
        if !want {
            return Ok((None, None));
        }
        let k = slots
            .iter()
            .map(|id| self.slots[id].opts.top_logprobs)
            .max()
            .unwrap_or(0);
        let (mut chosen, top) = logprobs(logits, &[tokens], k)?;
        Ok((chosen.pop(), top))
    }

    /// Appends one token per slot to the ring: one scatter for the whole call.
    fn append(&mut self, slots: &[usize], tokens: &Array) -> Result<()> {
        let mut rows = Vec::new();
        let mut cols = Vec::new();
        let mut which = Vec::new();
        for (i, id) in slots.iter().enumerate() {
            let s = self
                .slots
                .get_mut(id)
                .ok_or(SampleError::UnknownSlot(*id))?;
            if s.window == 0 {
                continue;
            }
            rows.push(s.row as i32);
            cols.push(s.pos as i32);
            which.push(i as i32);
            s.pos = (s.pos + 1) % s.window;
            s.len = (s.len + 1).min(s.window);
        }
        if rows.is_empty() {
            return Ok(());
        }
        let n = rows.len() as i32;
        let upd = tokens
            .astype(Dtype::I32)?
            .take(&Array::from_slice(&which, &[n])?, 0)?
            .reshape(&[n, 1, 1])?;
        let r = Array::from_slice(&rows, &[n])?;
        let c = Array::from_slice(&cols, &[n])?;
        if let Some(h) = &self.hist {
            self.hist = Some(h.scatter(&[&r, &c], &upd, &[0, 1])?);
        }
        Ok(())
    }

    /// Writes host-known tokens (accepted drafts) to a slot's history.
    pub fn commit(&mut self, slot: usize, tokens: &[u32]) -> Result<()> {
        if tokens.is_empty() {
            return Ok(());
        }
        let t: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
        let arr = Array::from_slice(&t, &[t.len() as i32])?;
        for i in 0..t.len() {
            let one = arr.slice_axis(0, i as i32, Some(i as i32 + 1))?;
            self.append(&[slot], &one)?;
        }
        Ok(())
    }

    /// The distribution `R` rows of `logits` (`[R, V]`) of one slot sample from, with the
    /// penalty history of row `r` extended by `prefix[..m - (R - 1) + r]` (`prefix: [m]` int32,
    /// possibly still lazy): for verification, `R = m + 1` rows see `d_0..d_{r-1}`; for
    /// proposing, one row sees the whole chain. The slot's history is not changed.
    pub fn distribution(
        &self,
        slot: usize,
        logits: &Array,
        prefix: Option<&Array>,
    ) -> Result<Distribution> {
        let s = self.slot(slot)?;
        let r = logits.shape()[0];
        let m = prefix.map_or(0, |p| p.size() as i32);
        if m < r - 1 {
            return Err(SampleError::Invalid(format!(
                "{r} rows need a prefix of at least {} tokens, got {m}",
                r - 1
            )));
        }
        let hist = if s.window == 0 {
            None
        } else {
            let base = self
                .history_rows(&[s.row])?
                .ok_or_else(|| SampleError::Invalid("no history pool".into()))?;
            let base = base.broadcast_to(&[r, self.width as i32])?;
            match prefix {
                Some(p) if m > 0 => Some(self.extend_history(s, &base, p, m, r)?),
                _ => Some(base),
            }
        };
        distribution(logits, hist.as_ref(), &s.opts, self.strategy)
    }

    /// Rows of `base` with the ring rewritten as if row `r` had appended its share of `prefix`.
    fn extend_history(
        &self,
        s: &Slot,
        base: &Array,
        prefix: &Array,
        m: i32,
        r: i32,
    ) -> Result<Array> {
        let w = s.window as i32;
        let width = self.width as i32;
        let per_row = |row: i32| m - (r - 1) + row;
        let most = (0..r)
            .map(|row| per_row(row).min(w))
            .max()
            .unwrap_or(0)
            .max(1);
        let mut idx = Vec::with_capacity((r * most) as usize);
        let mut src = Vec::with_capacity((r * most) as usize);
        for row in 0..r {
            let n = per_row(row);
            let first = (n - w).max(0);
            for j in 0..most {
                let t = first + j;
                if t < n {
                    idx.push((s.pos as i32 + t).rem_euclid(w));
                    src.push(t);
                } else {
                    idx.push(width); // scratch column
                    src.push(0);
                }
            }
        }
        let idx = Array::from_slice(&idx, &[r, most])?;
        let src = Array::from_slice(&src, &[r * most])?;
        let vals = prefix
            .astype(Dtype::I32)?
            .take(&src, 0)?
            .reshape(&[r, most])?;
        let padded = mlx::concatenate(&[base, &Array::full(&[r, 1], -1.0, Dtype::I32)?], 1)?;
        Ok(padded
            .put_along_axis(&idx, &vals, 1)?
            .slice_axis(1, 0, Some(width))?)
    }

    /// Draws one token per row of `dist` with the slot's key stream (history unchanged).
    pub fn sample_distribution(&mut self, slot: usize, dist: &Distribution) -> Result<Array> {
        let s = self
            .slots
            .get_mut(&slot)
            .ok_or(SampleError::UnknownSlot(slot))?;
        let u = s.uniforms(dist.rows())?;
        dist.sample_with(&u)
    }

    /// `true` with probability `p` (`[R]`), with the slot's key stream.
    pub fn bernoulli(&mut self, slot: usize, p: &Array) -> Result<Array> {
        let s = self
            .slots
            .get_mut(&slot)
            .ok_or(SampleError::UnknownSlot(slot))?;
        let u = s.uniforms(p.size() as i32)?;
        Ok(u.less(&p.reshape(&[-1])?.astype(Dtype::F32)?)?)
    }

    /// The slot's normalized options.
    pub fn options(&self, slot: usize) -> Result<&Options> {
        Ok(&self.slot(slot)?.opts)
    }

    /// The slot's history as the ring holds it (`-1` = empty), for tests and debugging.
    pub fn history(&self, slot: usize) -> Result<Vec<i32>> {
        let s = self.slot(slot)?;
        match self.history_rows(&[s.row])? {
            Some(h) => Ok(h.to_vec::<i32>()?[..s.window].to_vec()),
            None => Ok(Vec::new()),
        }
    }
}
