//! The runner: the generation pipeline, the engine thread that owns MLX (decision D3), and the
//! ollama-compatible HTTP server (PROTOCOL.md).

pub mod generate;
pub mod protocol;
pub mod stop;

pub use generate::{Ctx, Event, GenerateError, Generation, GenerationParams};
