//! The runner: the generation pipeline, the engine thread that owns MLX (decision D3), and the
//! ollama-compatible HTTP server (PROTOCOL.md).

pub mod depth;
pub mod engine;
pub mod generate;
pub mod listen;
pub mod memory;
pub mod metrics;
pub mod process;
pub mod protocol;
pub mod server;
pub mod speculate;
pub mod stop;
pub mod text;

pub use cache::disk::DiskConfig;
pub use generate::{Ctx, Event, GenerateError, Generation, GenerationParams, RawLogprob};
pub use speculate::DraftModel;
