//! One sequence's generation: chunked prefill, then a pipelined decode loop in which the next
//! step's graph is built and dispatched (async eval) before the previous token is read back, so
//! the device never waits on the host. Text comes out at UTF-8 boundaries with stop strings held
//! back and never emitted.
//!
//! A [`Generation`] holds only per-sequence state; the model, tokenizer and sampler are passed
//! into each call (the engine owns them), so one engine can drive many sequences.

use crate::protocol::{DoneReason, Stats, TokenLogprob, TopLogprob};
use crate::stop::{StopMatcher, StopOutcome};
use cache::LayerCache;
use mlx::{Array, Ix};
use models::{CausalLm, StreamDecoder, Tokenizer};
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
    pub stop: Vec<String>,
    /// Tokens per prefill forward pass.
    pub prefill_chunk: usize,
}

/// The borrowed pieces a generation runs on.
pub struct Ctx<'a> {
    pub model: &'a dyn CausalLm,
    pub tokenizer: &'a Tokenizer,
    pub sampler: &'a mut Sampler,
}

/// One step's outcome.
#[derive(Debug, Clone)]
pub enum Event {
    /// A token was generated; `text` is what became final with it (often empty while a
    /// character or a possible stop string is incomplete).
    Token {
        id: u32,
        text: String,
        logprob: Option<TokenLogprob>,
    },
    /// Generation ended; `text` is what was still held back (never part of a stop string).
    Done {
        reason: DoneReason,
        text: String,
        stats: Stats,
    },
}

pub struct Generation {
    slot: usize,
    caches: Vec<LayerCache>,
    /// Tokens fed through the model so far (the caches hold exactly these).
    fed: Vec<u32>,
    generated: usize,
    params: GenerationParams,
    pending: Option<Sampled>,
    eos: Vec<u32>,
    decoder: StreamDecoder,
    stops: StopMatcher,
    started: Instant,
    first_token_at: Option<Instant>,
    stats: Stats,
    finished: bool,
}

fn tokens_array(ids: &[u32]) -> Result<Array> {
    let v: Vec<i32> = ids.iter().map(|&t| t as i32).collect();
    Ok(Array::from_slice(&v, &[1, v.len() as i32])?)
}

impl Generation {
    /// Prefills the prompt through fresh caches and dispatches the first token. `slot` is the
    /// sampler slot this sequence registers under.
    pub fn start(ctx: &mut Ctx<'_>, slot: usize, params: GenerationParams) -> Result<Generation> {
        let caches = ctx.model.make_caches();
        Self::start_with(ctx, slot, params, caches, 0)
    }

    /// As [`Generation::start`], with caches that already hold the first `cached` prompt
    /// tokens (a prefix-cache hit); at least the last prompt token is always evaluated.
    pub fn start_with(
        ctx: &mut Ctx<'_>,
        slot: usize,
        params: GenerationParams,
        caches: Vec<LayerCache>,
        cached: usize,
    ) -> Result<Generation> {
        let started = Instant::now();
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
        let mut g = Generation {
            slot,
            caches,
            fed: params.prompt[..cached].to_vec(),
            generated: 0,
            pending: None,
            eos: ctx.tokenizer.eos_ids().to_vec(),
            decoder: StreamDecoder::new(),
            stops: StopMatcher::new(&params.stop),
            started,
            first_token_at: None,
            stats: Stats {
                prompt_eval_count: n,
                cached_tokens: cached,
                ..Stats::default()
            },
            finished: false,
            params,
        };
        match g.prefill(ctx, cached) {
            Ok(()) => Ok(g),
            Err(e) => {
                let _ = ctx.sampler.remove(slot);
                Err(e)
            }
        }
    }

