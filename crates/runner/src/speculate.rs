//! Draft-verify speculative decoding (issue 7; MODELS.md §2, §3.5, §4).
//!
//! A round of depth `k`: the drafter proposes `d1..dk`, each sampled from its distribution `q`
//! under the request's sampler options with penalties extended by the drafts before it; one
//! target forward over `[current, d1..dk]` gives the target distributions `p`; draft `i` is
//! accepted with probability `min(1, p(di) / q(di))`, the first rejected position is resampled
//! from `normalise(max(p − q, 0))`, and when every draft is accepted a bonus token comes from
//! the last row. Everything is built as one lazy graph and read back with a single host
//! synchronisation. Greedy decoding is the special case where `p` and `q` are point masses, so
//! acceptance is exact match. Caches are rewound to exactly the committed tokens, so rejected
//! drafts leave no trace; penalty history is committed only after acceptance.
//!
//! Three drafters: the gemma4 assistant (no caches, reads the target's), GLM's MTP layer (its own
//! latent cache, fed `(token, target hidden)` pairs for every committed position), and a
//! separate small model (its own caches, caught up lazily with the committed tokens).

use crate::generate::{tokens_array, Ctx, Event, GenerateError, Generation, Result, RoundReport};
use cache::{LatentCache, LayerCache};
use mlx::{Array, Dtype, Ix};
use models::gemma4::{Gemma4, SharedKv};
use models::gemma4_assistant::Gemma4Assistant;
use models::glm4_moe_lite::Glm4MoeLite;
use models::CausalLm;
use sample::{Distribution, Sampled};

/// MTP pairs are buffered while no round drafts, and fed in one batch past this many.
const MTP_FLUSH: usize = 256;

/// A loaded drafter, shared by the engine's sequences.
pub enum DraftModel {
    Assistant(Box<Gemma4Assistant>),
    /// GLM's MTP layer from the target checkpoint.
    Mtp,
    Model(Box<dyn CausalLm>),
}

impl DraftModel {
    /// The drafter's own caches for one sequence, beside the target's `target` (GLM's MTP
    /// layer is one more latent layer of the target's, stored alike).
    pub fn make_caches(&self, target: &[LayerCache]) -> Vec<LayerCache> {
        match self {
            DraftModel::Assistant(_) => Vec::new(),
            DraftModel::Mtp => vec![LayerCache::Latent(match target.first() {
                Some(LayerCache::Latent(c)) => c.fresh_like(),
                _ => LatentCache::new(),
            })],
            DraftModel::Model(m) => m.make_caches(),
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            DraftModel::Assistant(_) => "gemma4 assistant",
            DraftModel::Mtp => "GLM MTP layer",
            DraftModel::Model(_) => "separate model",
        }
    }
}

fn mtp_parts(target: &dyn CausalLm) -> Result<(&models::glm4_moe_lite::GlmMtp, &models::nn::Rope)> {
    let glm = target
        .as_any()
        .downcast_ref::<Glm4MoeLite>()
        .ok_or_else(|| GenerateError::BadRequest("the MTP drafter needs a GLM target".into()))?;
    let mtp = glm.mtp().ok_or_else(|| {
        GenerateError::BadRequest("the target checkpoint has no MTP layer".into())
    })?;
    Ok((mtp, glm.rope()))
}

fn latent(caches: &mut [LayerCache]) -> Result<&mut LatentCache> {
    match caches.first_mut() {
        Some(LayerCache::Latent(c)) => Ok(c),
        _ => Err(GenerateError::BadRequest(
            "the MTP drafter lost its cache".into(),
        )),
    }
}

/// A sequence's drafting state.
pub struct DraftState {
    /// The drafter's own caches.
    pub(crate) caches: Vec<LayerCache>,
    /// Positions the drafter covers: tokens fed (separate model) or pairs fed (MTP).
    fed: usize,
    /// MTP: the target hiddens of positions `fed..` of the target, the last one being the
    /// hidden that produced the pending token.
    backlog: Vec<Array>,
}

impl DraftState {
    pub(crate) fn new(_model: &DraftModel, caches: Vec<LayerCache>, cached: usize) -> DraftState {
        DraftState {
            caches,
            fed: cached,
            backlog: Vec::new(),
        }
    }

