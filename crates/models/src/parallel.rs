//! A model split over the ranks of a distributed group: by layers ([`Stage`], pipeline
//! parallel) or by tensors ([`Shard`], tensor parallel).
//!
//! By layers, rank `r` holds layers `ranges[r]` and their caches only; the first rank holds the token
//! embedding, the last the head (and a model with per-layer embeddings the embedding on every
//! rank, whose layers read it). A forward pass enters the first stage as embeddings, leaves
//! each stage as the residual stream sent to the next rank, and ends on the last stage, whose
//! logits every rank receives: each rank samples the same token from the same bits
//! (docs/DISTRIBUTED.md).

use crate::{ModelError, Result};
use mlx::distributed::Group;
use mlx::{Array, Dtype};
use std::cell::RefCell;
use std::ops::Range;
use std::rc::Rc;

/// How a model is split over ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Contiguous layers per rank ([`Stage`]); passes of at least `micro_tokens` tokens (0:
    /// none) go down the stages as micro-batches ([`crate::pipeline`]).
    Pipeline { micro_tokens: usize },
    /// Every layer on every rank, each holding its share of the heads and hidden units
    /// ([`Shard`]).
    Tensor,
}

impl Mode {
    /// The split's name, whatever its settings: what decides how the ranks' caches divide.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Pipeline { .. } => "Pipeline",
            Mode::Tensor => "Tensor",
        }
    }
}

/// This rank's part of a split model, either way.
#[derive(Clone)]
pub enum Split {
    Layers(Stage),
    Tensors(Shard),
}

impl Split {
    pub fn stage(&self) -> Option<&Stage> {
        match self {
            Split::Layers(s) => Some(s),
            Split::Tensors(_) => None,
        }
    }

    pub fn shard(&self) -> Option<&Shard> {
        match self {
            Split::Tensors(s) => Some(s),
            Split::Layers(_) => None,
        }
    }
}

/// Where a split model's output goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ends {
    /// Every rank runs the same generation loop: the last rank holds the head, and its logits
    /// go to every rank, which samples for itself (`generate`).
    Everywhere,
    /// Rank 0 leads (the HTTP runner): it holds the embedding and the head, the last rank sends
    /// it the final hidden states, and only rank 0 computes logits and samples.
    First,
}

/// This rank's part of a model split by layers.
#[derive(Clone)]
pub struct Stage {
    group: Rc<Group>,
    layers: Range<usize>,
    /// What the hidden states cross between ranks in: the model's compute dtype.
    dtype: Dtype,
    ends: Ends,
    /// Passes of at least this many tokens go down the stages as micro-batches
    /// ([`crate::pipeline`]); 0: never.
    micro_tokens: usize,
    /// Set while a pass runs as micro-batches.
    flight: RefCell<Option<Flight>>,
}

/// Rank 0's side of a pass in micro-batches where rank 0 leads ([`Ends::First`]): the shape of
/// the micro-batch whose final hidden states are still to come back from the last stage, and
/// those that have.
#[derive(Clone, Default)]
struct Flight {
    pending: Option<Vec<i32>>,
    landed: Vec<Array>,
}

impl Stage {
    /// The part of rank `group.rank()` among `ranges` (one contiguous range per rank, in
    /// order, covering every layer), passing hidden states in `dtype`.
    pub fn new(
        group: Rc<Group>,
        ranges: &[Range<usize>],
        dtype: Dtype,
        ends: Ends,
    ) -> Result<Stage> {
        let layers = ranges.get(group.rank()).cloned().ok_or_else(|| {
            ModelError::Invalid(format!(
                "rank {} of {} has no layers among {ranges:?}",
                group.rank(),
                group.size()
            ))
        })?;
        Ok(Stage {
            group,
            layers,
            dtype,
            ends,
            micro_tokens: 0,
            flight: RefCell::new(None),
        })
    }

    /// Passes of at least `tokens` tokens (0: none) run as micro-batches, one per stage.
    pub fn with_micro_batches(mut self, tokens: usize) -> Stage {
        self.micro_tokens = tokens;
        self
    }