    fn prefill(&mut self, ctx: &mut Ctx<'_>, cached: usize) -> Result<()> {
        let prompt = self.params.prompt.clone();
        let chunk = self.params.prefill_chunk.max(1);
        let mut at = cached;
        while at < prompt.len() {
            let end = (at + chunk).min(prompt.len());
            let hidden = ctx
                .model
                .forward(&tokens_array(&prompt[at..end])?, &mut self.caches)?;
            self.fed.extend_from_slice(&prompt[at..end]);
            at = end;
            if at < prompt.len() {
                // Materialise this chunk's cache writes before building the next chunk's graph.
                hidden.eval()?;
            } else {
                let last = hidden.index(&[Ix::full(), Ix::slice(Some(-1), None, 1)])?;
                self.dispatch(ctx, &last)?;
            }
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

    /// The caches and the tokens they hold (for the prefix cache once the sequence ends).
    pub fn into_parts(self) -> (Vec<LayerCache>, Vec<u32>) {
        (self.caches, self.fed)
    }

    pub fn slot(&self) -> usize {
        self.slot
    }

    pub fn is_finished(&self) -> bool {
        self.finished
    }

    /// Whether one more token may be fed after the one now pending.
    fn may_continue(&self) -> bool {
        let under_limit = self
            .params
            .num_predict
            .is_none_or(|n| self.generated + 1 < n);
        // The pending token sits at position fed.len(); feeding it needs that slot.
        under_limit && self.fed.len() + 1 < self.params.num_ctx
    }

    fn logprob(&self, tok: &Tokenizer, s: &Sampled, id: u32) -> Result<Option<TokenLogprob>> {
        let Some(lp) = &s.logprobs else {
            return Ok(None);
        };
        let logprob = lp.to_vec::<f32>()?[0];
        let want = self.params.options.top_logprobs.max(0) as usize;
        let mut top = Vec::new();
        if let (Some(t), true) = (&s.top, want > 0) {
            let ids = t.ids.to_vec::<i32>()?;
            let vals = t.logprobs.to_vec::<f32>()?;
            let mut pairs: Vec<(i32, f32)> = ids.into_iter().zip(vals).collect();
            pairs.sort_by(|a, b| b.1.total_cmp(&a.1));
            top = pairs
                .into_iter()
                .take(want)
                .map(|(i, l)| TopLogprob {
                    token: tok.token_text(i as u32),
                    logprob: l,
                })
                .collect();
        }
        Ok(Some(TokenLogprob {
            token: tok.token_text(id),
            logprob,
            top_logprobs: top,
        }))
    }

    /// Produces the next event: a token, or the end. After `Done` the sequence's sampler slot
    /// is released and further calls return `None`.
    pub fn step(&mut self, ctx: &mut Ctx<'_>) -> Result<Option<Event>> {
        if self.finished {
            return Ok(None);
        }
        let Some(current) = self.pending.take() else {
            // The previous token was the last one a limit allowed.
            return Ok(Some(self.finish_flushed(ctx, DoneReason::Length)?));
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
        if self.eos.contains(&id) {
            return Ok(Some(self.finish_flushed(ctx, DoneReason::Stop)?));
        }
        let logprob = self.logprob(ctx.tokenizer, &current, id)?;
        let piece = self.decoder.push(ctx.tokenizer, id)?;
        Ok(Some(match self.stops.push(&piece) {
            StopOutcome::Stopped(text) => self.finish(ctx, DoneReason::Stop, text),
            StopOutcome::Emit(text) => Event::Token { id, text, logprob },
        }))
    }

    /// Ends with whatever text is still held back (an incomplete character, a partial stop
    /// string that can no longer complete).
    fn finish_flushed(&mut self, ctx: &mut Ctx<'_>, reason: DoneReason) -> Result<Event> {
        let tail = self.decoder.flush(ctx.tokenizer)?;
        Ok(match self.stops.push(&tail) {
            StopOutcome::Stopped(text) => self.finish(ctx, DoneReason::Stop, text),
            StopOutcome::Emit(text) => {
                let text = text + &self.stops.finish();
                self.finish(ctx, reason, text)
            }
        })
    }

    fn finish(&mut self, ctx: &mut Ctx<'_>, reason: DoneReason, text: String) -> Event {
        self.finished = true;
        self.pending = None;
        let _ = ctx.sampler.remove(self.slot);
        if let Some(t) = self.first_token_at {
            self.stats.eval_ns = t.elapsed().as_nanos() as u64;
        }
        Event::Done {
            reason,
            text,
            stats: self.stats.clone(),
        }
    }

    /// Stops early (the client went away): releases the sampler slot.
    pub fn cancel(&mut self, ctx: &mut Ctx<'_>) -> Event {
        self.finish(ctx, DoneReason::ConnectionClosed, String::new())
    }
}
