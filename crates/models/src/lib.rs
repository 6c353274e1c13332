//! Model loading and forward passes: gemma4 (all variants) and GLM4-MoE-Lite on MLX.
//!
//! A model is weights plus a function ([`CausalLm`]): the caller creates the layer caches with
//! [`CausalLm::make_caches`], keeps them, and passes them into every [`CausalLm::forward`] call.
//! [`load`] reads a model directory (HF or mlx-lm layout, sharded or not, dense or
//! mlx-lm quantized) and its tokenizer, failing with an error that names the file, field or
//! tensor at fault.

mod attention;
pub mod block_fp8;
mod config;
pub mod draft;
mod error;
pub mod gemma4;
pub mod gemma4_assistant;
pub mod gemma4_audio;
pub mod gemma4_audio_features;
pub mod gemma4_image;
pub mod gemma4_vision;
pub mod glm4_moe_lite;
pub mod glm4_mtp;
pub mod media;
pub mod nn;
mod packed;
pub mod parallel;
mod parts;
pub mod pipeline;
mod prequant;
mod tokenizer;
pub mod weights;

pub use base::files::{sha256_file, ModelFiles, CHECKPOINT_FILES};
pub use cache::{LayerCache, RotatingKvCache};
pub use config::JsonFile;
pub use draft::{DraftOptions, Drafter};
pub use error::{ModelError, Result};
pub use packed::{MediaKind, MediaSpan, PackedRow};
pub use tokenizer::{StreamDecoder, Tokenizer};

use mlx::{Array, Dtype};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use weights::{QuantConfig, Weights};

/// A causal language model: weights plus a pure function of tokens and caches.
pub trait CausalLm {
    /// Fresh caches for one sequence batch, in the order `forward` expects them.
    fn make_caches(&self) -> Vec<LayerCache>;
    /// Runs `tokens: [B, L]` (int32) at the caches' offset and returns the final hidden states
    /// after the last norm, `[B, L, H]`. The caches advance by `L`.
    fn forward(&self, tokens: &Array, caches: &mut [LayerCache]) -> Result<Array>;
    /// Runs several sequences in one pass (see [`PackedRow`]): `tokens: [1, T]` holds each
    /// row's tokens in turn, each row at its own caches' offset; returns `[1, T, H]`, row by
    /// row. Each row's result is what [`CausalLm::forward`] gives it alone (up to the rounding
    /// of a larger matrix product). This default runs the rows one after the other; the
    /// models batch their matrix products.
    fn forward_packed(&self, tokens: &Array, rows: &mut [PackedRow<'_>]) -> Result<Array> {
        let mut outs = Vec::with_capacity(rows.len());
        let mut at = 0;
        for r in rows.iter_mut() {
            let t = tokens.slice_axis(1, at as i32, Some((at + r.len) as i32))?;
            outs.push(self.forward(&t, r.caches)?);
            at += r.len;
        }
        attention::join(&outs)
    }
    /// Output logits `[.., V]` for hidden states from `forward` (slice them first: the head is
    /// the largest matmul, and prefill needs only the last position).
    fn logits(&self, hidden: &Array) -> Result<Array>;
    fn vocab_size(&self) -> usize;
    /// The longest context the model supports.
    fn max_context(&self) -> usize;
    fn architecture(&self) -> &'static str;
    /// Keep `slack` tokens of history past the sliding window in rotating caches made from now
    /// on (speculation rewinds into it; the gemma4 assistant reads one key past the window).
    fn set_cache_slack(&mut self, _slack: usize) {}
    /// Store keys and values (MLA: latent rows) as `format` says in caches made from now on;
    /// the runner's `--kv-cache-type`.
    fn set_cache_format(&mut self, format: mlx::RowFormat);
    /// Sequence `seq` (a [`PackedRow::seq`]) has ended: a model whose replicas on other ranks
    /// keep caches per sequence lets them go.
    fn release(&self, _seq: u64) {}
    /// The drafter the checkpoint carries for itself (GLM's MTP layer), if any.
    fn builtin_drafter(&self) -> Option<Box<dyn Drafter>> {
        None
    }
    /// Rank 0 of a split model leading the other ranks: its own share of the model, and the
    /// line a drafter split alike tells the other ranks its passes through.
    fn leading(&self) -> Option<(&dyn CausalLm, Rc<dyn draft::DraftPeers>)> {
        None
    }
    /// The concrete model, for tests that check a model's internals against references.
    fn as_any(&self) -> &dyn std::any::Any;
}

/// Which dtype to compute in (docs/ARCHITECTURE.md, D6).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DtypeChoice {
    /// float32 on the CPU (its fast BLAS path); the checkpoint's dtype on a GPU.
    Auto,
    Fixed(Dtype),
}

