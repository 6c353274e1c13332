//! Checkpoint tensors and the path-aware view the model files build themselves from.
//!
//! [`Weights::load`] reads every shard of a model directory (through `model.safetensors.index.json`
//! when present, else every `model*.safetensors`), and [`Vb`] hands tensors out by path, checking
//! shapes against what the config implies and naming the full tensor path in every error.
//! Floating-point tensors are cast to the compute dtype; quantized ones (mlx-lm's packed
//! `weight` + `scales` + `biases`) keep their packed form. Everything handed out is remembered so
//! that [`Weights::materialize`] can evaluate the casts once, at load, rather than on every call.

use crate::nn::{Embedding, Experts, Linear};
use crate::{ModelError, Result};
use mlx::{Array, Dtype, QuantMode};
use serde_json::Value;
use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

/// How one module is quantized: MLX's mode, bits per value and values per group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuantParams {
    pub group_size: i32,
    pub bits: i32,
    pub mode: QuantMode,
}

impl QuantParams {
    /// An entry of mlx-lm's block (the block itself for the defaults): `mode` (absent: affine,
    /// as MLX's `to_quantized` takes it), `bits` and `group_size` (a microscaling mode's own
    /// when absent).
    fn parse(o: &serde_json::Map<String, Value>, at: &str) -> std::result::Result<Self, String> {
        let mode = match o.get("mode") {
            None => QuantMode::Affine,
            Some(Value::String(m)) => QuantMode::parse(m).ok_or_else(|| {
                format!(
                    "{at}.mode {m:?} is not one of MLX's quantization modes (affine, mxfp4, nvfp4, mxfp8)"
                )
            })?,
            Some(other) => return Err(format!("{at}.mode must be a string, not {other}")),
        };
        let int = |k: &str, fixed: Option<i32>| -> std::result::Result<i32, String> {
            match (o.get(k), fixed) {
                (None, Some(v)) => Ok(v),
                (v, _) => v
                    .and_then(Value::as_i64)
                    .map(|x| x as i32)
                    .ok_or_else(|| format!("{at}.{k} must be an integer")),
            }
        };
        let fixed = mode.fixed_format();
        Ok(QuantParams {
            bits: int("bits", fixed.map(|f| f.0))?,
            group_size: int("group_size", fixed.map(|f| f.1))?,
            mode,
        })
    }

    /// Whether MLX has this format, for rows of `cols` values.
    fn check(&self, cols: i32) -> std::result::Result<(), String> {
        let (bits, group_size) = (self.bits, self.group_size);
        match self.mode.fixed_format() {
            None if ![2, 3, 4, 5, 6, 8].contains(&bits) => {
                return Err(format!(
                    "is quantized at {bits} bits, which MLX's affine mode does not have (2, 3, 4, 5, 6 or 8)"
                ))
            }
            None if ![32, 64, 128].contains(&group_size) => {
                return Err(format!(
                    "has a group size of {group_size}, which MLX's affine mode does not have (32, 64 or 128)"
                ))
            }
            Some((b, g)) if (b, g) != (bits, group_size) => {
                return Err(format!(
                    "is {} with {bits} bits and groups of {group_size}; {} is {b} bits in groups of {g}",
                    self.mode.name(),
                    self.mode.name()
                ))
            }
            _ => {}
        }
        if cols % group_size != 0 {
            return Err(format!(
                "has rows of {cols} values, not a whole number of groups of {group_size}"
            ));
        }
        Ok(())
    }
}

/// mlx-lm's `quantization` block: defaults plus per-module overrides (or `false` to exclude).
#[derive(Debug, Clone)]
pub struct QuantConfig {
    pub default: QuantParams,
    overrides: HashMap<String, Option<QuantParams>>,
}

