//! Turning logits into tokens for many sequences at once, and giving speculation the
//! distributions it needs. Options and their normalisation are ollama's (docs/PROTOCOL.md,
//! "Completion request"); the transforms run in the order penalties, top-k, temperature, top-p,
//! min-p, renormalise, sample.
//!
//! Sampling is by inverse CDF with one uniform number per row, drawn from the row's own slot key
//! (SplitMix64 of the seed and a draw counter): a seeded slot draws the same numbers whatever
//! other slots share the batch, and the fused and per-slot paths give identical tokens.

mod distribution;
mod error;
mod pipeline;
mod sampler;

pub use base::options::{Options, MAX_TOP_LOGPROBS};
pub use distribution::Distribution;
pub use error::{Result, SampleError};
pub use pipeline::Strategy;
pub use sampler::{fresh_seed, logprobs, Sampled, Sampler, TopLogprobs};
