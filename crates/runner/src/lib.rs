//! The runner: the generation pipeline, the engine thread that owns MLX (docs/ARCHITECTURE.md, D3), and the
//! ollama-compatible HTTP server (docs/PROTOCOL.md).

pub mod cluster;
pub mod depth;
pub mod engine;
pub mod generation;
pub mod media;
pub mod memory;
pub mod metrics;
pub mod process;
pub mod replica;
mod round;
pub mod server;
pub mod step;
pub mod stop;
pub mod text;

pub use base::{listen, protocol};
pub use cache::disk::DiskConfig;
pub use generation::{Ctx, Event, GenerateError, Generation, GenerationParams, RawLogprob};