impl QuantConfig {
    /// A checkpoint's quantization block (config.json's `quantization` or
    /// `quantization_config`, at the top or under `text_config`): mlx-lm's, or `None` where the
    /// weights are in float or decoded on reading (block-FP8); another producer's method is
    /// refused by name.
    pub fn of_config(cfg: &Value) -> std::result::Result<Option<QuantConfig>, String> {
        let block = ["quantization", "quantization_config"]
            .iter()
            .find_map(|k| {
                cfg.get(*k)
                    .or_else(|| cfg.get("text_config")?.get(*k))
                    .filter(|v| !v.is_null())
            });
        let Some(block) = block else {
            return Ok(None);
        };
        if let Some(method) = block.get("quant_method").and_then(Value::as_str) {
            return match method {
                "fp8" => crate::block_fp8::check_config(block.as_object().expect("has a key"))
                    .map(|()| None),
                // NVIDIA's nvfp4 layouts, read by their tensors (crate::prequant).
                "compressed-tensors" => {
                    let format = block.get("format").and_then(Value::as_str).unwrap_or("");
                    if format == "nvfp4-pack-quantized" {
                        Ok(None)
                    } else {
                        Err(format!("quantization_config.format is {format:?}; of compressed-tensors' formats mlx-runner loads nvfp4-pack-quantized"))
                    }
                }
                "modelopt" => {
                    let algo = block.get("quant_algo").and_then(Value::as_str).unwrap_or("");
                    if algo.eq_ignore_ascii_case("nvfp4") {
                        Ok(None)
                    } else {
                        Err(format!("quantization_config.quant_algo is {algo:?}; of ModelOpt's formats mlx-runner loads NVFP4"))
                    }
                }
                "mlx" => Self::parse(block).map(Some),
                other => Err(format!(
                    "quantization_config.quant_method is {other:?}; mlx-runner loads MLX's quantization (mlx-lm's block), block-FP8 (\"fp8\") and nvfp4 (compressed-tensors, modelopt) checkpoints"
                )),
            };
        }
        Self::parse(block).map(Some)
    }

    pub fn parse(v: &Value) -> std::result::Result<QuantConfig, String> {
        let obj = v.as_object().ok_or("quantization must be an object")?;
        let mut q = QuantConfig {
            default: QuantParams::parse(obj, "quantization")?,
            overrides: HashMap::new(),
        };
        for (k, v) in obj {
            match v {
                Value::Object(o) => {
                    let params = QuantParams::parse(o, &format!("quantization.{k}"))?;
                    q.overrides.insert(k.clone(), Some(params));
                }
                Value::Bool(false) => {
                    q.overrides.insert(k.clone(), None);
                }
                _ => {}
            }
        }
        Ok(q)
    }

    /// `config` (config.json's block, if any) with `modules` (what each module's stored blob
    /// says, as ollama's importer records it: affine `(group_size, bits)`) taking precedence;
    /// `None` when neither says anything.
    pub fn with_modules(config: Option<QuantConfig>, modules: ModuleQuant) -> Option<QuantConfig> {
        if modules.is_empty() {
            return config;
        }
        let mut q = config.unwrap_or_else(|| QuantConfig {
            default: *modules.values().next().expect("not empty"),
            overrides: HashMap::new(),
        });
        q.overrides
            .extend(modules.into_iter().map(|(k, v)| (k, Some(v))));
        Some(q)
    }

    /// Refuses a per-module entry (a mixed recipe's) naming a module no tensor belongs to:
    /// a recipe for another checkpoint, or one edited by hand.
    fn check_modules(&self, tensors: &Tensors) -> Result<()> {
        let mut modules = HashSet::new();
        for name in tensors.keys() {
            let mut at = name.len();
            while let Some(dot) = name[..at].rfind('.') {
                if !modules.insert(&name[..dot]) {
                    break;
                }
                at = dot;
            }
        }
        let mut missing: Vec<&String> = self
            .overrides
            .keys()
            .filter(|k| !modules.contains(k.as_str()))
            .collect();
        missing.sort();
        match missing.first() {
            None => Ok(()),
            Some(m) => Err(ModelError::Tensor {
                name: (*m).clone(),
                message: format!(
                    "is named by config.json's quantization block, but the checkpoint has no tensors of that module{}",
                    match missing.len() {
                        1 => String::new(),
                        n => format!(" ({} entries name missing modules)", n),
                    }
                ),
            }),
        }
    }

