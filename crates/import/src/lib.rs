//! `create`: imports safetensors checkpoints (a target and its draft) into the model store in
//! ollama's layout, quantizing on the way if asked (MLX's affine quantization with ollama's
//! mixed-precision policy).

pub mod create;
mod tensors;

pub use create::{create, create_from};

use store::StoreError;

/// Why an import failed.
#[derive(Debug, thiserror::Error)]
pub enum ImportError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Model(#[from] models::ModelError),
    #[error(transparent)]
    Mlx(#[from] mlx::Error),
}

impl ImportError {
    /// The server's own failure (I/O, MLX), not the request's.
    pub fn internal(&self) -> bool {
        matches!(
            self,
            ImportError::Store(StoreError::Io { .. }) | ImportError::Mlx(_)
        )
    }
}

impl From<base::files::FileError> for ImportError {
    fn from(e: base::files::FileError) -> Self {
        ImportError::Store(e.into())
    }
}

pub type Result<T> = std::result::Result<T, ImportError>;