    /// After a prefill chunk the target fed (`fed` is every token it now holds).
    pub(crate) fn prefilled(
        &mut self,
        model: &DraftModel,
        _chunk: &[u32],
        hidden: &Array,
        fed: &[u32],
    ) -> Result<()> {
        match model {
            DraftModel::Assistant(_) => Ok(()),
            DraftModel::Mtp => {
                self.backlog.push(hidden.clone());
                Ok(())
            }
            // In lockstep during prefill, so that prefix-cache snapshots see both at one offset.
            DraftModel::Model(m) => self.catch_up_model(&**m, fed, None).map(|_| ()),
        }
    }

    /// After a plain decode step fed the target one token (hidden `[1, 1, H]`).
    pub(crate) fn decoded(&mut self, model: &DraftModel, hidden: &Array) -> Result<()> {
        if let DraftModel::Mtp = model {
            self.backlog.push(hidden.clone());
        }
        Ok(())
    }

    /// Feeds the separate drafter every target token it lacks, then `extra` if given; returns the
    /// last position's hidden state.
    fn catch_up_model(
        &mut self,
        m: &dyn CausalLm,
        fed: &[u32],
        extra: Option<&Array>,
    ) -> Result<Option<Array>> {
        let mut parts: Vec<Array> = Vec::new();
        if self.fed < fed.len() {
            parts.push(tokens_array(&fed[self.fed..])?);
        }
        if let Some(e) = extra {
            parts.push(e.reshape(&[1, -1])?.astype(Dtype::I32)?);
        }
        if parts.is_empty() {
            return Ok(None);
        }
        let refs: Vec<&Array> = parts.iter().collect();
        let toks = mlx::concatenate(&refs, 1)?;
        let n = toks.shape()[1] as usize;
        let hidden = m.forward(&toks, &mut self.caches)?;
        self.fed += n;
        Ok(Some(
            hidden.index(&[Ix::full(), Ix::slice(Some(-1), None, 1)])?,
        ))
    }

    /// Feeds MTP pairs for every committed target position but the last: token `fed[i + 1]`
    /// with the target's hidden at `i`.
    fn catch_up_mtp(&mut self, target: &dyn CausalLm, fed: &[u32]) -> Result<()> {
        let s = fed.len();
        if self.fed + 1 >= s || self.backlog.is_empty() {
            return Ok(());
        }
        let (mtp, rope) = mtp_parts(target)?;
        let refs: Vec<&Array> = self.backlog.iter().collect();
        let mut hidden = mlx::concatenate(&refs, 1)?;
        let count = hidden.shape()[1] as usize;
        debug_assert!(count >= s - self.fed);
        if count > s - self.fed {
            // A round that ended at EOS committed fewer tokens than it verified.
            hidden = hidden.slice_axis(1, 0, Some((s - self.fed) as i32))?;
        }
        let pairs = s - 1 - self.fed;
        let h = hidden.slice_axis(1, 0, Some(pairs as i32))?;
        let toks = tokens_array(&fed[self.fed + 1..s])?;
        mtp.feed(&toks, &h, latent(&mut self.caches)?, rope)?;
        self.backlog = vec![hidden.slice_axis(1, pairs as i32, None)?];
        self.fed = s - 1;
        Ok(())
    }

    /// Keeps the MTP backlog bounded while no round drafts.
    pub(crate) fn maintain(
        &mut self,
        model: &DraftModel,
        target: &dyn CausalLm,
        fed: &[u32],
    ) -> Result<()> {
        let held: usize = self.backlog.iter().map(|b| b.shape()[1] as usize).sum();
        if matches!(model, DraftModel::Mtp) && held > MTP_FLUSH {
            self.catch_up_mtp(target, fed)?;
        }
        Ok(())
    }
}

/// A round's drafts, waiting for the target's verify forward.
pub(crate) struct Proposal {
    /// The pending token the drafts follow.
    current: Sampled,
    /// The drafter's distribution at each draft.
    qs: Vec<Distribution>,
    /// `[k]` int32 drafts.
    dcat: Array,
    /// `[1, k+1]`: the pending token and the drafts, for the target.
    pub(crate) tokens: Array,
    pub(crate) k: usize,
    state: DraftState,
    /// Tokens fed before the round.
    s: usize,
    /// Structured output: the grammar's allowed tokens at each position of the block (after
    /// the pending token and each draft), `k + 1` of them.
    masks: Option<Vec<grammar::Allowed>>,
    /// The grammar failed while the drafts were made: the round fails this sequence alone.
    failed: Option<String>,
}

