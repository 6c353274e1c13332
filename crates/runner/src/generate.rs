//! One sequence's generation on the engine thread: chunked prefill, then a pipelined decode
//! loop in which the next step's graph is built and dispatched (async eval) before the previous
//! token is read back, so the device never waits on the host.
//!
//! A [`Generation`] holds only per-sequence state; the model and sampler are passed into each
//! call (the engine owns them), so one engine can interleave many sequences. It deals in token
//! ids only: text (detokenisation, stop strings, logprob token strings) is [`crate::text`]'s
//! job, off the engine thread.

use crate::protocol::{DoneReason, Stats};
use cache::prefix::CacheCheckpoint;
use cache::LayerCache;
use mlx::{Array, Ix};
use models::CausalLm;
use sample::{Options, Sampled, Sampler};
use std::time::Instant;

#[derive(Debug, thiserror::Error)]
pub enum GenerateError {
    /// The request cannot be served as asked (answer 400).
    #[error("{0}")]
    BadRequest(String),
    #[error(transparent)]
    Model(#[from] models::ModelError),
    #[error(transparent)]
    Sample(#[from] sample::SampleError),
    #[error(transparent)]
    Mlx(#[from] mlx::Error),
}

pub type Result<T> = std::result::Result<T, GenerateError>;

/// What to generate.
#[derive(Debug, Clone)]
pub struct GenerationParams {
    pub prompt: Vec<u32>,
    pub options: Options,
    /// `None`: until EOS, a stop string or the context limit.
    pub num_predict: Option<usize>,
    /// Positions this sequence may use (prompt plus generated tokens).
    pub num_ctx: usize,
    /// Tokens per prefill forward pass.
    pub prefill_chunk: usize,
    /// Token ids that end generation (not emitted).
    pub eos: Vec<u32>,
    /// Prompt positions at which to snapshot the rotating caches during prefill (for the prefix
    /// cache; empty when the model has none).
    pub checkpoints: Vec<usize>,
}

/// The borrowed pieces a generation runs on.
pub struct Ctx<'a> {
    pub model: &'a dyn CausalLm,
    pub sampler: &'a mut Sampler,
}

/// A token's logprob and the most likely alternatives, as ids (text is added off-engine).
#[derive(Debug, Clone, PartialEq)]
pub struct RawLogprob {
    pub logprob: f32,
    /// Sorted by logprob, descending.
    pub top: Vec<(u32, f32)>,
}

/// One step's outcome.
#[derive(Debug, Clone)]
pub enum Event {
    Token {
        id: u32,
        logprob: Option<RawLogprob>,
    },
    /// Generation ended: EOS (`Stop`), a limit (`Length`) or cancellation.
    Done { reason: DoneReason, stats: Stats },
}

pub struct Generation {
    slot: usize,
    caches: Vec<LayerCache>,
    /// Tokens fed through the model so far (the caches hold exactly these).
    fed: Vec<u32>,
    /// Next prompt position to prefill.
    prefilled: usize,
    generated: usize,
    params: GenerationParams,
    pending: Option<Sampled>,
    started: Instant,
    first_token_at: Option<Instant>,
    stats: Stats,
    finished: bool,
    /// Snapshots taken during prefill, by position.
    taken: Vec<(usize, CacheCheckpoint)>,
}

fn tokens_array(ids: &[u32]) -> Result<Array> {
    let v: Vec<i32> = ids.iter().map(|&t| t as i32).collect();
    Ok(Array::from_slice(&v, &[1, v.len() as i32])?)
}

impl Generation {
    /// Registers the sequence with fresh caches. Prefill happens in [`Generation::step`], a
    /// chunk per call, so an engine can interleave it with other sequences' decoding.
    pub fn new(ctx: &mut Ctx<'_>, slot: usize, params: GenerationParams) -> Result<Generation> {
        let caches = ctx.model.make_caches();
        Self::with_caches(ctx, slot, params, caches, 0)
    }

    /// As [`Generation::new`], with caches that already hold the first `cached` prompt tokens
    /// (a prefix-cache hit); at least the last prompt token is always evaluated.
    pub fn with_caches(
        ctx: &mut Ctx<'_>,
        slot: usize,
        params: GenerationParams,
        caches: Vec<LayerCache>,
        cached: usize,
    ) -> Result<Generation> {
        let n = params.prompt.len();
        if n == 0 {
            return Err(GenerateError::BadRequest("prompt is empty".into()));
        }
        if n >= params.num_ctx {
            return Err(GenerateError::BadRequest(format!(
                "prompt of {n} tokens does not fit the context of {} tokens",
                params.num_ctx
            )));
        }
        if cached >= n {
            return Err(GenerateError::BadRequest(
                "a cached prefix must leave a token to evaluate".into(),
            ));
        }
        ctx.sampler.add(slot, &params.options, &params.prompt)?;
        Ok(Generation {
            slot,
            caches,
            fed: params.prompt[..cached].to_vec(),
            prefilled: cached,
            generated: 0,
            pending: None,
            started: Instant::now(),
            first_token_at: None,
            stats: Stats {
                prompt_eval_count: n,
                cached_tokens: cached,
                ..Stats::default()
            },
            finished: false,
            taken: Vec::new(),
            params,
        })
    }

    /// Runs the next prefill chunk; the last one samples and dispatches the first token.
    fn prefill_chunk(&mut self, ctx: &mut Ctx<'_>) -> Result<()> {
        let prompt = &self.params.prompt;
        let at = self.prefilled;
        let mut end = (at + self.params.prefill_chunk.max(1)).min(prompt.len());
        // Chunks end where a snapshot is due.
        if let Some(&cp) = self.params.checkpoints.iter().find(|&&p| p > at && p < end) {
            end = cp;
        }
        let hidden = ctx
            .model
            .forward(&tokens_array(&prompt[at..end])?, &mut self.caches)?;
        self.fed.extend_from_slice(&prompt[at..end]);
        self.prefilled = end;
        if self.params.checkpoints.contains(&end) {
            self.taken.push((end, CacheCheckpoint::of(&self.caches)));
        }
        if end < prompt.len() {
            // Materialise this chunk's cache writes before building the next chunk's graph.
            hidden.eval()?;
        } else {
            let last = hidden.index(&[Ix::full(), Ix::slice(Some(-1), None, 1)])?;
            self.dispatch(ctx, &last)?;
        }
        Ok(())
    }

    /// Samples from the hidden state of the last position and starts evaluating it.
    fn dispatch(&mut self, ctx: &mut Ctx<'_>, last_hidden: &Array) -> Result<()> {
        let logits = ctx.model.logits(last_hidden)?;
        let v = logits.shape();
        let logits = logits.reshape(&[1, v[v.len() - 1]])?;
        let s = ctx.sampler.sample(&[self.slot], &logits)?;
        let mut outs: Vec<&Array> = vec![&s.tokens];
        if let Some(l) = &s.logprobs {
            outs.push(l);
        }
        if let Some(t) = &s.top {
            outs.push(&t.ids);
            outs.push(&t.logprobs);
        }
        mlx::async_eval(&outs)?;
        self.pending = Some(s);
        Ok(())
    }

    /// The caches, the tokens they hold and the snapshots taken on the way (for the prefix
    /// cache once the sequence ends).
    pub fn into_parts(self) -> (Vec<LayerCache>, Vec<u32>, Vec<(usize, CacheCheckpoint)>) {
        (self.caches, self.fed, self.taken)
    }

    pub fn slot(&self) -> usize {
        self.slot
    }

    pub fn is_finished(&self) -> bool {
        self.finished
    }

    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    /// Whether the prompt is still being prefilled.
    pub fn prefilling(&self) -> bool {
        self.prefilled < self.params.prompt.len()
    }

    /// Whether one more token may be fed after the one now pending.
    fn may_continue(&self) -> bool {
        let under_limit = self
            .params
            .num_predict
            .is_none_or(|n| self.generated + 1 < n);
        // The pending token sits at position fed.len(); feeding it needs that position.
        under_limit && self.fed.len() + 1 < self.params.num_ctx
    }

    fn logprob(&self, s: &Sampled) -> Result<Option<RawLogprob>> {
        let Some(lp) = &s.logprobs else {
            return Ok(None);
        };
        let logprob = lp.to_vec::<f32>()?[0];
        let want = self.params.options.top_logprobs.max(0) as usize;
        let mut top = Vec::new();
        if let (Some(t), true) = (&s.top, want > 0) {
            let ids = t.ids.to_vec::<i32>()?;
            let vals = t.logprobs.to_vec::<f32>()?;
            top = ids.into_iter().map(|i| i as u32).zip(vals).collect();
            top.sort_by(|a, b| b.1.total_cmp(&a.1));
            top.truncate(want);
        }
        Ok(Some(RawLogprob { logprob, top }))
    }

    /// Does the next piece of work: a prefill chunk (returns `None`), or reads the pending token
    /// after dispatching its successor (returns it, or the end). After `Done` the sampler slot
    /// is released and further calls return `None`.
    pub fn step(&mut self, ctx: &mut Ctx<'_>) -> Result<Option<Event>> {
        if self.finished {
            return Ok(None);
        }
        if self.prefilling() {
            self.prefill_chunk(ctx)?;
            return Ok(None);
        }
        let Some(current) = self.pending.take() else {
            // The previous token was the last one a limit allowed.
            return Ok(Some(self.finish(ctx, DoneReason::Length)));
        };
        // Dispatch the next step before reading the current token (the lazy token feeds
        // straight back into the model), unless a limit already forbids another token.
        let continues = self.may_continue();
        if continues {
            let hidden = ctx
                .model
                .forward(&current.tokens.reshape(&[1, 1])?, &mut self.caches)?;
            self.dispatch(ctx, &hidden)?;
        }
        let id = current.tokens.to_vec::<i32>()?[0] as u32;
        if continues {
            self.fed.push(id);
        }
        if self.first_token_at.is_none() {
            let now = Instant::now();
            self.stats.prompt_eval_ns = (now - self.started).as_nanos() as u64;
            self.first_token_at = Some(now);
        }
        self.generated += 1;
        self.stats.eval_count = self.generated;
        if self.params.eos.contains(&id) {
            return Ok(Some(self.finish(ctx, DoneReason::Stop)));
        }
        let logprob = self.logprob(&current)?;
        Ok(Some(Event::Token { id, logprob }))
    }

    fn finish(&mut self, ctx: &mut Ctx<'_>, reason: DoneReason) -> Event {
        self.finished = true;
        self.pending = None;
        let _ = ctx.sampler.remove(self.slot);
        if let Some(t) = self.first_token_at {
            self.stats.eval_ns = t.elapsed().as_nanos() as u64;
        }
        Event::Done {
            reason,
            stats: self.stats.clone(),
        }
    }

    /// Ends early (the client went away, or a stop string was seen off-engine).
    pub fn cancel(&mut self, ctx: &mut Ctx<'_>) -> Event {
        // A dispatched but unread token may still be computing; wait for it so no graph
        // outlives the caches it writes.
        if let Some(p) = &self.pending {
            let _ = p.tokens.eval();
        }
        self.finish(ctx, DoneReason::ConnectionClosed)
    }

    /// Runs to the end without interruption, handing each event to `f` (the CLI's loop).
    pub fn run(&mut self, ctx: &mut Ctx<'_>, mut f: impl FnMut(&Event) -> bool) -> Result<()> {
        while !self.finished {
            if let Some(e) = self.step(ctx)? {
                if !f(&e) && !self.finished {
                    let e = self.cancel(ctx);
                    f(&e);
                }
            }
        }
        Ok(())
    }
}
