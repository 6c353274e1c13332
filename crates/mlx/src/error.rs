use std::path::PathBuf;

/// Everything that can go wrong at the MLX boundary.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// MLX rejected the call; the message is MLX's own (e.g. a shape mismatch in matmul).
    #[error("{0}")]
    Mlx(String),
    /// Data of one element type was asked of an array of another.
    #[error("dtype mismatch: the array holds {got:?}, {expected:?} was asked for")]
    Dtype {
        expected: crate::Dtype,
        got: crate::Dtype,
    },
    /// An argument checked on the Rust side (index out of range, bad slice step, ...).
    #[error("{0}")]
    Invalid(String),
    /// The cause is part of the message and deliberately not a `source()`: a CLI that prints
    /// the chain would print it twice.
    #[error("{path}: {cause}")]
    Io {
        path: PathBuf,
        cause: std::io::Error,
    },
    /// A file that is not what it claims to be (a truncated or malformed safetensors file).
    #[error("{path}: {message}")]
    Format { path: PathBuf, message: String },
}

pub type Result<T> = std::result::Result<T, Error>;

impl From<cxx::Exception> for Error {
    fn from(e: cxx::Exception) -> Self {
        Error::Mlx(e.what().to_string())
    }
}