    /// How many micro-batches a pass of `tokens` tokens is cut into: one (the pass whole) where
    /// micro-batches are off, the pass is short, or a micro-batch is already running.
    pub(crate) fn micro_batches(&self, tokens: usize) -> usize {
        let off = self.micro_tokens == 0 || tokens < self.micro_tokens;
        if off || self.flight.borrow().is_some() {
            return 1;
        }
        self.group.size().min(tokens)
    }

    /// Starts a pass in micro-batches: until [`Stage::land`], rank 0 leading leaves each
    /// micro-batch's final hidden states on their way back while it computes the next one.
    pub(crate) fn take_off(&self) {
        *self.flight.borrow_mut() = Some(Flight::default());
    }

    /// Ends a pass in micro-batches: on rank 0 leading, every micro-batch's final hidden
    /// states in order (the last one received here); elsewhere `None` (each micro-batch's pass
    /// returned its own).
    pub(crate) fn land(&self) -> Result<Option<Vec<Array>>> {
        let Some(mut flight) = self.flight.borrow_mut().take() else {
            return Ok(None);
        };
        if !self.leads_a_return() {
            return Ok(None);
        }
        if let Some(shape) = flight.pending.take() {
            flight.landed.push(self.receive_last(&shape)?);
        }
        Ok(Some(flight.landed))
    }

    /// Drops a pass in micro-batches that failed part way.
    pub(crate) fn abort_flight(&self) {
        self.flight.borrow_mut().take();
    }

    /// Whether this rank sends the residual stream on and gets the final hidden states back
    /// (rank 0 leading a model of several stages).
    fn leads_a_return(&self) -> bool {
        self.ends == Ends::First && self.is_first() && !self.is_last()
    }

    /// The final hidden states of `shape` from the last stage, evaluated here.
    fn receive_last(&self, shape: &[i32]) -> Result<Array> {
        let out = self.group.recv(shape, self.dtype, self.group.size() - 1)?;
        out.eval()?;
        mlx::synchronize()?;
        Ok(out)
    }

    pub fn layers(&self) -> Range<usize> {
        self.layers.clone()
    }

    fn rank(&self) -> usize {
        self.group.rank()
    }

    /// Whether this stage embeds the tokens.
    pub fn is_first(&self) -> bool {
        self.rank() == 0
    }

    /// Whether this stage ends with the final norm.
    pub fn is_last(&self) -> bool {
        self.rank() + 1 == self.group.size()
    }

    /// Whether this rank holds the head (computes logits).
    pub fn holds_head(&self) -> bool {
        match self.ends {
            Ends::Everywhere => self.is_last(),
            Ends::First => self.is_first(),
        }
    }

    /// `x` from the one rank that computed it, on every rank (the others pass zeros of its
    /// shape), evaluated here ([`Stage::leave`] on why).
    pub fn from_owner(&self, x: &Array) -> Result<Array> {
        let s = self.group.all_sum(x)?;
        s.eval()?;
        mlx::synchronize()?;
        Ok(s)
    }

    /// The residual stream `[1, T, H]` (`shape`) this stage starts from: `embed()` on the
    /// first stage, else what the previous rank sends.
    pub fn enter(&self, shape: &[i32], embed: impl FnOnce() -> Result<Array>) -> Result<Array> {
        if self.is_first() {
            return Ok(embed()?.astype(self.dtype)?);
        }
        Ok(self.group.recv(shape, self.dtype, self.rank() - 1)?)
    }