fn prefix(drafts: &[Array]) -> Result<Option<Array>> {
    if drafts.is_empty() {
        return Ok(None);
    }
    let refs: Vec<&Array> = drafts.iter().collect();
    Ok(Some(mlx::concatenate(&refs, 0)?))
}

impl Generation {
    /// Before the caches go to the prefix cache: the MTP drafter takes in every pair the
    /// committed tokens allow (it trails the target by the pairs it buffered while plain steps
    /// or the last round ran), so that how much of a sequence later requests can reuse does not
    /// depend on whether its last steps drafted.
    pub(crate) fn settle_draft(&mut self, model: &DraftModel, target: &dyn CausalLm) -> Result<()> {
        match (model, &mut self.draft) {
            (DraftModel::Mtp, Some(d)) => d.catch_up_mtp(target, &self.fed),
            _ => Ok(()),
        }
    }

    /// Committed tokens this sequence's drafter has yet to take in: a round's usual one or two,
    /// or many after plain steps, when the round pays for catching up as well.
    pub(crate) fn drafter_lag(&self, model: &DraftModel) -> usize {
        match (model, &self.draft) {
            (DraftModel::Model(_), Some(d)) => self.fed.len().saturating_sub(d.fed),
            (DraftModel::Mtp, Some(d)) => self.fed.len().saturating_sub(d.fed + 1),
            _ => 0,
        }
    }

    /// A seeded request's own choice of depth within `limit`; `None` for a request on the
    /// engine's controller.
    pub(crate) fn own_choice(&mut self, limit: usize) -> Option<usize> {
        self.own_depth.as_mut().map(|c| c.choose(limit))
    }

    /// Whether the depth of this sequence's rounds comes from a controller of its own (a
    /// seeded sampling request), not the engine's.
    pub(crate) fn has_own_depth(&self) -> bool {
        self.own_depth.is_some()
    }

    /// The deepest round this sequence may draft now (0: none, or no drafter), after keeping
    /// its drafter's state up.
    pub(crate) fn depth_limit(&mut self, ctx: &mut Ctx<'_>) -> usize {
        if self.draft.is_none() {
            return 0;
        }
        let Some((model, _)) = &mut ctx.draft else {
            return 0;
        };
        if let Some(d) = &mut self.draft {
            if let Err(e) = d.maintain(model, ctx.model, &self.fed) {
                tracing::warn!("drafter maintenance failed, drafting off for this request: {e}");
                self.draft = None;
                return 0;
            }
        }
        // The pending token sits at position fed.len() and each draft one further; a round of
        // depth k feeds up to k + 1 tokens and leaves a new pending token after them, which is
        // emitted too: s + k + 2 tokens in all, never more than the context. Every emitted
        // token counts against num_predict, and a round emits up to depth + 1.
        let s = self.fed.len();
        let by_ctx = (self.params.num_ctx.saturating_sub(2)).saturating_sub(s);
        let by_len = self.remaining().saturating_sub(1);
        by_ctx.min(by_len)
    }

    /// A round's verdict, as a graph: the target's distributions over [`Proposal::tokens`] from
    /// its `logits` `[k+1, V]`, then accept or reject each draft, the resampled token and the
    /// bonus. Built for every verifying row of a step before any is read, so that one
    /// evaluation serves them all.
    pub(crate) fn verdict(
        &self,
        ctx: &mut Ctx<'_>,
        proposal: &Proposal,
        logits: &Array,
    ) -> Result<Verdict> {
        if let Some(e) = &proposal.failed {
            return Err(grammar::GrammarError::Matcher(e.clone()).into());
        }
        let (k, slot, dcat) = (proposal.k, self.slot, &proposal.dcat);
        let v = *logits.shape().last().unwrap_or(&0);
        let mut logits = logits.reshape(&[k as i32 + 1, v])?.astype(Dtype::F32)?;
        if let Some(masks) = &proposal.masks {
            let bias: Vec<f32> = masks.iter().flat_map(|m| m.bias(v as usize)).collect();
            logits = logits.add(&Array::from_slice(&bias, &[k as i32 + 1, v])?)?;
        }
        let p = ctx.sampler.distribution(slot, &logits, Some(dcat))?;
        let q = Distribution::concat(&proposal.qs.iter().collect::<Vec<_>>())?;
        let p_rows = p.slice_rows(0, k as i32)?;
        let pd = p_rows.prob_of(dcat)?;
        let qd = q.prob_of(dcat)?;
        let ratio = pd.divide(&qd.maximum_scalar(1e-30)?)?.minimum_scalar(1.0)?;
        let accept = ctx.sampler.bernoulli(slot, &ratio)?;
        let resampled = ctx
            .sampler
            .sample_distribution(slot, &Distribution::residual(&p_rows, &q)?)?;
        let bonus = ctx
            .sampler
            .sample_distribution(slot, &p.slice_rows(k as i32, k as i32 + 1)?)?;
        let current = proposal.current.tokens.astype(Dtype::I32)?;
        Ok(Verdict {
            accept,
            resampled,
            bonus,
            current,
        })
    }

