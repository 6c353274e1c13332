use std::path::PathBuf;

/// Why a model could not be loaded or run. Every variant names what is wrong (the file, the
/// field, the tensor), so the CLI can print it as one line.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// The cause is part of the message and deliberately not a `source()`: a CLI that prints
    /// the chain would print it twice.
    #[error("{path}: {cause}")]
    Io {
        path: PathBuf,
        cause: std::io::Error,
    },
    #[error("{path}: {message}")]
    Config { path: PathBuf, message: String },
    #[error("unknown architecture {model_type:?} in {path} (supported: gemma4, gemma4_text, glm4_moe_lite)")]
    UnknownArchitecture { path: PathBuf, model_type: String },
    #[error("missing tensor {name} (looked in {dir})")]
    MissingTensor { name: String, dir: PathBuf },
    #[error("tensor {name} has shape {got:?}, but the config implies {expected:?}")]
    Shape {
        name: String,
        expected: Vec<i32>,
        got: Vec<i32>,
    },
    #[error("tensor {name}: {message}")]
    Tensor { name: String, message: String },
    #[error("tokenizer {path}: {message}")]
    Tokenizer { path: PathBuf, message: String },
    #[error(transparent)]
    Mlx(#[from] mlx::Error),
    #[error(transparent)]
    Cache(#[from] cache::CacheError),
    #[error("{0}")]
    Invalid(String),
}

pub type Result<T> = std::result::Result<T, ModelError>;

impl From<base::files::FileError> for ModelError {
    fn from(e: base::files::FileError) -> Self {
        match e {
            base::files::FileError::Io { path, cause } => ModelError::Io { path, cause },
            base::files::FileError::Config { path, message } => {
                ModelError::Config { path, message }
            }
        }
    }
}