impl std::str::FromStr for DtypeChoice {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "auto" => Ok(DtypeChoice::Auto),
            "f32" | "float32" => Ok(DtypeChoice::Fixed(Dtype::F32)),
            "f16" | "float16" => Ok(DtypeChoice::Fixed(Dtype::F16)),
            "bf16" | "bfloat16" => Ok(DtypeChoice::Fixed(Dtype::Bf16)),
            other => Err(format!(
                "unknown dtype {other:?} (expected auto, f32, f16 or bf16)"
            )),
        }
    }
}

/// What the caches store keys and values (GLM: latent rows) as: `--kv-cache-type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct KvCacheType(pub mlx::RowFormat);

impl std::str::FromStr for KvCacheType {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        use mlx::RowFormat::*;
        Ok(KvCacheType(match s {
            "auto" => AsComputed,
            "f32" | "float32" => Float(Dtype::F32),
            "f16" | "float16" => Float(Dtype::F16),
            "bf16" | "bfloat16" => Float(Dtype::Bf16),
            "q8" => Affine { bits: 8 },
            "q4" => Affine { bits: 4 },
            other => {
                return Err(format!(
                    "unknown KV cache type {other:?} (expected auto, f32, f16, bf16, q8 or q4)"
                ))
            }
        }))
    }
}

/// A loaded model.
pub struct LoadedModel {
    /// The layers this process holds where the model is split over ranks.
    pub layers: Option<std::ops::Range<usize>>,
    pub model: Box<dyn CausalLm>,
    pub tokenizer: std::sync::Arc<Tokenizer>,
    /// Its directory, or its store name.
    pub origin: PathBuf,
    pub dtype: Dtype,
    /// Checkpoint tensors the model did not use (multimodal towers, MTP layers).
    pub unused_tensors: Vec<String>,
}

fn checkpoint_dtype(cfg: &Value) -> Dtype {
    let name = cfg
        .get("torch_dtype")
        .or_else(|| cfg.get("dtype"))
        .or_else(|| cfg.get("text_config").and_then(|t| t.get("dtype")))
        .and_then(Value::as_str)
        .unwrap_or("bfloat16");
    Dtype::from_name(name)
        .filter(|d| d.is_float())
        .unwrap_or(Dtype::Bf16)
}

fn resolve_dtype(choice: DtypeChoice, cfg: &Value) -> Dtype {
    match choice {
        DtypeChoice::Fixed(d) => d,
        DtypeChoice::Auto if mlx::default_device() == mlx::Device::Gpu => checkpoint_dtype(cfg),
        DtypeChoice::Auto => Dtype::F32,
    }
}

fn quant_config(file: &JsonFile) -> Result<Option<QuantConfig>> {
    QuantConfig::of_config(&file.value).map_err(|m| file.error(m))
}

enum Arch {
    Gemma4(gemma4::Gemma4Config),
    Glm(glm4_moe_lite::GlmConfig),
}

impl Arch {
    fn layers(&self) -> usize {
        match self {
            Arch::Gemma4(c) => c.num_hidden_layers as usize,
            Arch::Glm(c) => c.num_hidden_layers as usize,
        }
    }
}

/// Loads the drafter in `dir` for `target`, refusing one whose vocabulary or sizes do not fit,
/// and prepares the target's caches for it.
pub fn load_draft(
    dir: &Path,
    target: &mut LoadedModel,
    opts: DraftOptions,
) -> Result<Box<dyn Drafter>> {
    load_draft_files(&ModelFiles::dir(dir)?, target, opts)
}