    /// A round's second half, given its [`Verdict`] and the target's hidden states
    /// `[1, k+1, H]` over [`Proposal::tokens`] (its caches advanced by them): read the verdict,
    /// rewind, emit.
    pub(crate) fn settle_round(
        &mut self,
        ctx: &mut Ctx<'_>,
        proposal: Proposal,
        verdict: Verdict,
        hidden: &Array,
    ) -> Result<usize> {
        let Proposal {
            dcat,
            k,
            mut state,
            s,
            ..
        } = proposal;
        let model: &DraftModel = match &ctx.draft {
            Some((m, _)) => m,
            None => return Err(GenerateError::BadRequest("no drafter".into())),
        };
        let slot = self.slot;
        let Verdict {
            accept,
            resampled,
            bonus,
            current: cur_flat,
        } = verdict;
        mlx::eval(&[&accept, &resampled, &bonus, &dcat, &cur_flat])?;
        let cur_id = cur_flat.to_vec::<i32>()?[0] as u32;
        let d: Vec<u32> = dcat
            .to_vec::<i32>()?
            .into_iter()
            .map(|t| t as u32)
            .collect();
        let acc = accept.to_vec::<bool>()?;
        let n = acc.iter().take_while(|&&a| a).count();
        let next = if n < k {
            resampled.to_vec::<i32>()?[n] as u32
        } else {
            bonus.to_vec::<i32>()?[0] as u32
        };
        // The grammar took in the pending token when the drafts were made; now the accepted
        // drafts (`next` is taken in when it is fed). Nothing after an EOS pending token: the
        // sequence ends at it.
        if self.params.constraint.is_some() && !self.params.eos.contains(&cur_id) {
            for &t in &d[..n] {
                if !self.grammar_take(t)? {
                    break;
                }
            }
        }

        // 4. Keep exactly [current, d1..dn] in the target; the drafter follows.
        for c in &mut self.caches {
            c.rewind(k - n)?;
        }
        self.fed.push(cur_id);
        self.fed.extend_from_slice(&d[..n]);
        let h_rows = hidden.slice_axis(1, 0, Some(n as i32 + 1))?;
        self.last_hidden = Some(hidden.slice_axis(1, n as i32, Some(n as i32 + 1))?);
        match model {
            DraftModel::Assistant(_) => {}
            DraftModel::Mtp => {
                // Step 1's pair (current, target hidden) was exact; later steps chained the
                // drafter's own hidden, so they are replaced by the verified target hiddens.
                latent(&mut state.caches)?.rewind(k - 1)?;
                state.fed = s;
                state.backlog = vec![h_rows];
            }
            DraftModel::Model(m) => {
                // The drafter holds current and d1..d(k-1); keep what was committed.
                let keep = s + k.min(n + 1);
                let excess = state.fed.saturating_sub(keep);
                let ok = state
                    .caches
                    .iter_mut()
                    .try_for_each(|c| c.rewind(excess))
                    .is_ok();
                if ok {
                    state.fed -= excess;
                } else {
                    // History past the window is gone: start the drafter over; it catches up
                    // with the committed tokens in one batch next round.
                    state.caches = m.make_caches();
                    state.fed = 0;
                }
            }
        }
        self.draft = Some(state);
        self.snapshot_generated();
        let mut commit: Vec<u32> = d[..n].to_vec();
        commit.push(next);
        ctx.sampler.commit(slot, &commit)?;
        self.stats.draft_tokens += k;
        self.stats.draft_accepted += n;
        self.rounds.push(RoundReport {
            depth: k,
            accepted: n,
        });

        // 5. Emit current and the accepted drafts; `next` becomes the pending token.
        for (i, &id) in std::iter::once(&cur_id).chain(&d[..n]).enumerate() {
            let e = self.emit(ctx, id, None);
            let done = matches!(e, Event::Done { .. });
            self.ready.push_back(e);
            if done {
                // Nothing after an EOS is kept.
                let extra = n - i;
                for c in &mut self.caches {
                    c.rewind(extra.min(c.offset()))?;
                }
                self.fed.truncate(s + i + 1);
                return Ok(n);
            }
        }
        if self.remaining() > 0 {
            let t = Array::from_slice(&[next as i32], &[1])?;
            self.pending = Some(Sampled {
                tokens: t,
                logprobs: None,
                top: None,
            });
        }
        Ok(n)
    }
}

