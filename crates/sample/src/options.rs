//! Sampling options as a request carries them (PROTOCOL.md), their validation and the
//! normalisation ollama applies (OLLAMA_RUNNER_REFERENCE.md §6.2).

use serde::Deserialize;

/// What is wrong with a slot's options or a call.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SampleError {
    #[error("{0}")]
    Invalid(String),
    #[error("slot {0} is not registered")]
    UnknownSlot(usize),
    #[error("slot {0} is already registered")]
    DuplicateSlot(usize),
    #[error(transparent)]
    Mlx(#[from] MlxError),
}

/// MLX errors, kept comparable for tests.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{0}")]
pub struct MlxError(pub String);

impl From<mlx::Error> for SampleError {
    fn from(e: mlx::Error) -> Self {
        SampleError::Mlx(MlxError(e.to_string()))
    }
}

pub type Result<T> = std::result::Result<T, SampleError>;

/// Per-request sampling options. Field names and defaults are ollama's.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default)]
pub struct Options {
    /// ≤ 0 means greedy.
    pub temperature: f32,
    /// 0 disables top-k.
    pub top_k: i32,
    /// 1 (or 0) disables top-p.
    pub top_p: f32,
    /// 0 disables min-p.
    pub min_p: f32,
    /// History window for the penalties; -1 means the whole context, 0 disables penalties.
    pub repeat_last_n: i32,
    pub repeat_penalty: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// ≥ 0 makes the slot's draws reproducible.
    pub seed: i64,
    /// Return the chosen token's logprob.
    #[serde(skip)]
    pub logprobs: bool,
    /// How many most likely alternatives to return with it (0..=20).
    #[serde(skip)]
    pub top_logprobs: i32,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.9,
            min_p: 0.0,
            repeat_last_n: 64,
            repeat_penalty: 1.1,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: -1,
            logprobs: false,
            top_logprobs: 0,
        }
    }
}

/// The most alternatives a request may ask for.
pub const MAX_TOP_LOGPROBS: i32 = 20;

impl Options {
    /// Greedy decoding with no penalties.
    pub fn greedy() -> Options {
        Options {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            repeat_last_n: 0,
            repeat_penalty: 1.0,
            ..Options::default()
        }
    }

    /// Rejects what no normalisation can make sense of, naming the option: a value that is not
    /// a finite number, or more alternatives than a request may ask for. Everything else that is
    /// out of range is normalised as ollama's sampler does (see [`Options::normalized`]).
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(SampleError::Invalid(m));
        for (name, v) in [
            ("temperature", self.temperature),
            ("top_p", self.top_p),
            ("min_p", self.min_p),
            ("repeat_penalty", self.repeat_penalty),
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !v.is_finite() {
                return bad(format!("{name} must be a finite number, got {v}"));
            }
        }
        if !(0..=MAX_TOP_LOGPROBS).contains(&self.top_logprobs) {
            return bad(format!(
                "top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {}",
                self.top_logprobs
            ));
        }
        Ok(())
    }

    /// The options as the pipeline applies them, following ollama's `Options.normalize` and
    /// its filters: a non-positive repeat penalty is neutral; a negative `repeat_last_n` means
    /// the whole context and no window is wider than the context (a window is memory: it is
    /// never allowed to exceed what a sequence can hold); the window is zero whenever no penalty
    /// would change anything (so such slots batch with each other); a negative temperature is
    /// greedy; `top_k` ≤ 0, `top_p` outside (0, 1) and `min_p` outside (0, 1] turn that filter
    /// off.
    pub fn normalized(&self, num_ctx: usize) -> Options {
        let mut o = self.clone();
        let ctx = num_ctx.min(i32::MAX as usize) as i32;
        if o.repeat_penalty <= 0.0 {
            o.repeat_penalty = 1.0;
        }
        if o.repeat_last_n < 0 || o.repeat_last_n > ctx {
            o.repeat_last_n = ctx;
        }
        let neutral =
            o.repeat_penalty == 1.0 && o.presence_penalty == 0.0 && o.frequency_penalty == 0.0;
        if neutral || o.repeat_last_n == 0 {
            o.repeat_last_n = 0;
            o.repeat_penalty = 1.0;
            o.presence_penalty = 0.0;
            o.frequency_penalty = 0.0;
        }
        if o.top_k < 0 {
            o.top_k = 0;
        }
        if o.top_p <= 0.0 || o.top_p >= 1.0 {
            o.top_p = 1.0;
        }
        if o.min_p <= 0.0 || o.min_p > 1.0 {
            o.min_p = 0.0;
        }
        if o.temperature <= 0.0 {
            // Greedy ignores the truncations; keep them out of the batching key.
            o.temperature = 0.0;
            o.top_k = 0;
            o.top_p = 1.0;
            o.min_p = 0.0;
        }
        o
    }

    /// Whether draws from these options are reproducible: a seed was given and the slot
    /// samples (greedy decoding never draws).
    pub fn seeded_sampling(&self) -> bool {
        self.seed >= 0 && self.temperature > 0.0
    }

    pub(crate) fn window(&self) -> usize {
        self.repeat_last_n.max(0) as usize
    }

    /// Whether two normalized option sets run through the pipeline identically (so their rows
    /// can share one fused pass). Seeds, logprob requests and the window length do not matter:
    /// each row brings its own history.
    pub(crate) fn same_pipeline(&self, other: &Options) -> bool {
        self.temperature == other.temperature
            && self.top_k == other.top_k
            && self.top_p == other.top_p
            && self.min_p == other.min_p
            && self.repeat_penalty == other.repeat_penalty
            && self.presence_penalty == other.presence_penalty
            && self.frequency_penalty == other.frequency_penalty
    }
}
