//! The sampling options, declared once.
//!
//! The table in [`options!`]'s call below is the one place an option is named: it generates
//! the options' struct, which the runner's request reads (Go's zero value for what it leaves
//! out) and the sampler applies; the options' keys and types, which `serve` type-checks and
//! forwards; and ollama's defaults, which `serve` starts from. Adding an option is a row here
//! and its transform in the sampler's pipeline. Validation and the normalisation ollama applies
//! before sampling live here too.

use serde::{Deserialize, Serialize};

/// An option's JSON type, as ollama's `api.Options.FromMap` checks it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Int,
    Float,
    Bool,
    Text,
    Strings,
}

/// An option's Rust type: its [`Kind`], and its value as a number (for validation).
pub trait OptionType: Copy {
    const KIND: Kind;
    fn number(self) -> f64;
}

impl OptionType for i32 {
    const KIND: Kind = Kind::Int;
    fn number(self) -> f64 {
        f64::from(self)
    }
}

impl OptionType for i64 {
    const KIND: Kind = Kind::Int;
    fn number(self) -> f64 {
        self as f64
    }
}

impl OptionType for f32 {
    const KIND: Kind = Kind::Float;
    fn number(self) -> f64 {
        f64::from(self)
    }
}

macro_rules! options {
    ($( $(#[doc = $doc:literal])* $name:ident: $ty:ty = $ollama:expr; )*) => {
        /// Per-request sampling options, named and typed as ollama's `api.Options`.
        #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
        #[serde(default = "Options::zero")]
        pub struct Options {
            $( $(#[doc = $doc])* pub $name: $ty, )*
            /// Return the chosen token's logprob (a field of the request, not an option).
            #[serde(skip)]
            pub logprobs: bool,
            /// How many most likely alternatives to return with it (0..=20).
            #[serde(skip)]
            pub top_logprobs: i32,
        }

        impl Options {
            /// ollama's defaults (`api.DefaultOptions`).
            pub fn ollama() -> Options {
                Options {
                    $( $name: $ollama, )*
                    logprobs: false,
                    top_logprobs: 0,
                }
            }

            /// Every option at Go's zero value: what a request that sends none of them means
            /// (ollama's parent leaves zero values out).
            pub fn zero() -> Options {
                Options {
                    $( $name: Default::default(), )*
                    logprobs: false,
                    top_logprobs: 0,
                }
            }

            /// Every option's key and value, as a number.
            pub fn values(&self) -> Vec<(&'static str, f64)> {
                vec![ $( (stringify!($name), OptionType::number(self.$name)), )* ]
            }
        }

        /// Every option's key as requests spell it, with its type.
        pub const KEYS: &[(&str, Kind)] = &[ $( (stringify!($name), <$ty as OptionType>::KIND), )* ];
    };
}

options! {
    /// ≤ 0 means greedy.
    temperature: f32 = 0.8;
    /// 0 disables top-k.
    top_k: i32 = 40;
    /// 1 (or 0) disables top-p.
    top_p: f32 = 0.9;
    /// 0 disables min-p.
    min_p: f32 = 0.0;
    /// History window for the penalties; -1 means the whole context, 0 disables penalties.
    repeat_last_n: i32 = 64;
    repeat_penalty: f32 = 1.0;
    presence_penalty: f32 = 0.0;
    frequency_penalty: f32 = 0.0;
    /// ≥ 0 makes the slot's draws reproducible.
    seed: i64 = -1;
}

impl Default for Options {
    fn default() -> Self {
        Options::ollama()
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
    pub fn validate(&self) -> Result<(), String> {
        let bad = |m: String| Err(m);
        for (name, v) in self.values() {
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

    pub fn window(&self) -> usize {
        self.repeat_last_n.max(0) as usize
    }

    /// Whether two normalized option sets run through the pipeline identically (so their rows
    /// can share one fused pass). Seeds, logprob requests and the window length do not matter:
    /// each row brings its own history.
    pub fn same_pipeline(&self, other: &Options) -> bool {
        self.temperature == other.temperature
            && self.top_k == other.top_k
            && self.top_p == other.top_p
            && self.min_p == other.min_p
            && self.repeat_penalty == other.repeat_penalty
            && self.presence_penalty == other.presence_penalty
            && self.frequency_penalty == other.frequency_penalty
    }
}