/// A round's accept/reject decisions and replacement tokens, not yet read.
pub(crate) struct Verdict {
    /// `[k]` bool: draft `j` accepted (given the ones before it were).
    accept: Array,
    /// `[k]`: the token that replaces draft `j` if it is the first one rejected.
    resampled: Array,
    /// `[1]`: the token after a fully accepted block.
    bonus: Array,
    /// The pending token the drafts followed, as int32.
    current: Array,
}

impl Verdict {
    pub(crate) fn arrays(&self) -> [&Array; 4] {
        [&self.accept, &self.resampled, &self.bonus, &self.current]
    }
}

/// What a drafter takes in for one row of a lockstep pass: tokens `[1, l]` and, for GLM's MTP
/// layer and the assistant, the hidden states paired with them `[1, l, H]`.
struct Feed {
    tokens: Array,
    hidden: Option<Array>,
}

/// One lockstep pass of a drafter over the active rows (their states, in order): the packed
/// tokens and hiddens, each row's length; returns each row's logits at its last position
/// `[A, V]` and, for MTP and the assistant, the hidden outputs `[1, T, H]` the next position
/// pairs with. The last argument is the rows' indices among the round's drafting rows.
type Pass<'a> = dyn FnMut(
        &mut [&mut DraftState],
        &Array,
        Option<&Array>,
        &[usize],
        &[usize],
    ) -> Result<(Array, Option<Array>)>
    + 'a;