/// [`load_draft`] from a model's files wherever they are (a directory or the model store).
pub fn load_draft_files(
    files: &ModelFiles,
    target: &mut LoadedModel,
    opts: DraftOptions,
) -> Result<Box<dyn Drafter>> {
    files.verify()?;
    Ok(match draft_impl(files, target, opts.dtype, true)? {
        Draft::Assistant(mut a) => {
            a.set_position(opts.position);
            // The assistant reads one sliding key past the window.
            target.model.set_cache_slack(1);
            a
        }
        Draft::Model(mut m) => {
            // Drafts written into its ring one at a time must be rewindable.
            m.set_cache_slack(opts.slack);
            m.set_cache_format(opts.cache_format);
            Box::new(draft::SeparateModel::new(m))
        }
    })
}

/// Whether the drafter in `files` is the gemma4 assistant, which reads the target's caches
/// (on a split model, only where rank 0 leads the other ranks: `runner --hostfile`).
pub fn is_assistant(files: &ModelFiles) -> Result<bool> {
    Ok(JsonFile::read(files.config()?)?.model_type()? == "gemma4_assistant")
}

/// The part of a drafter in `files` that a rank following rank 0 runs, for `target` (this
/// rank's part of a split model): the gemma4 assistant's layers, split as the target is, whose
/// passes rank 0 leads; `None` for a drafter that runs on rank 0 alone.
pub fn load_draft_follower(
    files: &ModelFiles,
    target: &mut dyn CausalLm,
    dtype: Dtype,
    position: gemma4_assistant::QueryPosition,
) -> Result<Option<Box<dyn draft::DraftFollower>>> {
    if !is_assistant(files)? {
        return Ok(None);
    }
    files.verify()?;
    let file = JsonFile::read(files.config()?)?;
    let Some(t) = target.as_any().downcast_ref::<gemma4::Gemma4>() else {
        return Err(file.error(format!(
            "a gemma4_assistant drafts for gemma4 targets; the target is {}",
            target.architecture()
        )));
    };
    let weights = Weights::load_files(files, dtype, quant_config(&file)?)?;
    let mut layers = gemma4_assistant::AssistantLayers::load(&file, &weights, t)?;
    weights.materialize()?;
    layers.position = position;
    // As on rank 0: the assistant reads one sliding key past the window.
    target.set_cache_slack(1);
    Ok(Some(Box::new(layers)))
}

/// The gemma4 assistant in `dir`, for `target` (for tests of the assistant itself).
pub fn load_assistant(
    dir: &Path,
    target: &LoadedModel,
    dtype: DtypeChoice,
) -> Result<gemma4_assistant::Gemma4Assistant> {
    let files = ModelFiles::dir(dir)?;
    match draft_impl(&files, target, dtype, true)? {
        Draft::Assistant(a) => Ok(*a),
        Draft::Model(_) => Err(ModelError::Invalid(format!(
            "{} is not a gemma4 assistant",
            dir.display()
        ))),
    }
}

/// Checks that `files` hold a drafter for `target` (config, tensor names and shapes, tokenizer)
/// without reading any weights.
pub fn inspect_draft(files: &ModelFiles, target: &LoadedModel) -> Result<()> {
    draft_impl(files, target, DtypeChoice::Fixed(target.dtype), false).map(|_| ())
}

/// A drafter as its checkpoint describes it.
enum Draft {
    /// The gemma4 MTP assistant: reads the target's caches, keeps none of its own.
    Assistant(Box<gemma4_assistant::Gemma4Assistant>),
    /// A separate small model with the target's tokenizer and its own caches.
    Model(Box<dyn CausalLm>),
}

