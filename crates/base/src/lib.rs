//! What the runner and the parent server (`serve`) share, and nothing of MLX: the runner's wire
//! contract ([`protocol`]), the sampling options declared once ([`options`]), the HTTP plumbing
//! of both servers ([`listen`]), process signals and memory hand-back ([`signals`]), and what
//! the machine has ([`machine`]), and where a model's files are ([`files`]). `serve` depends on this, not on the runner, so the parent
//! server's crates carry no inference stack.

pub mod files;
pub mod listen;
pub mod machine;
pub mod options;
pub mod protocol;
pub mod signals;

/// Largest request body either server accepts (prompts are text; 32 MiB is ~8M tokens of
/// English).
pub const MAX_BODY: usize = 32 << 20;