/// Drafts for several sequences in lockstep: each pass of the drafter runs once for every row
/// still drafting (`first[i]` is what row i takes in first, `depths[i]` its depth), then each
/// row's draft is drawn from its own distribution (its slot's options and key, penalties
/// extended by the drafts before it) and fed (with the pass's hidden output, for MTP and the
/// assistant) to the next pass. One sequence drafting alone is the one-row case. Returns the proposals, with the
/// rows' pending tokens `current`, drafter `states` and int32 pending tokens `curs`.
#[allow(clippy::too_many_arguments)]
fn lockstep(
    ctx: &mut Ctx<'_>,
    gens: &mut [&mut Generation],
    depths: &[usize],
    first: Vec<Feed>,
    current: Vec<Sampled>,
    mut states: Vec<DraftState>,
    curs: Vec<Array>,
    pass: &mut Pass<'_>,
) -> Result<Vec<Proposal>> {
    let n = gens.len();
    let mut drafts: Vec<Vec<Array>> = vec![Vec::new(); n];
    let mut qs: Vec<Vec<Distribution>> = (0..n).map(|_| Vec::new()).collect();
    let mut active: Vec<usize> = (0..n).collect();
    let mut feeds = first;
    // Structured output: a constrained row's drafts are drawn from distributions masked by its
    // grammar. The grammar takes in the pending token, then each draft as it is read (one read
    // per pass for all constrained rows), giving the mask of the next position: masks
    // `M1..M(k+1)`, which the verification applies to the target's rows too. The drafts are
    // undone at the end; the round takes in those it accepts.
    let mut masks: Vec<Option<Vec<grammar::Allowed>>> = vec![None; n];
    let mut taken = vec![0usize; n];
    let mut drafted_eos = vec![false; n];
    // A row whose grammar fails drafts on unmasked and fails alone when its round settles.
    let mut failed: Vec<Option<String>> = vec![None; n];
    for (i, g) in gens.iter_mut().enumerate() {
        if g.params.constraint.is_none() {
            continue;
        }
        let id = current[i].tokens.to_vec::<i32>()?[0] as u32;
        let start = g
            .grammar_take(id)
            .and_then(|took| Ok((took, g.grammar_allowed()?)));
        match start {
            Ok((took, m)) => {
                drafted_eos[i] = !took;
                masks[i] = m.map(|m| vec![m]);
            }
            Err(e) => failed[i] = Some(e.to_string()),
        }
    }
    for j in 0..depths.iter().copied().max().unwrap_or(0) {
        let lens: Vec<usize> = feeds.iter().map(|f| f.tokens.shape()[1] as usize).collect();
        let toks = mlx::concatenate(&feeds.iter().map(|f| &f.tokens).collect::<Vec<_>>(), 1)?;
        let hid = match feeds
            .iter()
            .map(|f| f.hidden.as_ref())
            .collect::<Option<Vec<_>>>()
        {
            Some(h) => Some(mlx::concatenate(&h, 1)?),
            None => None,
        };
        let (logits, u) = {
            let mut by_row: Vec<Option<&mut DraftState>> = states.iter_mut().map(Some).collect();
            let mut rows: Vec<&mut DraftState> = active
                .iter()
                .map(|&i| by_row[i].take().expect("a row once per pass"))
                .collect();
            pass(&mut rows, &toks, hid.as_ref(), &lens, &active)?
        };
        let logits = logits.astype(Dtype::F32)?;
        let mut next = (Vec::new(), Vec::new());
        let mut at = 0;
        let width = *logits.shape().last().unwrap_or(&0);
        for (a, &i) in active.iter().enumerate() {
            at += lens[a];
            let mut row = logits.slice_axis(0, a as i32, Some(a as i32 + 1))?;
            if let Some(m) = masks[i].as_ref().and_then(|m| m.last()) {
                let bias = Array::from_slice(&m.bias(width as usize), &[1, width])?;
                let masked = row.add(&bias)?;
                // A drafter whose own candidates are all forbidden (the assistant's sparse head)
                // drafts uniformly among the allowed tokens instead: a draft the grammar would
                // refuse must never be proposed.
                let dead = masked.max_all(false)?.isinf()?;
                row = mlx::where_(&dead, &bias, &masked)?;
            }
            let slot = gens[i].slot;
            let q = ctx
                .sampler
                .distribution(slot, &row, prefix(&drafts[i])?.as_ref())?;
            let d = ctx.sampler.sample_distribution(slot, &q)?;
            drafts[i].push(d.clone());
            qs[i].push(q);
            if j + 1 < depths[i] {
                next.0.push(i);
                next.1.push(Feed {
                    tokens: d.reshape(&[1, 1])?.astype(Dtype::I32)?,
                    hidden: match &u {
                        Some(u) => Some(u.slice_axis(1, at as i32 - 1, Some(at as i32))?),
                        None => None,
                    },
                });
            }
        }
        let constrained: Vec<usize> = active
            .iter()
            .copied()
            .filter(|&i| masks[i].is_some())
            .collect();
        if !constrained.is_empty() {
            let ds: Vec<&Array> = constrained.iter().map(|&i| &drafts[i][j]).collect();
            mlx::eval(&ds)?;
            for &i in &constrained {
                let id = drafts[i][j].to_vec::<i32>()?[0] as u32;
                // After a drafted EOS nothing more is taken in: the sequence would end there,
                // so later masks only need to be valid.
                let next_mask = (|| -> Result<Option<grammar::Allowed>> {
                    if !drafted_eos[i] {
                        if gens[i].grammar_take(id)? {
                            taken[i] += 1;
                        } else {
                            drafted_eos[i] = true;
                        }
                    }
                    if drafted_eos[i] {
                        Ok(masks[i].as_ref().and_then(|m| m.last().cloned()))
                    } else {
                        gens[i].grammar_allowed()
                    }
                })();
                match next_mask {
                    Ok(m) => {
                        if let (Some(ms), Some(m)) = (masks[i].as_mut(), m) {
                            ms.push(m);
                        }
                    }
                    Err(e) => {
                        failed[i] = Some(e.to_string());
                        masks[i] = None;
                    }
                }
            }
        }
        (active, feeds) = next;
        if active.is_empty() {
            break;
        }
    }
    for (i, g) in gens.iter_mut().enumerate() {
        if failed[i].is_none() {
            if let Err(e) = g.grammar_rollback(taken[i]) {
                failed[i] = Some(e.to_string());
            }
        }
    }
    let mut out = Vec::with_capacity(n);
    for (i, ((c, state), cur)) in current.into_iter().zip(states).zip(curs).enumerate() {
        let k = depths[i];
        let refs: Vec<&Array> = drafts[i].iter().collect();
        let dcat = mlx::concatenate(&refs, 0)?.astype(Dtype::I32)?;
        let tokens =
            mlx::concatenate(&[&cur.reshape(&[1])?, &dcat], 0)?.reshape(&[1, k as i32 + 1])?;
        out.push(Proposal {
            current: c,
            qs: std::mem::take(&mut qs[i]),
            dcat,
            tokens,
            k,
            state,
            s: gens[i].fed.len(),
            masks: masks[i].take(),
            failed: failed[i].take(),
        });
    }
    Ok(out)
}