fn draft_impl(
    files: &ModelFiles,
    target: &LoadedModel,
    dtype: DtypeChoice,
    materialize: bool,
) -> Result<Draft> {
    let file = JsonFile::read(files.config()?)?;
    let model_type = file.model_type()?;
    if model_type == "gemma4_assistant" {
        // Rank 0 leading a split model splits the assistant's layers alike.
        let (local, peers) = match target.model.leading() {
            Some((m, p)) => (m, Some(p)),
            None => (&*target.model, None),
        };
        let Some(t) = local.as_any().downcast_ref::<gemma4::Gemma4>() else {
            return Err(file.error(format!(
                "a gemma4_assistant drafts for gemma4 targets; the target is {}",
                target.model.architecture()
            )));
        };
        let weights = Weights::load_files(files, target.dtype, quant_config(&file)?)?;
        let a = gemma4_assistant::Gemma4Assistant::load(&file, &weights, t, peers)?;
        if materialize {
            weights.materialize()?;
        }
        return Ok(Draft::Assistant(Box::new(a)));
    }
    let draft = load_impl(files, dtype, materialize, None)?;
    if draft.model.vocab_size() != target.model.vocab_size() {
        return Err(file.error(format!(
            "the draft's vocabulary has {} tokens, the target's {}",
            draft.model.vocab_size(),
            target.model.vocab_size()
        )));
    }
    if let Some(d) = target.tokenizer.first_difference(&draft.tokenizer) {
        return Err(ModelError::Tokenizer {
            path: files.origin.join("tokenizer.json"),
            message: format!("{d}: not the same tokenizer"),
        });
    }
    Ok(Draft::Model(draft.model))
}

/// The vision tower of the gemma4 model in `dir`, or `None` where its checkpoint has none.
pub fn load_vision(dir: &Path, dtype: DtypeChoice) -> Result<Option<gemma4_vision::Gemma4Vision>> {
    Ok(load_vision_files(&ModelFiles::dir(dir)?, dtype)?.map(|(v, _)| v))
}

/// The vision tower among a model's files and what a prompt needs to hold an image; `None`
/// where the checkpoint has no tower or no image processor config.
pub fn load_vision_files(
    files: &ModelFiles,
    dtype: DtypeChoice,
) -> Result<Option<(gemma4_vision::Gemma4Vision, gemma4_vision::ImagePrompt)>> {
    let file = JsonFile::read(files.config()?)?;
    let Some(cfg) = gemma4_vision::VisionConfig::from_file(&file)? else {
        return Ok(None);
    };
    let Some(processor) = gemma4_image::ImageProcessorConfig::load_files(files)? else {
        return Ok(None);
    };
    let prompt = gemma4_vision::ImagePrompt::new(&file, processor, &cfg)?;
    let text_hidden = gemma4_vision::text_hidden(&file)?;
    let dtype = resolve_dtype(dtype, &file.value);
    let weights = Weights::load_files(files, dtype, quant_config(&file)?)?;
    let vision = gemma4_vision::Gemma4Vision::new(cfg, text_hidden, &weights)?;
    weights.materialize()?;
    Ok(Some((vision, prompt)))
}

/// The audio tower among a model's files and what a prompt needs to hold a clip; `None` where
/// the checkpoint has no audio tower or no feature extractor config.
pub fn load_audio_files(
    files: &ModelFiles,
    dtype: DtypeChoice,
) -> Result<Option<(gemma4_audio::Gemma4Audio, gemma4_audio::AudioPrompt)>> {
    let file = JsonFile::read(files.config()?)?;
    let Some(cfg) = gemma4_audio::AudioConfig::from_file(&file)? else {
        return Ok(None);
    };
    let Some(features) = gemma4_audio_features::AudioFeatureConfig::load_files(files)? else {
        return Ok(None);
    };
    // The processor's cap on one clip's soft tokens (750: 30 s).
    let max_tokens = match files.file("processor_config.json") {
        Some(path) => JsonFile::read(path)?
            .value
            .get("audio_seq_length")
            .and_then(serde_json::Value::as_u64)
            .unwrap_or(750) as usize,
        None => 750,
    };
    let prompt = gemma4_audio::AudioPrompt::new(&file, features, max_tokens)?;
    let text_hidden = gemma4_vision::text_hidden(&file)?;
    let dtype = resolve_dtype(dtype, &file.value);
    let weights = Weights::load_files(files, dtype, quant_config(&file)?)?;
    let mel = prompt.features.feature_size as i32;
    let audio = gemma4_audio::Gemma4Audio::new(cfg, text_hidden, mel, &weights)?;
    weights.materialize()?;
    Ok(Some((audio, prompt)))
}

/// Loads the model in `dir`: config, tokenizer, then weights (lazily read, cast once).
pub fn load(dir: &Path, dtype: DtypeChoice) -> Result<LoadedModel> {
    load_files(&ModelFiles::dir(dir)?, dtype)
}