    /// Ends this stage's part of a forward pass: the last stage's `out` (the final hidden
    /// states), computed here; another stage sends its residual stream `h` on to the next rank
    /// and returns zeros of its shape (only the last stage's hidden states are real; the
    /// logits come from it, [`Stage::logits`]).
    ///
    /// Every collective is evaluated where the code meets it, in the same order on every
    /// rank: a rank that left one pending would run it when a later evaluation happened to
    /// need it, after collectives its peers ran first, and the ranks would wait on each other.
    /// The stream's error is raised after each ([`Shard::sum`] on why).
    ///
    /// Where rank 0 leads ([`Ends::First`]), the last stage sends `out` to rank 0 instead, and
    /// rank 0 returns what it receives.
    pub fn leave(&self, h: &Array, out: Option<Array>) -> Result<Array> {
        match out {
            Some(out) if self.is_last() => {
                if self.ends == Ends::First {
                    self.group.send(&out.astype(self.dtype)?, 0)?.eval()?;
                    mlx::synchronize()?;
                    return Ok(Array::zeros(&h.shape(), self.dtype)?);
                }
                out.eval()?;
                mlx::synchronize()?;
                Ok(out)
            }
            _ if self.is_last() => Err(ModelError::Invalid(
                "the last stage ended without final hidden states".into(),
            )),
            _ if self.leads_a_return() && self.flight.borrow().is_some() => {
                // In micro-batches: this one's residual stream is computed before waiting on
                // the previous one's return, and sent only after it: the last stage sends
                // that return before it receives this one, so two sends never wait on each
                // other whatever their size.
                let x = h.astype(self.dtype)?;
                x.eval()?;
                mlx::synchronize()?;
                let previous = self
                    .flight
                    .borrow_mut()
                    .as_mut()
                    .and_then(|f| f.pending.take());
                if let Some(shape) = previous {
                    let back = self.receive_last(&shape)?;
                    if let Some(f) = self.flight.borrow_mut().as_mut() {
                        f.landed.push(back);
                    }
                }
                self.group.send(&x, self.rank() + 1)?.eval()?;
                mlx::synchronize()?;
                if let Some(f) = self.flight.borrow_mut().as_mut() {
                    f.pending = Some(h.shape());
                }
                Ok(Array::zeros(&h.shape(), self.dtype)?)
            }
            _ => {
                self.group
                    .send(&h.astype(self.dtype)?, self.rank() + 1)?
                    .eval()?;
                mlx::synchronize()?;
                if self.ends == Ends::First && self.is_first() {
                    return self.receive_last(&h.shape());
                }
                Ok(Array::zeros(&h.shape(), self.dtype)?)
            }
        }
    }

    /// The logits of `hidden` (`[.., H]`) over `vocab` tokens, as float32, on every rank: the
    /// last stage computes them with `head`, which only it holds, and sends them to the others
    /// (evaluated here, see [`Stage::leave`]).
    pub fn logits(
        &self,
        hidden: &Array,
        vocab: usize,
        head: impl FnOnce() -> Result<Array>,
    ) -> Result<Array> {
        if self.ends == Ends::First {
            return if self.holds_head() {
                head()
            } else {
                Err(ModelError::Invalid(
                    "logits asked of a rank that follows rank 0".into(),
                ))
            };
        }
        let logits = if self.is_last() {
            head()?.astype(Dtype::F32)?
        } else {
            let mut shape = hidden.shape();
            if let Some(last) = shape.last_mut() {
                *last = vocab as i32;
            }
            Array::zeros(&shape, Dtype::F32)?
        };
        let logits = self.group.broadcast(&logits, self.group.size() - 1)?;
        logits.eval()?;
        mlx::synchronize()?;
        Ok(logits)
    }
}

/// This rank's share of a model split by tensors (tensor parallel, docs/DISTRIBUTED.md).
///
/// Every rank holds every layer: a contiguous share of the attention heads (queries, their
/// keys and values, and the output projection's matching columns) and of each MLP's hidden
/// units (gate and up rows, down columns; each expert's alike), and the norms, routers and
/// embeddings whole. The output projections' partial products are summed over the ranks
/// ([`Shard::sum`]), two sums per layer; each rank's caches hold its own heads only.
#[derive(Clone)]
pub struct Shard {
    group: Rc<Group>,
    ends: Ends,
}

/// The query heads and the key/value heads a rank holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Heads {
    pub q: Range<i32>,
    pub kv: Range<i32>,
}

/// Part `i` of `n` items cut into `parts` contiguous pieces as even as they go.
fn even(n: i32, parts: i32, i: i32) -> Range<i32> {
    let at = |k: i32| ((i64::from(n) * i64::from(k)) / i64::from(parts)) as i32;
    at(i)..at(i + 1)
}

impl Shard {
    pub fn new(group: Rc<Group>, ends: Ends) -> Shard {
        Shard { group, ends }
    }

    pub fn rank(&self) -> usize {
        self.group.rank()
    }

    pub fn size(&self) -> usize {
        self.group.size()
    }

    pub fn ends(&self) -> Ends {
        self.ends
    }