    /// How the module at `path` is quantized; `None` for a module left unquantized.
    pub fn module_params(&self, path: &str) -> Option<QuantParams> {
        match self.overrides.get(path) {
            Some(p) => *p,
            None => Some(self.default),
        }
    }
}

/// All tensors of a checkpoint.
pub struct Weights {
    dir: PathBuf,
    /// The checkpoint's tensors until [`Weights::materialize`] lets them go (a tensor the model
    /// holds stays alive through the model's handle; one it only transformed is then freed).
    tensors: RefCell<HashMap<String, Array>>,
    /// Every tensor's name, kept after the tensors are let go.
    names: HashSet<String>,
    dtype: Dtype,
    quant: Option<QuantConfig>,
    used: RefCell<HashSet<String>>,
    handed_out: RefCell<Vec<Array>>,
}

pub use base::files::shard_files;

/// Every tensor of `files` under its tensor prefix (removed from the names), read lazily.
pub fn read_tensors(files: &crate::ModelFiles) -> Result<HashMap<String, Array>> {
    Ok(read_tensors_quantized(files)?.0)
}

/// Tensors by name.
pub type Tensors = HashMap<String, Array>;
/// Module path → how it is quantized.
pub type ModuleQuant = HashMap<String, QuantParams>;

/// An ollama quantization type (a blob's `quant_type`, its aliases as ollama resolves them,
/// case aside) and the blob's `group_size` (else the type's default): ollama's `int4`/`int8`
/// are MLX's affine mode, `nvfp4`, `mxfp4` and `mxfp8` the microscaling modes of that name.
fn ollama_quant(kind: &str, group: Option<&str>) -> std::result::Result<QuantParams, String> {
    let (mode, bits, default_group) = match kind.trim().to_ascii_uppercase().as_str() {
        "INT4" | "FP4" | "Q4" => (QuantMode::Affine, 4, 64),
        "INT8" | "FP8" | "Q8" => (QuantMode::Affine, 8, 64),
        "NVFP4" => (QuantMode::Nvfp4, 4, 16),
        "MXFP4" => (QuantMode::Mxfp4, 4, 32),
        "MXFP8" => (QuantMode::Mxfp8, 8, 32),
        _ => {
            return Err(format!(
                "is quantized as {kind:?}, which is not one of ollama's quantization types \
                 (int4, int8, nvfp4, mxfp4, mxfp8)"
            ))
        }
    };
    let group_size = match group {
        None => default_group,
        Some(g) => g
            .parse()
            .map_err(|_| format!("has a group_size of {g:?}, not a number"))?,
    };
    Ok(QuantParams {
        group_size,
        bits,
        mode,
    })
}

/// Tensors as [`read_tensors`] gives them, with ollama's quantized layout turned into mlx-lm's.
/// ollama's importer stores a quantized `<m>.weight` beside `<m>.weight.scale` and
/// `<m>.weight.bias`, its type and group in the blob's `__metadata__` (`quant_type`,
/// `group_size`, or per tensor `<t>.quant_type`, `<t>.group_size`), and mixes precisions within
/// one model; they become `<m>.scales` / `<m>.biases` and a per-module entry in the returned
/// map. A microscaling type (nvfp4, mxfp4, mxfp8) has a `.scale` and no `.bias`.
pub fn read_tensors_quantized(files: &crate::ModelFiles) -> Result<(Tensors, ModuleQuant)> {
    let c = read_checkpoint(files)?;
    Ok((c.tensors, c.quant))
}

/// A checkpoint's tensors as the models read them.
pub struct Checkpoint {
    /// By name, under the files' tensor prefix (removed).
    pub tensors: Tensors,
    /// How each module stored quantized in ollama's layout is (from the blobs' metadata).
    pub quant: ModuleQuant,
    /// The weights that were block-FP8 in the files, now bfloat16 ([`crate::block_fp8`]).
    pub decoded_fp8: Vec<String>,
}