/// [`load`] from a model's files wherever they are, verifying the digests they carry first.
pub fn load_files(files: &ModelFiles, dtype: DtypeChoice) -> Result<LoadedModel> {
    files.verify()?;
    load_impl(files, dtype, true, None)
}

/// [`load_files`] for one rank of `group`, split as `mode` says ([`parallel`]): by layers,
/// only the layers of its stage (balanced by bytes) and the embedding and head where `ends`
/// puts them; by tensors, its share of every layer. Every rank computes the same split from
/// the same files.
pub fn load_files_stage(
    files: &ModelFiles,
    dtype: DtypeChoice,
    group: std::rc::Rc<mlx::distributed::Group>,
    ends: parallel::Ends,
    mode: parallel::Mode,
) -> Result<LoadedModel> {
    files.verify()?;
    load_impl(files, dtype, true, Some((group, ends, mode)))
}

/// Builds the model in `files` without reading any weights: every tensor the architecture needs
/// is checked by name and shape, and the tokenizer is parsed. What `create` validates with.
pub fn inspect(files: &ModelFiles) -> Result<LoadedModel> {
    let cfg = JsonFile::read(files.config()?)?;
    load_impl(
        files,
        DtypeChoice::Fixed(checkpoint_dtype(&cfg.value)),
        false,
        None,
    )
}

fn load_impl(
    files: &ModelFiles,
    dtype: DtypeChoice,
    materialize: bool,
    group: Option<(
        std::rc::Rc<mlx::distributed::Group>,
        parallel::Ends,
        parallel::Mode,
    )>,
) -> Result<LoadedModel> {
    let file = JsonFile::read(files.config()?)?;
    let model_type = file.model_type()?;
    let arch = match model_type.as_str() {
        "gemma4" | "gemma4_text" => Arch::Gemma4(gemma4::Gemma4Config::from_file(&file)?),
        "glm4_moe_lite" => Arch::Glm(glm4_moe_lite::GlmConfig::from_file(&file)?),
        _ => {
            return Err(ModelError::UnknownArchitecture {
                path: file.path.clone(),
                model_type,
            })
        }
    };
    let quant = quant_config(&file)?;
    let tokenizer = Tokenizer::load_files(files)?;
    let dtype = resolve_dtype(dtype, &file.value);
    let weights = Weights::load_files(files, dtype, quant)?;
    let ranks = group.as_ref().map_or(1, |(g, _, _)| g.size());
    let split = match group {
        Some((g, ends, parallel::Mode::Pipeline { micro_tokens })) if ranks > 1 => {
            let ranges = match &arch {
                Arch::Gemma4(cfg) => gemma4::Gemma4::split(cfg, &weights, ranks, ends)?,
                Arch::Glm(cfg) => glm4_moe_lite::Glm4MoeLite::split(cfg, &weights, ranks, ends)?,
            };
            Some(parallel::Split::Layers(
                parallel::Stage::new(g, &ranges, dtype, ends)?.with_micro_batches(micro_tokens),
            ))
        }
        Some((g, ends, parallel::Mode::Tensor)) if ranks > 1 => {
            Some(parallel::Split::Tensors(parallel::Shard::new(g, ends)))
        }
        _ => None,
    };
    let layers = split.as_ref().map(|s| match s {
        parallel::Split::Layers(stage) => stage.layers(),
        parallel::Split::Tensors(_) => 0..arch.layers(),
    });
    let model: Box<dyn CausalLm> = match arch {
        Arch::Gemma4(cfg) => Box::new(gemma4::Gemma4::with_split(cfg, &weights, split)?),
        Arch::Glm(cfg) => Box::new(glm4_moe_lite::Glm4MoeLite::with_split(
            cfg, &weights, split,
        )?),
    };
    if tokenizer.vocab_size() > model.vocab_size() {
        return Err(ModelError::Tokenizer {
            path: files.origin.join("tokenizer.json"),
            message: format!(
                "has {} tokens but the model's vocabulary has {}",
                tokenizer.vocab_size(),
                model.vocab_size()
            ),
        });
    }
    if materialize {
        weights.materialize()?;
    }
    Ok(LoadedModel {
        model,
        tokenizer: std::sync::Arc::new(tokenizer),
        origin: files.origin.clone(),
        dtype,
        unused_tensors: weights.unused(),
        layers,
    })
}