    /// Whether every rank computes its share of the vocabulary's logits and they gather them
    /// ([`Ends::Everywhere`]), rather than rank 0 leading with the whole head.
    pub fn splits_head(&self) -> bool {
        self.ends == Ends::Everywhere
    }

    /// Whether this is rank 0 leading the others ([`Ends::First`]): it holds the whole head
    /// and the whole table, which its drafters read too.
    pub fn leads(&self) -> bool {
        self.ends == Ends::First && self.rank() == 0
    }

    /// Whether this rank computes logits: its share ([`Shard::splits_head`]) or, leading, all.
    pub fn holds_head(&self) -> bool {
        self.splits_head() || self.leads()
    }

    /// This rank's share of `n` items taken in whole units of `unit` (a quantization group,
    /// so that a matrix cut along its input keeps whole groups); `unit` 1 where `n` does not
    /// divide into units enough for every rank. `what` names the items in the error where
    /// there are fewer than ranks.
    pub fn part(&self, n: i32, unit: i32, what: &str) -> Result<Range<i32>> {
        part_of(n, unit, what, self.size() as i32, self.rank() as i32)
    }

    /// This rank's query heads among `q` and the key/value heads they read among `kv`
    /// ([`heads_of`]).
    pub fn heads(&self, q: i32, kv: i32) -> Result<Heads> {
        heads_of(q, kv, self.size() as i32, self.rank() as i32)
    }

    /// The final hidden states of a forward pass, evaluated here: the pass's sums then run
    /// in program order on every rank, before whatever rank 0 does next (its next call to
    /// the others, [`Stage::leave`] on ordering). MLX's ring records a lost peer as an error
    /// of the stream, not of the evaluation that met it; synchronizing raises it here, before
    /// anything of the failed pass is used.
    pub fn finish(&self, out: Array) -> Result<Array> {
        out.eval()?;
        mlx::synchronize()?;
        Ok(out)
    }

    /// Logits over `vocab` tokens from `head` (this rank's rows of the head where every rank
    /// computes them, gathered; rank 0's whole head where it leads).
    pub fn logits(&self, vocab: i32, head: impl FnOnce() -> Result<Array>) -> Result<Array> {
        if self.splits_head() {
            self.gather_vocab(&head()?, vocab)
        } else if self.leads() {
            head()
        } else {
            Err(ModelError::Invalid(
                "logits asked of a rank that follows rank 0".into(),
            ))
        }
    }

    /// The sum of every rank's `x` (partial products of a matrix split along its input),
    /// evaluated here. MLX's ring fails a collective that meets a lost peer by stopping that
    /// connection's thread and recording the error on the stream: a later collective in the
    /// same evaluation would wait on the stopped thread for ever. So each sum is evaluated on
    /// its own and the stream's error raised before the next one is built.
    pub fn sum(&self, x: &Array) -> Result<Array> {
        let s = self.group.all_sum(x)?;
        s.eval()?;
        mlx::synchronize()?;
        Ok(s)
    }

    /// Logits `[.., V]` from each rank's share of the vocabulary (`part`, `[.., ≤ ⌈V/R⌉]`,
    /// rows `vocab_part(V)` of the head), gathered on every rank and evaluated here: every
    /// rank then samples from the same bits, whatever the sums left in the last bits of its
    /// hidden states.
    pub fn gather_vocab(&self, part: &Array, vocab: i32) -> Result<Array> {
        let ranks = self.size() as i32;
        let width = self.vocab_width(vocab);
        let shape = part.shape();
        let lead: Vec<i32> = shape[..shape.len() - 1].to_vec();
        let have = shape[shape.len() - 1];
        let mut part = part.astype(Dtype::F32)?;
        if have < width {
            let mut pad = lead.clone();
            pad.push(width - have);
            part = mlx::concatenate(&[&part, &Array::zeros(&pad, Dtype::F32)?], -1)?;
        }
        let rows: i32 = lead.iter().product();
        let all = self.group.all_gather(&part.reshape(&[1, rows, width])?)?; // [R, rows, width]
        let mut out = all
            .transpose(&[1, 0, 2])?
            .reshape(&[rows, ranks * width])?
            .slice_axis(-1, 0, Some(vocab))?;
        let mut full = lead;
        full.push(vocab);
        out = out.reshape(&full)?;
        out.eval()?;
        mlx::synchronize()?;
        Ok(out)
    }