/// Each row's pending token (taken), drafter state (taken) and the pending token as `[1, 1]`
/// int32.
fn take_rows(gens: &mut [&mut Generation]) -> Result<(Vec<Sampled>, Vec<DraftState>, Vec<Array>)> {
    let mut out = (Vec::new(), Vec::new(), Vec::new());
    for g in gens.iter_mut() {
        let (Some(c), Some(state)) = (g.pending.take(), g.draft.take()) else {
            return Err(GenerateError::BadRequest(
                "a speculative round needs a pending token and a drafter state".into(),
            ));
        };
        out.2.push(c.tokens.reshape(&[1, 1])?.astype(Dtype::I32)?);
        out.0.push(c);
        out.1.push(state);
    }
    Ok(out)
}

/// Proposals of several sequences that draft with a separate model, in lockstep
/// ([`lockstep`]): the drafter's passes (catching up with the committed tokens and the pending
/// one, then one draft position after another) are packed across rows as the target's are
/// ([`CausalLm::forward_packed`]), its head runs once per pass.
pub(crate) fn propose_together(
    ctx: &mut Ctx<'_>,
    gens: &mut [&mut Generation],
    depths: &[usize],
) -> Result<Vec<Proposal>> {
    let m: &dyn CausalLm = match &ctx.draft {
        Some((DraftModel::Model(m), _)) => &**m,
        _ => {
            return Err(GenerateError::BadRequest(
                "lockstep drafting needs a separate draft model".into(),
            ))
        }
    };
    let (current, states, curs) = take_rows(gens)?;
    let mut first = Vec::with_capacity(gens.len());
    for ((g, state), cur) in gens.iter().zip(&states).zip(&curs) {
        let mut parts = Vec::new();
        if state.fed < g.fed.len() {
            parts.push(tokens_array(&g.fed[state.fed..])?);
        }
        parts.push(cur.clone());
        let refs: Vec<&Array> = parts.iter().collect();
        first.push(Feed {
            tokens: mlx::concatenate(&refs, 1)?,
            hidden: None,
        });
    }
    // The last draft of each row is sampled but not fed: the drafter holds the pending token
    // and d1..d(k-1); the round settles its cache to the committed tokens.
    let mut pass = |rows: &mut [&mut DraftState],
                    toks: &Array,
                    _: Option<&Array>,
                    lens: &[usize],
                    _: &[usize]| {
        let mut packed: Vec<models::PackedRow<'_>> = rows
            .iter_mut()
            .zip(lens)
            .map(|(st, &len)| models::PackedRow {
                len,
                caches: &mut st.caches,
            })
            .collect();
        let hidden = m.forward_packed(toks, &mut packed)?;
        drop(packed);
        for (st, &l) in rows.iter_mut().zip(lens) {
            st.fed += l;
        }
        let ends = last_positions(lens);
        let last = hidden.take(&Array::from_slice(&ends, &[ends.len() as i32])?, 1)?;
        let logits = m.logits(&last)?;
        let v = *logits.shape().last().unwrap_or(&0);
        Ok((logits.reshape(&[lens.len() as i32, v])?, None))
    };
    lockstep(ctx, gens, depths, first, current, states, curs, &mut pass)
}

/// Each row's last position in a packed pass of rows of these lengths.
fn last_positions(lens: &[usize]) -> Vec<i32> {
    let mut at = 0;
    lens.iter()
        .map(|&l| {
            at += l;
            at as i32 - 1
        })
        .collect()
}

