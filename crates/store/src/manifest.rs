//! What the store writes: manifests (ollama's schema) and the model config blob.

use serde::{Deserialize, Serialize};

/// Media types, as ollama names them.
pub mod media {
    pub const MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";
    pub const CONFIG: &str = "application/vnd.docker.container.image.v1+json";
    /// A small safetensors file: one module's tensors (a quantized matrix with its scales and
    /// biases stays together).
    pub const TENSOR: &str = "application/vnd.ollama.image.tensor";
    /// A checkpoint JSON or tokenizer file, named as in the checkpoint (`draft/...` for the
    /// draft's).
    pub const JSON: &str = "application/vnd.ollama.image.json";
    pub const PARAMS: &str = "application/vnd.ollama.image.params";
    pub const TEMPLATE: &str = "application/vnd.ollama.image.template";
    pub const SYSTEM: &str = "application/vnd.ollama.image.system";
    pub const MESSAGES: &str = "application/vnd.ollama.image.messages";
    pub const LICENSE: &str = "application/vnd.ollama.image.license";
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Layer {
    pub media_type: String,
    /// `sha256:<hex>`.
    pub digest: String,
    pub size: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Manifest {
    pub schema_version: u32,
    pub media_type: String,
    pub config: Layer,
    pub layers: Vec<Layer>,
}

impl Manifest {
    pub fn new(config: Layer, layers: Vec<Layer>) -> Manifest {
        Manifest {
            schema_version: 2,
            media_type: media::MANIFEST.to_string(),
            config,
            layers,
        }
    }

    /// The manifest's bytes as ollama's `json.NewEncoder` writes them: compact, with a newline.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut bytes = serde_json::to_vec(self).expect("manifests serialize");
        bytes.push(b'\n');
        bytes
    }

    /// The config blob and every layer.
    pub fn all_layers(&self) -> impl Iterator<Item = &Layer> {
        std::iter::once(&self.config).chain(&self.layers)
    }

    pub fn layer(&self, media_type: &str) -> Option<&Layer> {
        self.layers.iter().find(|l| l.media_type == media_type)
    }
}

/// How a model's matrices were quantized by `create`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Quantization {
    /// `q4` or `q8` (MLX affine), or `mlx-lm` for a checkpoint that came quantized.
    #[serde(rename = "type")]
    pub kind: String,
    pub bits: i32,
    pub group_size: i32,
    pub mode: String,
    /// Matrices left unquantized because their input dimension is not a multiple of the
    /// group size (as mlx-lm does).
    #[serde(default)]
    pub unquantized: Vec<String>,
}

/// What one stored model (the target or its draft) is. Every field but `model_format` may be
/// missing: ollama's writer (`ConfigV2`) leaves `architecture` and `model_type` empty (the
/// architecture is read from the stored `config.json`), writes no `parameter_count` or `source`,
/// and spells `file_type` as `""`, `int4`, `int8`, ...
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Part {
    pub model_format: String,
    /// `architectures[0]` of its config, else its `model_type`.
    #[serde(default)]
    pub architecture: String,
    #[serde(default)]
    pub model_type: String,
    /// Ours: `F32`, `BF16`, `F16`, `Q4`, `Q8`; ollama's: `""` (float), `int4`, `int8`, ...
    #[serde(default)]
    pub file_type: String,
    #[serde(default)]
    pub parameter_count: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quantization: Option<Quantization>,
    /// The FROM or DRAFT it was created from (empty in a model ollama wrote).
    #[serde(default)]
    pub source: String,
    /// Multi-token-prediction layers the checkpoint carries (GLM's), which draft for it.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub mtp_layers: u32,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DraftInfo {
    #[serde(flatten)]
    pub part: Part,
    /// Draft tensors carry this prefix in the store.
    pub tensor_prefix: String,
    /// The layer name of the draft's config.json.
    pub config: String,
}

/// The config blob `create` writes: ollama's `model.ConfigV2` (`types/model/config.go`), its
/// fields in Go's order, so `json.Marshal` and serde give the same bytes. The architecture is
/// left empty, as ollama leaves it (readers take it from the stored config.json).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ConfigV2 {
    pub model_format: String,
    pub model_family: String,
    pub model_families: Option<Vec<String>>,
    pub model_type: String,
    pub file_type: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub renderer: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub parser: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub requires: String,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub capabilities: Vec<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub draft: Option<DraftV2>,
    pub architecture: String,
    pub os: String,
}

/// ollama's `model.Draft`: where a draft stored beside its target is.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DraftV2 {
    pub model_format: String,
    pub architecture: String,
    pub tensor_prefix: String,
    pub config: String,
}

/// The model config blob as read: ollama's `ConfigV2`, or the earlier format of this store
/// (which added `parameter_count`, `source` and a `quantization` summary).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    #[serde(flatten)]
    pub part: Part,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub draft: Option<DraftInfo>,
    /// What ollama serves the model for (`completion`, `tools`, `thinking`, `vision`, ...).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub capabilities: Vec<String>,
    /// ollama's prompt renderer and output parser for the model's family.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub renderer: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub parser: String,
}