    /// The embeddings of `ids` from every rank's rows of the table: `lookup` reads this
    /// rank's rows (`vocab_part`) at local ids; an id another rank holds reads row 0 here and
    /// is zeroed, and the ranks sum. Exact: each id's row comes from the one rank holding it.
    pub fn embed(
        &self,
        ids: &Array,
        vocab: i32,
        lookup: impl FnOnce(&Array) -> Result<Array>,
    ) -> Result<Array> {
        let rows = self.vocab_part(vocab);
        let ids = ids.astype(Dtype::I32)?;
        let inside = ids
            .greater_equal_scalar(f64::from(rows.start))?
            .logical_and(&ids.less_scalar(f64::from(rows.end))?)?;
        let local = mlx::where_(
            &inside,
            &ids.subtract_scalar(f64::from(rows.start))?,
            &ids.zeros_like()?,
        )?;
        let e = lookup(&local)?;
        let e = e.multiply(&inside.expand_dims(-1)?.astype(e.dtype())?)?;
        self.sum(&e)
    }

    /// This rank's rows of a head over `vocab` tokens (see [`Shard::gather_vocab`]).
    pub fn vocab_part(&self, vocab: i32) -> Range<i32> {
        let width = self.vocab_width(vocab);
        let r = self.rank() as i32;
        (r * width).min(vocab)..((r + 1) * width).min(vocab)
    }

    /// Tokens of the vocabulary per rank (the last rank's share may be shorter).
    fn vocab_width(&self, vocab: i32) -> i32 {
        let ranks = self.size() as i32;
        (vocab + ranks - 1) / ranks
    }
}

/// [`Shard::part`] for rank `rank` of `ranks`.
pub fn part_of(n: i32, unit: i32, what: &str, ranks: i32, rank: i32) -> Result<Range<i32>> {
    if n < ranks {
        return Err(ModelError::Invalid(format!(
            "cannot split {n} {what} over {ranks} ranks"
        )));
    }
    let unit = if unit > 1 && n % unit == 0 && n / unit >= ranks {
        unit
    } else {
        1
    };
    let r = even(n / unit, ranks, rank);
    Ok(r.start * unit..r.end * unit)
}

/// Rank `rank`'s query heads among `q` and the key/value heads they read among `kv` (`q` a
/// multiple of `kv`, each key/value head read by `q / kv` consecutive query heads). With at
/// least as many key/value heads as ranks, those split and their query heads follow; with
/// fewer, each key/value head is held by several ranks, which split its query heads. Either
/// way a rank's query heads read its key/value heads evenly, as grouped attention needs.
pub fn heads_of(q: i32, kv: i32, ranks: i32, rank: i32) -> Result<Heads> {
    if kv <= 0 || q % kv != 0 {
        return Err(ModelError::Invalid(format!(
            "{q} query heads do not share {kv} key/value heads evenly"
        )));
    }
    let g = q / kv;
    if kv >= ranks {
        let kvr = even(kv, ranks, rank);
        return Ok(Heads {
            q: kvr.start * g..kvr.end * g,
            kv: kvr,
        });
    }
    // Ranks per key/value head: `ranks / kv`, one more for the first `ranks % kv`.
    let mut first = 0;
    for head in 0..kv {
        let n = ranks / kv + i32::from(head < ranks % kv);
        if rank < first + n {
            if g < n {
                return Err(ModelError::Invalid(format!(
                    "cannot split {q} query heads ({g} per key/value head) over {ranks} ranks"
                )));
            }
            let part = even(g, n, rank - first);
            return Ok(Heads {
                q: head * g + part.start..head * g + part.end,
                kv: head..head + 1,
            });
        }
        first += n;
    }
    Err(ModelError::Invalid(format!("no rank {rank} of {ranks}")))
}