/// Every tensor of `files` (see [`read_tensors_quantized`]), block-FP8 weights decoded.
pub fn read_checkpoint(files: &crate::ModelFiles) -> Result<Checkpoint> {
    if files.tensors.is_empty() {
        return Err(ModelError::Config {
            path: files.origin.clone(),
            message: "no model*.safetensors files".into(),
        });
    }
    let mut tensors = HashMap::new();
    let mut quant = HashMap::new();
    let mut float8 = Vec::new();
    let prefix = files.tensor_prefix.as_str();
    for f in &files.tensors {
        let t = mlx::io::load_safetensors(f).map_err(|e| match e {
            mlx::Error::Io { path, cause } => ModelError::Io { path, cause },
            other => ModelError::Mlx(other),
        })?;
        let mut arrays = t.arrays;
        float8.extend(
            t.float8
                .iter()
                .filter_map(|n| n.strip_prefix(prefix).map(String::from)),
        );
        // A packed (u32) tensor with a `.scale` beside it; a fused stacked tensor such as
        // `experts.gate_up_proj` has no `.weight` suffix, and gets one.
        let quantized: Vec<String> = arrays
            .iter()
            .filter(|(k, a)| a.dtype() == Dtype::U32 && arrays.contains_key(&format!("{k}.scale")))
            .map(|(k, _)| k.clone())
            .collect();
        for w in quantized {
            let meta = |key: &str| {
                t.metadata
                    .get(&format!("{w}.{key}"))
                    .or_else(|| t.metadata.get(key))
                    .map(String::as_str)
            };
            let Some(kind) = meta("quant_type") else {
                return Err(ModelError::Tensor {
                    name: w,
                    message: format!(
                        "{} stores it quantized without a quant_type in its metadata",
                        f.display()
                    ),
                });
            };
            let params =
                ollama_quant(kind, meta("group_size")).map_err(|message| ModelError::Tensor {
                    name: w.clone(),
                    message,
                })?;
            let module = w.strip_suffix(".weight").unwrap_or(&w).to_string();
            if !w.ends_with(".weight") {
                if let Some(a) = arrays.remove(&w) {
                    arrays.insert(format!("{module}.weight"), a);
                }
            }
            for (from, to) in [
                ("scale", "scales"),
                ("bias", "biases"),
                ("global_scale", "global_scale"),
            ] {
                if let Some(a) = arrays.remove(&format!("{w}.{from}")) {
                    arrays.insert(format!("{module}.{to}"), a);
                }
            }
            if let Some(m) = module.strip_prefix(prefix) {
                quant.insert(m.to_string(), params);
            }
        }
        tensors.extend(
            arrays
                .into_iter()
                .filter_map(|(k, v)| k.strip_prefix(prefix).map(|k| (k.to_string(), v))),
        );
    }
    // A weight's scales may sit in another shard: both rewrites run once all are read.
    crate::prequant::canonicalize(&mut tensors, &mut float8, &mut quant)?;
    let decoded_fp8 = crate::block_fp8::decode_all(&mut tensors, &float8)?;
    Ok(Checkpoint {
        tensors,
        quant,
        decoded_fp8,
    })
}

impl Weights {
    /// Reads the tensors of every shard of a directory (lazily: data is read when first evaluated).
    pub fn load(dir: &Path, dtype: Dtype, quant: Option<QuantConfig>) -> Result<Weights> {
        Self::load_files(&crate::ModelFiles::dir(dir)?, dtype, quant)
    }

    /// Reads the tensors of `files` (lazily), keeping those under its tensor prefix, which is
    /// removed from their names.
    pub fn load_files(
        files: &crate::ModelFiles,
        dtype: Dtype,
        quant: Option<QuantConfig>,
    ) -> Result<Weights> {
        let (tensors, per_module) = read_tensors_quantized(files)?;
        if let Some(q) = &quant {
            q.check_modules(&tensors)?;
        }
        let quant = QuantConfig::with_modules(quant, per_module);
        Ok(Weights {
            dir: files.origin.clone(),
            names: tensors.keys().cloned().collect(),
            tensors: RefCell::new(tensors),
            dtype,
            quant,
            used: RefCell::new(HashSet::new()),
            handed_out: RefCell::new(Vec::new()),
        })
    }