/// Proposals of several sequences that draft with GLM's MTP layer, in lockstep ([`lockstep`]):
/// each pass (a row's catch-up pairs and its first draft position, then one draft position
/// after another) runs once for all rows, packed, its head once per pass.
pub(crate) fn propose_mtp_together(
    ctx: &mut Ctx<'_>,
    gens: &mut [&mut Generation],
    depths: &[usize],
) -> Result<Vec<Proposal>> {
    let (mtp, rope) = mtp_parts(ctx.model)?;
    let (current, mut states, curs) = take_rows(gens)?;
    let mut first = Vec::with_capacity(gens.len());
    for ((g, state), cur) in gens.iter().zip(&mut states).zip(&curs) {
        let h_prev = g.last_hidden.clone().ok_or_else(|| {
            GenerateError::BadRequest("a speculative round needs a hidden state".into())
        })?;
        // The pairs the layer has not taken in yet (as `catch_up_mtp`), then (pending, h_prev).
        let s = g.fed.len();
        let (mut t, mut h) = (vec![cur.clone()], vec![h_prev.reshape(&[1, 1, -1])?]);
        if state.fed + 1 < s && !state.backlog.is_empty() {
            let refs: Vec<&Array> = state.backlog.iter().collect();
            let mut hidden = mlx::concatenate(&refs, 1)?;
            if hidden.shape()[1] as usize > s - state.fed {
                hidden = hidden.slice_axis(1, 0, Some((s - state.fed) as i32))?;
            }
            let pairs = s - 1 - state.fed;
            t.insert(0, tokens_array(&g.fed[state.fed + 1..s])?);
            h.insert(0, hidden.slice_axis(1, 0, Some(pairs as i32))?);
            state.backlog = vec![hidden.slice_axis(1, pairs as i32, None)?];
            state.fed = s - 1;
        }
        first.push(Feed {
            tokens: mlx::concatenate(&t.iter().collect::<Vec<_>>(), 1)?,
            hidden: Some(mlx::concatenate(&h.iter().collect::<Vec<_>>(), 1)?),
        });
    }
    let mut pass = |rows: &mut [&mut DraftState],
                    toks: &Array,
                    hid: Option<&Array>,
                    lens: &[usize],
                    _: &[usize]| {
        let hid = hid.ok_or_else(|| {
            GenerateError::BadRequest("the MTP layer pairs every token with a hidden".into())
        })?;
        let mut caches = rows
            .iter_mut()
            .map(|st| latent(&mut st.caches))
            .collect::<Result<Vec<&mut LatentCache>>>()?;
        let (u, logits) = mtp.forward_rows(toks, hid, &mut caches, lens, rope)?;
        Ok((logits, Some(u)))
    };
    lockstep(ctx, gens, depths, first, current, states, curs, &mut pass)
}

/// Proposals of several sequences that draft with the gemma4 assistant, in lockstep
/// ([`lockstep`]): each pass is one assistant step for every row still drafting, each row
/// attending to its own target's K/V ([`Gemma4Assistant::step_rows`]).
pub(crate) fn propose_assistant_together(
    ctx: &mut Ctx<'_>,
    gens: &mut [&mut Generation],
    depths: &[usize],
) -> Result<Vec<Proposal>> {
    let a: &Gemma4Assistant = match &ctx.draft {
        Some((DraftModel::Assistant(a), _)) => a,
        _ => {
            return Err(GenerateError::BadRequest(
                "lockstep drafting needs the assistant".into(),
            ))
        }
    };
    let gemma =
        ctx.model.as_any().downcast_ref::<Gemma4>().ok_or_else(|| {
            GenerateError::BadRequest("the assistant needs a gemma4 target".into())
        })?;
    let kvs = gens
        .iter()
        .map(|g| gemma.shared_kv(&g.caches))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let (current, states, curs) = take_rows(gens)?;
    let mut first = Vec::with_capacity(gens.len());
    for (g, cur) in gens.iter().zip(&curs) {
        let h_prev = g.last_hidden.clone().ok_or_else(|| {
            GenerateError::BadRequest("a speculative round needs a hidden state".into())
        })?;
        first.push(Feed {
            tokens: cur.clone(),
            hidden: Some(h_prev.reshape(&[1, 1, -1])?),
        });
    }
    let mut pass = |_: &mut [&mut DraftState],
                    toks: &Array,
                    hid: Option<&Array>,
                    _: &[usize],
                    active: &[usize]| {
        let hid = hid.ok_or_else(|| {
            GenerateError::BadRequest("the assistant takes a hidden state with each token".into())
        })?;
        let rows: Vec<&SharedKv> = active.iter().map(|&i| &kvs[i]).collect();
        let out = a.step_rows(gemma, toks, hid, &rows)?;
        Ok((out.logits, Some(out.hidden)))
    };
    lockstep(ctx, gens, depths, first, current, states, curs, &mut pass)
}