/// Contiguous layer ranges, one per rank, whose weights are as even as the split allows:
/// the split minimises the largest stage's bytes, counting `ends` (what the first and the
/// last stage hold besides layers: the embedding, the head). A boundary `b` (the first layer
/// of a stage) must satisfy `allowed(b)` (KV-shared layers stay with the layers whose caches
/// they read).
pub fn split_layers(
    bytes: &[u64],
    ranks: usize,
    ends_bytes: [u64; 2],
    allowed: impl Fn(usize) -> bool,
) -> Result<Vec<Range<usize>>> {
    let n = bytes.len();
    let cuts: Vec<usize> = (1..n).filter(|&b| allowed(b)).collect();
    if ranks == 0 || cuts.len() + 1 < ranks {
        return Err(ModelError::Invalid(format!(
            "cannot split {n} layers over {ranks} ranks: {} of the places between layers may \
             begin a stage",
            cuts.len()
        )));
    }
    let mut prefix = vec![0u64; n + 1];
    for (i, b) in bytes.iter().enumerate() {
        prefix[i + 1] = prefix[i] + b;
    }
    // Stage ends: the cuts, then n.
    let ends: Vec<usize> = cuts.iter().copied().chain([n]).collect();
    // best[k][e]: the smallest largest stage putting layers 0..ends[e] on k + 1 stages, with
    // the index of the previous end.
    let inf = u64::MAX;
    let mut best = vec![vec![(inf, usize::MAX); ends.len()]; ranks];
    let extra = |k: usize| {
        let first = if k == 0 { ends_bytes[0] } else { 0 };
        let last = if k + 1 == ranks { ends_bytes[1] } else { 0 };
        first + last
    };
    for (e, &end) in ends.iter().enumerate() {
        best[0][e] = (prefix[end] + extra(0), usize::MAX);
    }
    for k in 1..ranks {
        for e in 0..ends.len() {
            for p in 0..e {
                let (prev, _) = best[k - 1][p];
                if prev == inf {
                    continue;
                }
                let cost = prev.max(prefix[ends[e]] - prefix[ends[p]] + extra(k));
                if cost < best[k][e].0 {
                    best[k][e] = (cost, p);
                }
            }
        }
    }
    let mut e = ends.len() - 1;
    let mut stage_ends = Vec::with_capacity(ranks);
    for k in (0..ranks).rev() {
        stage_ends.push(ends[e]);
        e = best[k][e].1;
    }
    stage_ends.reverse();
    let mut start = 0;
    Ok(stage_ends
        .into_iter()
        .map(|end| {
            let r = start..end;
            start = end;
            r
        })
        .collect())
}

/// What the first and the last stage hold besides layers, in bytes (see [`split_layers`]):
/// `embed` and `head` bytes placed as `ends` places them (`tied`: the head is the embedding;
/// `everywhere`: every rank holds the embedding anyway, per-layer embeddings).
pub fn end_bytes(ends: Ends, embed: u64, head: u64, tied: bool, everywhere: bool) -> [u64; 2] {
    let embed_first = if everywhere { 0 } else { embed };
    let head = match (tied, everywhere) {
        (true, true) => 0,
        (true, false) => embed,
        (false, _) => head,
    };
    match ends {
        Ends::Everywhere => [embed_first, head],
        // A tied head on rank 0 is the embedding it holds already.
        Ends::First => [embed_first + if tied { 0 } else { head }, 0],
    }
}

/// Bytes of the tensors among `tensors` whose names start with `prefix`.
pub fn bytes_under<'a>(tensors: impl IntoIterator<Item = (&'a str, u64)>, prefix: &str) -> u64 {
    tensors
        .into_iter()
        .filter(|(n, _)| n.starts_with(prefix))
        .map(|(_, b)| b)
        .sum()
}