    /// Tensors built in memory (tests, derived checkpoints).
    pub fn from_arrays(
        tensors: HashMap<String, Array>,
        dtype: Dtype,
        quant: Option<QuantConfig>,
    ) -> Weights {
        Weights {
            dir: PathBuf::from("<memory>"),
            names: tensors.keys().cloned().collect(),
            tensors: RefCell::new(tensors),
            dtype,
            quant,
            used: RefCell::new(HashSet::new()),
            handed_out: RefCell::new(Vec::new()),
        }
    }

    pub fn dtype(&self) -> Dtype {
        self.dtype
    }

    pub fn root(&self) -> Vb<'_> {
        Vb {
            w: self,
            prefix: String::new(),
        }
    }

    /// Whether any tensor name starts with `prefix`.
    pub fn has_prefix(&self, prefix: &str) -> bool {
        self.names.iter().any(|k| k.starts_with(prefix))
    }

    pub fn contains(&self, name: &str) -> bool {
        self.names.contains(name)
    }

    /// Evaluates every tensor handed out (casts, stacks, transposes), so that forward passes
    /// start from materialised weights, and moves them into huge pages, where a decode step
    /// streams them faster ([`mlx::memory::move_to_huge_pages`]). The checkpoint's own handles
    /// are let go first: a tensor the model holds only in another form (a transposed copy) is
    /// then freed as soon as that form is computed, and its memory serves the next ones, rather
    /// than both forms staying resident (float models held twice their weights).
    pub fn materialize(&self) -> Result<()> {
        self.tensors.borrow_mut().clear();
        let arrays = self.handed_out.borrow();
        for chunk in arrays.chunks(256) {
            let refs: Vec<&Array> = chunk.iter().collect();
            mlx::eval(&refs)?;
        }
        mlx::memory::move_to_huge_pages(arrays.iter())?;
        Ok(())
    }

    /// Every checkpoint tensor's name and size in bytes as stored (nothing is read), until
    /// [`Weights::materialize`].
    pub fn tensor_bytes(&self) -> Vec<(String, u64)> {
        self.tensors
            .borrow()
            .iter()
            .map(|(n, a)| (n.clone(), a.nbytes() as u64))
            .collect()
    }

    /// Names no model code asked for (multimodal towers, MTP layers, ...), sorted.
    pub fn unused(&self) -> Vec<String> {
        let used = self.used.borrow();
        let mut v: Vec<String> = self
            .names
            .iter()
            .filter(|k| !used.contains(*k))
            .cloned()
            .collect();
        v.sort();
        v
    }

    fn raw(&self, name: &str) -> Result<Array> {
        let a =
            self.tensors
                .borrow()
                .get(name)
                .cloned()
                .ok_or_else(|| ModelError::MissingTensor {
                    name: name.to_string(),
                    dir: self.dir.clone(),
                })?;
        self.used.borrow_mut().insert(name.to_string());
        Ok(a)
    }

    /// Lets go of the checkpoint's handles of the tensors under `prefix` (`model.layers.3.`),
    /// read now or not: a rank of a model split by tensors keeps parts it copied out of them
    /// ([`crate::parts`]), and each whole tensor it read is freed now rather than held until
    /// [`Weights::materialize`]. What the model keeps of them stays alive through its own
    /// handles.
    pub(crate) fn forget_under(&self, prefix: &str) {
        self.tensors
            .borrow_mut()
            .retain(|name, _| !name.starts_with(prefix));
    }

    pub(crate) fn keep(&self, a: Array) -> Array {
        self.handed_out.borrow_mut().push(a.clone());
        a
    }

    /// [`Weights::keep`] for `a`, made from `source`, which the model holds only as `a` (a
    /// transposed copy): `source` is [withdrawn](Weights::withdraw).
    pub(crate) fn keep_instead(&self, source: &Array, a: Array) -> Array {
        self.withdraw(source);
        self.keep(a)
    }

    /// Withdraws one handing out of `source`, which the model holds only in forms made from it
    /// (a transposed copy, a stack, the halves of a fused tensor), so that it is not evaluated
    /// and kept beside them; any other handing out of it still stands.
    pub(crate) fn withdraw(&self, source: &Array) {
        let mut kept = self.handed_out.borrow_mut();
        if let Some(i) = kept.iter().rposition(|k| k.id() == source.id()) {
            kept.remove(i);
        }
    }

    /// `q` as the CPU multiplies it fastest: paneled where [`mlx::Quantized::paneled`] applies
    /// (its row arrays withdrawn, the panels kept for loading), else `q`.
    pub(crate) fn paneled(&self, q: mlx::Quantized) -> Result<mlx::Quantized> {
        let Some(p) = q.paneled()? else {
            return Ok(q);
        };
        self.withdraw_quantized(&q);
        for part in [Some(&p.weight), Some(&p.scales), p.biases.as_ref()]
            .into_iter()
            .flatten()
        {
            self.keep(part.clone());
        }
        Ok(p)
    }

    /// [`Weights::withdraw`] for each part of a quantized matrix.
    pub(crate) fn withdraw_quantized(&self, q: &mlx::Quantized) {
        for part in [Some(&q.weight), Some(&q.scales), q.biases.as_ref()]
            .into_iter()
            .flatten()
        {
            self.withdraw(part);
        }
    }
}

