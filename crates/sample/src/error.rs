//! What can go wrong in sampling.

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