/// Bytes of each layer's tensors among `tensors` (name, bytes), the layers being named
/// `{prefix}.{i}.…` for `i < layers`.
pub fn layer_bytes<'a>(
    tensors: impl IntoIterator<Item = (&'a str, u64)>,
    prefix: &str,
    layers: usize,
) -> Vec<u64> {
    let mut out = vec![0u64; layers];
    let lead = format!("{prefix}.");
    for (name, bytes) in tensors {
        let Some(rest) = name.strip_prefix(&lead) else {
            continue;
        };
        let index = rest.split('.').next().and_then(|i| i.parse::<usize>().ok());
        if let Some(slot) = index.and_then(|i| out.get_mut(i)) {
            *slot += bytes;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_balance_bytes_and_respect_allowed_cuts() {
        let even = split_layers(&[1, 1, 1, 1, 1, 1], 3, [0, 0], |_| true).unwrap();
        assert_eq!(even, vec![0..2, 2..4, 4..6]);
        // One heavy layer gets a stage of its own.
        let heavy = split_layers(&[1, 1, 10, 1, 1], 3, [0, 0], |_| true).unwrap();
        assert_eq!(heavy[1], 2..3, "{heavy:?}");
        // Layers 3.. share caches with layer 2: no cut after 2.
        let shared = split_layers(&[1; 6], 2, [0, 0], |b| b <= 2).unwrap();
        assert_eq!(shared, vec![0..2, 2..6]);
        // What the first stage holds besides layers (the embedding) moves a layer on.
        let ends = split_layers(&[2; 4], 2, [4, 0], |_| true).unwrap();
        assert_eq!(ends, vec![0..1, 1..4]);
        let e = split_layers(&[1; 3], 4, [0, 0], |_| true)
            .unwrap_err()
            .to_string();
        assert!(e.contains("cannot split 3 layers over 4 ranks"), "{e}");
        let e = split_layers(&[1; 6], 3, [0, 0], |b| b <= 1)
            .unwrap_err()
            .to_string();
        assert!(e.contains("1 of the places"), "{e}");
    }

    #[test]
    fn even_parts_cover_everything_once() {
        for n in 1..20 {
            for parts in 1..=n.min(5) {
                let all: Vec<i32> = (0..parts).flat_map(|i| even(n, parts, i)).collect();
                assert_eq!(all, (0..n).collect::<Vec<_>>());
            }
        }
    }

    #[test]
    fn heads_split_by_key_value_groups() {
        let h = |q, kv, ranks| -> Vec<(Range<i32>, Range<i32>)> {
            (0..ranks)
                .map(|r| {
                    let h = heads_of(q, kv, ranks, r).unwrap();
                    (h.q, h.kv)
                })
                .collect()
        };
        // Enough key/value heads: they split, their queries follow.
        assert_eq!(h(8, 4, 2), vec![(0..4, 0..2), (4..8, 2..4)]);
        assert_eq!(h(4, 4, 3), vec![(0..1, 0..1), (1..2, 1..2), (2..4, 2..4)]);
        // Fewer: each is held by several ranks, which split its query heads.
        assert_eq!(h(4, 1, 2), vec![(0..2, 0..1), (2..4, 0..1)]);
        assert_eq!(h(4, 2, 3), vec![(0..1, 0..1), (1..2, 0..1), (2..4, 1..2)]);
        assert_eq!(h(4, 1, 3), vec![(0..1, 0..1), (1..2, 0..1), (2..4, 0..1)]);
        let e = heads_of(2, 2, 3, 0).unwrap_err().to_string();
        assert!(e.contains("cannot split 2 query heads"), "{e}");
        assert!(heads_of(6, 4, 2, 0).is_err());
    }

    #[test]
    fn parts_keep_whole_units_where_they_can() {
        let p = |n, unit, ranks| -> Vec<Range<i32>> {
            (0..ranks)
                .map(|r| part_of(n, unit, "units", ranks, r).unwrap())
                .collect()
        };
        assert_eq!(p(256, 64, 2), vec![0..128, 128..256]);
        assert_eq!(p(192, 64, 2), vec![0..64, 64..192]);
        // Too few groups for the ranks: single items.
        assert_eq!(p(64, 64, 2), vec![0..32, 32..64]);
        let e = part_of(2, 1, "experts", 3, 0).unwrap_err().to_string();
        assert!(e.contains("cannot split 2 experts over 3 ranks"), "{e}");
    }

    #[test]
    fn layer_bytes_reads_the_index_after_the_prefix() {
        let t = [
            ("model.layers.0.mlp.w", 10),
            ("model.layers.1.attn.w", 5),
            ("model.layers.1.attn.s", 1),
            ("model.layers.12.x", 7), // past the layers: an MTP layer
            ("model.embed_tokens.weight", 100),
        ];
        assert_eq!(layer_bytes(t, "model.layers", 2), vec![10, 6]);
    }
}
