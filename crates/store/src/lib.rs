//! The model store: Modelfiles, content-addressed blobs and manifests in ollama's layout. Plain
//! files and JSON: importing checkpoints into it (reading and quantizing tensors with MLX) is the
//! `import` crate's, so that the parent server, which lists, shows and removes models, builds
//! without MLX.

pub mod manifest;
pub mod modelfile;
pub mod name;
pub mod quant;
mod report;
pub mod show;
mod store;

pub use manifest::{Manifest, ModelConfig};
pub use modelfile::{Modelfile, ParseError};
pub use name::ModelName;
pub use quant::QuantType;
pub use report::{CreateOptions, CreateReport, PartSummary};
pub use store::{sha256_hex, Listed, Resolved, Store, WriteLock};

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The cause is part of the message and deliberately not a `source()`: a CLI that prints
    /// the chain would print it twice.
    #[error("{path}: {cause}")]
    Io {
        path: PathBuf,
        cause: std::io::Error,
    },
    #[error("{path}: {message}")]
    Corrupt { path: PathBuf, message: String },
    #[error("model {0} not found")]
    NotFound(ModelName),
    #[error("Modelfile {path}: {error}")]
    Modelfile { path: PathBuf, error: ParseError },
    #[error(transparent)]
    Files(#[from] base::files::FileError),
    #[error("{0}")]
    Invalid(String),
}

pub type Result<T> = std::result::Result<T, StoreError>;