/// A view of [`Weights`] under a path prefix (`model.layers.3.self_attn`).
#[derive(Clone)]
pub struct Vb<'a> {
    w: &'a Weights,
    prefix: String,
}

impl<'a> Vb<'a> {
    pub fn pp(&self, part: impl std::fmt::Display) -> Vb<'a> {
        let prefix = if self.prefix.is_empty() {
            part.to_string()
        } else {
            format!("{}.{part}", self.prefix)
        };
        Vb { w: self.w, prefix }
    }

    pub fn path(&self) -> &str {
        &self.prefix
    }

    pub fn name(&self, leaf: &str) -> String {
        if self.prefix.is_empty() {
            leaf.to_string()
        } else {
            format!("{}.{leaf}", self.prefix)
        }
    }

    pub fn weights(&self) -> &'a Weights {
        self.w
    }

    pub fn has(&self, leaf: &str) -> bool {
        self.w.contains(&self.name(leaf))
    }

    /// The stored tensor `leaf` and its full name, which must have exactly `shape`.
    fn shaped(&self, leaf: &str, shape: &[i32]) -> Result<(String, Array)> {
        let name = self.name(leaf);
        let a = self.w.raw(&name)?;
        if a.shape() != shape {
            return Err(ModelError::Shape {
                name,
                expected: shape.to_vec(),
                got: a.shape(),
            });
        }
        Ok((name, a))
    }

    /// A floating-point tensor of exactly `shape`, in the compute dtype.
    pub fn get(&self, leaf: &str, shape: &[i32]) -> Result<Array> {
        let (name, a) = self.shaped(leaf, shape)?;
        self.cast(&name, a)
    }

    /// A floating-point tensor of any shape, in the compute dtype.
    pub fn get_unchecked(&self, leaf: &str) -> Result<Array> {
        let name = self.name(leaf);
        let a = self.w.raw(&name)?;
        self.cast(&name, a)
    }

    /// A tensor exactly as stored (integer tables such as a token ordering), shape checked.
    pub fn raw_tensor(&self, leaf: &str, shape: &[i32]) -> Result<Array> {
        Ok(self.shaped(leaf, shape)?.1)
    }

    /// A tensor kept in float32 whatever the compute dtype (router biases, docs/MODELS.md §3.2).
    pub fn get_f32(&self, leaf: &str, shape: &[i32]) -> Result<Array> {
        let (_, a) = self.shaped(leaf, shape)?;
        Ok(self.w.keep(a.astype(Dtype::F32)?))
    }

    fn cast(&self, name: &str, a: Array) -> Result<Array> {
        if !a.dtype().is_float() {
            return Err(ModelError::Tensor {
                name: name.to_string(),
                message: format!("expected a floating-point tensor, found {:?}", a.dtype()),
            });
        }
        Ok(self.w.keep(a.astype(self.w.dtype)?))
    }

    /// Whether the module at this path is stored quantized.
    pub fn is_quantized(&self) -> bool {
        self.has("scales")
    }

    /// Quantized parts of the module at this path, checked against the config and `rows × cols`
    /// (`lead` leading dimensions for stacked experts).
    pub(crate) fn quantized(&self, lead: &[i32], rows: i32, cols: i32) -> Result<mlx::Quantized> {
        let wname = self.name("weight");
        let q = self.w.quant.as_ref().ok_or_else(|| ModelError::Tensor {
            name: wname.clone(),
            message: "stored quantized, but config.json has no quantization block".into(),
        })?;
        let params = q
            .module_params(&self.prefix)
            .ok_or_else(|| ModelError::Tensor {
                name: wname.clone(),
                message: "stored quantized, but the quantization block excludes this module".into(),
            })?;
        let QuantParams {
            group_size,
            bits,
            mode,
        } = params;
        if let Err(message) = params.check(cols) {
            return Err(ModelError::Tensor {
                name: wname,
                message,
            });
        }
        // Kept, so that loading materialises the packed codes too: the first forward pass then
        // finds them in memory (and the CPU kernels find them contiguous).
        let weight = self.w.keep(self.w.raw(&wname)?);
        // Affine's scales and biases are floats in the compute dtype; a microscaling mode's
        // scales are its 8-bit codes, as stored, and it has no biases.
        let (scales, biases) = if mode.has_biases() {
            (
                self.get_unchecked("scales")?,
                Some(self.get_unchecked("biases")?),
            )
        } else {
            if self.has("biases") {
                return Err(ModelError::Tensor {
                    name: self.name("biases"),
                    message: format!(
                        "{} has no biases, but the checkpoint holds some",
                        mode.name()
                    ),
                });
            }
            let scales = self.w.keep(self.w.raw(&self.name("scales"))?);
            if scales.dtype() != Dtype::U8 {
                return Err(ModelError::Tensor {
                    name: self.name("scales"),
                    message: format!(
                        "is {:?}; {} scales are uint8 codes",
                        scales.dtype(),
                        mode.name()
                    ),
                });
            }
            (scales, None)
        };
        let mut expect_w: Vec<i32> = lead.to_vec();
        expect_w.extend([rows, cols * bits / 32]);
        let mut expect_s: Vec<i32> = lead.to_vec();
        expect_s.extend([rows, cols / group_size]);
        if weight.dtype() != Dtype::U32 || weight.shape() != expect_w {
            return Err(ModelError::Tensor {
                name: wname,
                message: format!(
                    "{:?} {:?} does not hold {rows}x{cols} at {bits} bits (expected u32 {expect_w:?})",
                    weight.dtype(),
                    weight.shape()
                ),
            });
        }
        for (n, a) in [("scales", Some(&scales)), ("biases", biases.as_ref())] {
            if let Some(a) = a.filter(|a| a.shape() != expect_s) {
                return Err(ModelError::Shape {
                    name: self.name(n),
                    expected: expect_s,
                    got: a.shape(),
                });
            }
        }
        Ok(mlx::Quantized {
            weight,
            scales,
            biases,
            group_size,
            bits,
            mode,
            panels: false,
        })
    }

    /// The float32 global scale of a quantized matrix here (NVIDIA's nvfp4 checkpoints,
    /// crate::prequant), shaped `[]` for one value, else `[per]` (`per`: the rows of a matrix,
    /// or the experts of a stack); `None` where there is none.
    fn global_scale(&self, per: i32) -> Result<Option<Array>> {
        if !self.has("global_scale") {
            return Ok(None);
        }
        let name = self.name("global_scale");
        let g = self.w.raw(&name)?;
        let shape = match g.size() {
            1 => vec![],
            n if n == per as usize => vec![per],
            _ => {
                return Err(ModelError::Tensor {
                    name,
                    message: format!(
                        "has shape {:?}: a global scale is one value or one per {per}",
                        g.shape()
                    ),
                })
            }
        };
        if !g.dtype().is_float() {
            return Err(ModelError::Tensor {
                name,
                message: format!("is {:?}, not floating point", g.dtype()),
            });
        }
        Ok(Some(self.w.keep(g.astype(Dtype::F32)?.reshape(&shape)?)))
    }

    /// The weight `[..lead, rows, cols]` at this path as values in the compute dtype: a
    /// quantized one dequantized (times its global scale), for the few matrices a model
    /// reshapes rather than multiplies as stored (MLA's `kv_b_proj`). Nothing of it stays
    /// handed out: the model keeps the tensors it makes from the values.
    pub fn weight_values(&self, lead: &[i32], rows: i32, cols: i32) -> Result<Array> {
        if !self.is_quantized() {
            let mut shape = lead.to_vec();
            shape.extend([rows, cols]);
            let w = self.get("weight", &shape)?;
            self.w.withdraw(&w);
            return Ok(w);
        }
        let q = self.quantized(lead, rows, cols)?;
        self.w.withdraw_quantized(&q);
        let values = q.dequantize()?;
        let per = if lead.is_empty() { rows } else { lead[0] };
        let values = match self.global_scale(per)? {
            // One value, one per row ([rows] → [rows, 1]) or one per leading entry.
            Some(g) if g.ndim() == 0 => values.multiply(&g)?,
            Some(g) if lead.is_empty() => values.multiply(&g.reshape(&[rows, 1])?)?,
            Some(g) => values.multiply(&g.reshape(&[lead[0], 1, 1])?)?,
            None => values,
        };
        Ok(values.astype(self.w.dtype)?)
    }

    /// A linear layer `[out, in]` at this path, dense or quantized.
    pub fn linear(&self, out: i32, inp: i32) -> Result<Linear> {
        if self.is_quantized() {
            let q = self.quantized(&[], out, inp)?;
            return Ok(match self.global_scale(out)? {
                Some(global) => Linear::Scaled { q, global },
                None => Linear::Quantized(self.w.paneled(q)?),
            });
        }
        Linear::dense(self.w, self.get("weight", &[out, inp])?)
    }

    /// Stacked expert matrices `[E, out, in]` at this path, dense or quantized.
    pub fn experts(&self, e: i32, out: i32, inp: i32) -> Result<Experts> {
        if self.is_quantized() {
            let q = self.quantized(&[e], out, inp)?;
            return Ok(match self.global_scale(e)? {
                Some(global) => Experts::Scaled { q, global },
                None => Experts::Quantized(q),
            });
        }
        let w = self.get("weight", &[e, out, inp])?;
        Experts::dense(self.w, w)
    }

    /// An embedding table `[vocab, dim]` at this path, dense or quantized.
    pub fn embedding(&self, vocab: i32, dim: i32) -> Result<Embedding> {
        if self.is_quantized() {
            let q = self.quantized(&[], vocab, dim)?;
            return Ok(match self.global_scale(1)? {
                Some(global) => Embedding::Scaled { q, global },
                None => Embedding::Quantized(q),
            });
        }
        Ok(Embedding::Dense(self.get("weight", &[vocab, dim])?))
    }
}

#[cfg(test)]
mod tests {
    use super::{ollama_quant, QuantParams};
    use mlx::QuantMode;

    #[test]
    fn ollama_quantization_types() {
        let p = |group_size, bits, mode| {
            Ok(QuantParams {
                group_size,
                bits,
                mode,
            })
        };
        assert_eq!(ollama_quant("int4", None), p(64, 4, QuantMode::Affine));
        assert_eq!(
            ollama_quant("int8", Some("32")),
            p(32, 8, QuantMode::Affine)
        );
        assert_eq!(ollama_quant("Q8", None), p(64, 8, QuantMode::Affine));
        assert_eq!(
            ollama_quant("nvfp4", Some("16")),
            p(16, 4, QuantMode::Nvfp4)
        );
        assert_eq!(ollama_quant("MXFP4", None), p(32, 4, QuantMode::Mxfp4));
        assert_eq!(ollama_quant("mxfp8", None), p(32, 8, QuantMode::Mxfp8));
        let e = ollama_quant("q3_k", None).unwrap_err();
        assert!(e.contains("\"q3_k\"") && e.contains("nvfp4"), "{e}");
        assert!(ollama_quant("int4", Some("x"))
            .unwrap_err()
            .contains("\"x\""));
    }
}
