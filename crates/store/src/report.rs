//! What `create` takes and reports: plain data, known to the store without the importer (the
//! parent server forwards them to whoever imports).

use crate::manifest::ModelConfig;
use crate::quant::QuantType;
use std::collections::BTreeMap;

#[derive(Debug, Clone, Default)]
pub struct CreateOptions {
    pub quantize: Option<QuantType>,
    pub quantize_draft: Option<QuantType>,
}

/// One stored part (the target or its draft), as `create` reports it.
#[derive(Debug, Clone, PartialEq)]
pub struct PartSummary {
    /// `architectures[0]` of its config.json, else its `model_type`.
    pub architecture: String,
    /// ollama's `file_type`: `""` for a float model, else `int4`, `int8`.
    pub file_type: String,
    /// How many tensors are stored at each precision (`F32`, `BF16`, `int4`, `int8`, ...).
    pub precisions: BTreeMap<String, usize>,
}

/// What `create` did.
#[derive(Debug, Clone)]
pub struct CreateReport {
    pub digest: String,
    pub layers: usize,
    pub bytes: u64,
    pub config: ModelConfig,
    pub target: PartSummary,
    pub draft: Option<PartSummary>,
    /// Blobs no model used any more (a replaced model's, a killed run's), removed.
    pub removed_blobs: usize,
}
