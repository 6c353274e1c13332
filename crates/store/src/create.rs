//! `create`: a Modelfile's FROM (and DRAFT) checkpoints into the store as one named model.
//!
//! The pipeline: parse the Modelfile; resolve FROM and DRAFT (a checkpoint directory or a
//! stored model); build both models without reading weights (every tensor checked by name and
//! shape, the draft against the target); then, holding the store's write lock, write one blob
//! per module (read, rearrange to the stacked layouts the quantized kernels need, quantize,
//! serialize), the JSON files, the Modelfile's parts and the model config; load the result back
//! the same way as a check; and only then point the name at it. Draft tensors and files are
//! stored under `draft.` and `draft/`, as ollama stores them.

use crate::manifest::{media, DraftInfo, Layer, Manifest, ModelConfig, Part, Quantization};
use crate::modelfile::{resolve, Located, Modelfile, Source};
use crate::name::ModelName;
use crate::quant::{decide, Decision, QuantType, GROUP_SIZE};
use crate::store::{Store, WriteLock};
use crate::{Result, StoreError};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use mlx::{Array, Dtype};
use models::{ModelFiles, CHECKPOINT_FILES};
use serde_json::Value;
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

#[derive(Debug, Clone, Default)]
pub struct CreateOptions {
    pub quantize: Option<QuantType>,
    pub quantize_draft: Option<QuantType>,
}

/// What `create` did.
#[derive(Debug, Clone)]
pub struct CreateReport {
    pub digest: String,
    pub layers: usize,
    pub bytes: u64,
    pub config: ModelConfig,
    /// Blobs no model used any more (a replaced model's, a killed run's), removed.
    pub removed_blobs: usize,
}

/// Creates (or replaces) `name` from the Modelfile at `modelfile`.
pub fn create(
    store: &Store,
    name: &ModelName,
    modelfile: &Path,
    opts: &CreateOptions,
) -> Result<CreateReport> {
    let text = std::fs::read_to_string(modelfile).map_err(|source| StoreError::Io {
        path: modelfile.to_path_buf(),
        cause: source,
    })?;
    let mf: Modelfile = text.parse().map_err(|error| StoreError::Modelfile {
        path: modelfile.to_path_buf(),
        error,
    })?;
    let base = modelfile
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    create_from(store, name, &mf, base, opts)
}

/// A FROM or DRAFT resolved to files.
struct Input {
    files: ModelFiles,
    /// What the Modelfile said.
    source: String,
    /// A canonical identity, to refuse DRAFT = FROM.
    identity: String,
    /// A stored model's draft and Modelfile, which a model made FROM it inherits.
    stored: Option<(Option<Box<Input>>, Modelfile)>,
}

fn input(store: &Store, base: &Path, at: &Located, what: &str) -> Result<Input> {
    let located = |message: String| StoreError::Invalid(format!("line {}: {message}", at.line));
    match resolve(base, &at.value) {
        Source::Dir(dir) => {
            if !dir.join("config.json").is_file() {
                return Err(located(format!(
                    "{what} {} is not a safetensors model directory (no config.json)",
                    dir.display()
                )));
            }
            let canonical = std::fs::canonicalize(&dir).unwrap_or_else(|_| dir.clone());
            Ok(Input {
                files: ModelFiles::dir(&dir)?,
                source: at.value.clone(),
                identity: canonical.display().to_string(),
                stored: None,
            })
        }
        Source::Name(n) => {
            let parsed: ModelName = n.parse().map_err(|e: String| {
                located(format!(
                    "{what} {n:?} is neither a directory nor a model name: {e}"
                ))
            })?;
            let resolved = store.resolve(&parsed).map_err(|e| match e {
                StoreError::NotFound(_) => located(format!(
                    "{what} {n:?}: no such directory, and no stored model of that name"
                )),
                other => other,
            })?;
            // Its blobs are read again below: they must be what the manifest says.
            resolved.target.verify()?;
            let modelfile = crate::show::modelfile(store, &resolved)?;
            let draft = match (resolved.draft, &resolved.config.draft) {
                (Some(files), Some(info)) => {
                    files.verify()?;
                    Some(Box::new(Input {
                        files,
                        source: info.part.source.clone(),
                        identity: format!("model:{parsed}/draft"),
                        stored: None,
                    }))
                }
                _ => None,
            };
            Ok(Input {
                files: resolved.target,
                source: at.value.clone(),
                identity: format!("model:{parsed}"),
                stored: Some((draft, modelfile)),
            })
        }
    }
}

/// [`create`] from a parsed Modelfile whose paths are relative to `base`.
pub fn create_from(
    store: &Store,
    name: &ModelName,
    mf: &Modelfile,
    base: &Path,
    opts: &CreateOptions,
) -> Result<CreateReport> {
    let from = mf
        .from
        .as_ref()
        .ok_or_else(|| StoreError::Invalid("the Modelfile has no FROM".into()))?;
    let mut target_in = input(store, base, from, "FROM")?;
    let mut mf = mf.clone();
    let mut draft_in = match &mf.draft {
        Some(d) => {
            let i = input(store, base, d, "DRAFT")?;
            if i.identity == target_in.identity {
                return Err(StoreError::Invalid(format!(
                    "line {}: DRAFT is the same model as FROM; a draft must be a smaller model",
                    d.line
                )));
            }
            Some(i)
        }
        None => None,
    };
    // FROM a stored model brings what it carries (its draft, parameters, template, ...) where
    // this Modelfile does not say otherwise.
    if let Some((inherited_draft, base_mf)) = target_in.stored.take() {
        inherit(&mut mf, base_mf);
        if draft_in.is_none() {
            draft_in = inherited_draft.map(|d| *d);
        }
    }
    if opts.quantize_draft.is_some() && draft_in.is_none() {
        return Err(StoreError::Invalid(
            "--quantize-draft needs a DRAFT line in the Modelfile".into(),
        ));
    }
    let mf = &mf;

    // Everything is checked before the store is touched.
    let target = models::inspect(&target_in.files)?;
    check_quantizable(&target_in, opts.quantize, "--quantize")?;
    if let Some(d) = &draft_in {
        models::inspect_draft(&d.files, &target)
            .map_err(|e| StoreError::Invalid(format!("DRAFT {}: {e}", d.source)))?;
        check_quantizable(d, opts.quantize_draft, "--quantize-draft")?;
    }
    drop(target);

    let lock = store.lock()?;
    let mut layers = Vec::new();
    let target_part = import(store, &lock, &target_in, opts.quantize, "", "", &mut layers)?;
    let draft = match &draft_in {
        Some(d) => Some(DraftInfo {
            part: import(
                store,
                &lock,
                d,
                opts.quantize_draft,
                "draft.",
                "draft/",
                &mut layers,
            )?,
            tensor_prefix: "draft.".into(),
            config: "draft/config.json".into(),
        }),
        None => None,
    };
    modelfile_layers(store, &lock, mf, &mut layers)?;
    let config = ModelConfig {
        part: target_part,
        draft,
        // ollama serves a safetensors model only for what it lists.
        capabilities: vec!["completion".into()],
        renderer: String::new(),
        parser: String::new(),
    };
    let config_layer = store.write_blob(
        &lock,
        media::CONFIG,
        &serde_json::to_vec(&config).expect("configs serialize"),
    )?;
    let manifest = Manifest::new(config_layer, layers);

    // Load what was written the way the runner will, before the name points at it.
    let (t, d) = store.files_of(name, &manifest, &config)?;
    let written = models::inspect(&t)?;
    if let Some(d) = &d {
        models::inspect_draft(d, &written)?;
    }
    drop(written);

    let digest = store.write_manifest(&lock, name, &manifest)?;
    let (removed_blobs, _) = store.collect_garbage(&lock)?;
    Ok(CreateReport {
        digest,
        layers: manifest.layers.len(),
        bytes: manifest.all_layers().map(|l| l.size).sum(),
        config,
        removed_blobs,
    })
}

fn inherit(mf: &mut Modelfile, base: Modelfile) {
    for (k, v) in base.parameters {
        mf.parameters.entry(k).or_insert(v);
    }
    if mf.template.is_none() {
        mf.template = base.template;
    }
    if mf.system.is_none() {
        mf.system = base.system;
    }
    if mf.messages.is_empty() {
        mf.messages = base.messages;
    }
    if mf.license.is_empty() {
        mf.license = base.license;
    }
}

fn modelfile_layers(
    store: &Store,
    lock: &WriteLock,
    mf: &Modelfile,
    layers: &mut Vec<Layer>,
) -> Result<()> {
    let mut push = |media_type: &str, bytes: Vec<u8>| -> Result<()> {
        layers.push(store.write_blob(lock, media_type, &bytes)?);
        Ok(())
    };
    if !mf.parameters.is_empty() {
        push(media::PARAMS, serde_json::to_vec(&mf.parameters).unwrap())?;
    }
    if let Some(t) = &mf.template {
        push(media::TEMPLATE, t.clone().into_bytes())?;
    }
    if let Some(s) = &mf.system {
        push(media::SYSTEM, s.clone().into_bytes())?;
    }
    if !mf.messages.is_empty() {
        push(media::MESSAGES, serde_json::to_vec(&mf.messages).unwrap())?;
    }
    for l in &mf.license {
        push(media::LICENSE, l.clone().into_bytes())?;
    }
    Ok(())
}

/// How one stored module is made from checkpoint tensors.
enum Build {
    /// Tensors stored as they are (a module's weight, or an already quantized triple).
    Copy(Vec<String>),
    Rename {
        src: String,
        out: String,
    },
    /// A fused `[E, 2I, H]` gate/up tensor split into its halves along axis 1.
    SplitHalves {
        src: String,
        outs: [String; 2],
    },
    /// One matrix per expert stacked into `[E, out, in]`.
    Stack {
        srcs: Vec<String>,
        out: String,
    },
    /// MLA's `kv_b_proj` split into mlx-lm's per-head `embed_q` (`W_UKᵀ`) and `unembed_out`.
    KvbSplit {
        src: String,
        embed_q: String,
        unembed_out: String,
        heads: i32,
        nope: i32,
    },
}

impl Build {
    fn sources(&self) -> Vec<&str> {
        match self {
            Build::Copy(v) => v.iter().map(String::as_str).collect(),
            Build::Rename { src, .. }
            | Build::SplitHalves { src, .. }
            | Build::KvbSplit { src, .. } => vec![src.as_str()],
            Build::Stack { srcs, .. } => srcs.iter().map(String::as_str).collect(),
        }
    }

    /// The output tensors, by name.
    fn run(&self, t: &HashMap<String, Array>) -> Result<Vec<(String, Array)>> {
        let get = |n: &str| t[n].clone();
        Ok(match self {
            Build::Copy(names) => names.iter().map(|n| (n.clone(), get(n))).collect(),
            Build::Rename { src, out } => vec![(out.clone(), get(src))],
            Build::SplitHalves { src, outs } => {
                let parts = get(src).split(2, 1)?;
                vec![
                    (outs[0].clone(), parts[0].clone()),
                    (outs[1].clone(), parts[1].clone()),
                ]
            }
            Build::Stack { srcs, out } => {
                let arrays: Vec<Array> = srcs.iter().map(|s| get(s)).collect();
                let refs: Vec<&Array> = arrays.iter().collect();
                vec![(out.clone(), mlx::stack(&refs, 0)?)]
            }
            Build::KvbSplit {
                src,
                embed_q,
                unembed_out,
                heads,
                nope,
            } => {
                let w = get(src);
                let r = w.dim(-1)?;
                let parts = w.reshape(&[*heads, -1, r])?.split_at(&[*nope], 1)?;
                vec![
                    (embed_q.clone(), parts[0].swapaxes(-1, -2)?.contiguous()?),
                    (unembed_out.clone(), parts[1].contiguous()?),
                ]
            }
        })
    }
}

/// `model.layers.3.mlp.experts.7.up_proj.weight` → (`model.layers.3.mlp`, 7, `up_proj`).
fn per_expert(name: &str) -> Option<(&str, usize, &str)> {
    let rest = name.strip_suffix(".weight")?;
    let (head, proj) = rest.rsplit_once('.')?;
    let (head, idx) = head.rsplit_once('.')?;
    let mlp = head.strip_suffix(".experts")?;
    Some((mlp, idx.parse().ok()?, proj))
}

fn int_field(cfg: &Value, key: &str) -> Option<i32> {
    cfg.get(key)
        .or_else(|| cfg.get("text_config").and_then(|t| t.get(key)))
        .and_then(Value::as_i64)
        .map(|v| v as i32)
}

/// The modules of a checkpoint, rearranged where the quantized kernels need stacked layouts
/// (the same rearrangements mlx-lm's conversion makes), everything else as it is.
fn plan(tensors: &HashMap<String, Array>, cfg: &Value) -> Vec<Build> {
    let mut names: Vec<&String> = tensors.keys().collect();
    names.sort();
    let mut builds = Vec::new();
    let mut stacks: BTreeMap<(String, String), BTreeMap<usize, String>> = BTreeMap::new();
    let mut modules: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mla = (
        int_field(cfg, "num_attention_heads"),
        int_field(cfg, "qk_nope_head_dim"),
    );
    for name in names {
        if let Some((mlp, i, proj)) = per_expert(name) {
            stacks
                .entry((mlp.to_string(), proj.to_string()))
                .or_default()
                .insert(i, name.clone());
            continue;
        }
        if let Some(p) = name.strip_suffix(".experts.gate_up_proj") {
            let dir = if p.ends_with(".mlp") {
                format!("{p}.switch_mlp")
            } else {
                format!("{p}.experts.switch_glu")
            };
            builds.push(Build::SplitHalves {
                src: name.clone(),
                outs: [
                    format!("{dir}.gate_proj.weight"),
                    format!("{dir}.up_proj.weight"),
                ],
            });
            continue;
        }
        if let Some(p) = name.strip_suffix(".experts.down_proj") {
            let out = if p.ends_with(".mlp") {
                format!("{p}.switch_mlp.down_proj.weight")
            } else {
                format!("{p}.experts.switch_glu.down_proj.weight")
            };
            builds.push(Build::Rename {
                src: name.clone(),
                out,
            });
            continue;
        }
        if let (Some(p), (Some(heads), Some(nope))) = (name.strip_suffix(".kv_b_proj.weight"), mla)
        {
            if tensors[name].dtype().is_float() && tensors[name].ndim() == 2 {
                builds.push(Build::KvbSplit {
                    src: name.clone(),
                    embed_q: format!("{p}.embed_q.weight"),
                    unembed_out: format!("{p}.unembed_out.weight"),
                    heads,
                    nope,
                });
                continue;
            }
        }
        let module = ["weight", "scales", "biases"]
            .iter()
            .find_map(|leaf| name.strip_suffix(&format!(".{leaf}")))
            .unwrap_or(name);
        modules
            .entry(module.to_string())
            .or_default()
            .push(name.clone());
    }
    for ((mlp, proj), experts) in stacks {
        // Only a complete 0..E run is stacked; anything else is stored as found.
        let complete = experts.keys().copied().eq(0..experts.len());
        if complete {
            builds.push(Build::Stack {
                srcs: experts.into_values().collect(),
                out: format!("{mlp}.switch_mlp.{proj}.weight"),
            });
        } else {
            builds.extend(experts.into_values().map(|n| Build::Copy(vec![n])));
        }
    }
    // A module whose parts are not an mlx-lm quantized triple is stored tensor by tensor.
    for (_, parts) in modules {
        let quantized = parts.iter().any(|p| p.ends_with(".scales"));
        if quantized {
            builds.push(Build::Copy(parts));
        } else {
            builds.extend(parts.into_iter().map(|p| Build::Copy(vec![p])));
        }
    }
    builds
}

fn file_type(counts: &BTreeMap<String, u64>) -> String {
    counts
        .iter()
        .max_by_key(|(_, n)| **n)
        .map(|(t, _)| t.clone())
        .unwrap_or_else(|| "F32".into())
}

pub(crate) fn dtype_label(d: Dtype) -> String {
    match d {
        Dtype::F32 => "F32".into(),
        Dtype::F16 => "F16".into(),
        Dtype::Bf16 => "BF16".into(),
        other => format!("{other:?}").to_uppercase(),
    }
}

fn progress(total: u64, prefix: &str) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
    bar.set_style(
        ProgressStyle::with_template(
            "{prefix:>6} [{bar:32}] {bytes:>10}/{total_bytes:10} {wide_msg}",
        )
        .expect("a valid template")
        .progress_chars("=> "),
    );
    bar.set_prefix(prefix.to_string());
    bar
}

/// The quantization block of a checkpoint that came quantized (mlx-lm's format).
fn prequantized(cfg: &Value) -> Option<Value> {
    cfg.get("quantization")
        .or_else(|| cfg.get("quantization_config"))
        .filter(|q| !q.is_null())
        .cloned()
}

/// Refuses to quantize a checkpoint that already is.
fn check_quantizable(input: &Input, quant: Option<QuantType>, flag: &str) -> Result<()> {
    let cfg = models::JsonFile::read(input.files.config()?)?;
    if let (Some(q), Some(want)) = (prequantized(&cfg.value), quant) {
        let bits = q.get("bits").and_then(Value::as_i64).unwrap_or(0);
        return Err(StoreError::Invalid(format!(
            "{} is already quantized ({bits}-bit); create it without {flag} {}",
            input.source,
            want.name()
        )));
    }
    Ok(())
}

/// Writes one model's blobs (tensors under `tensor_prefix`, files under `file_prefix`) and
/// describes what was stored.
fn import(
    store: &Store,
    lock: &WriteLock,
    input: &Input,
    quant: Option<QuantType>,
    tensor_prefix: &str,
    file_prefix: &str,
    layers: &mut Vec<Layer>,
) -> Result<Part> {
    let cfg_file = models::JsonFile::read(input.files.config()?)?;
    let mut cfg = cfg_file.value.clone();
    let prequantized = prequantized(&cfg);

    let tensors = models::weights::read_tensors(&input.files)?;
    let builds = plan(&tensors, &cfg);
    let total: u64 = tensors.values().map(|a| a.nbytes() as u64).sum();
    let bar = progress(
        total,
        if tensor_prefix.is_empty() {
            "model"
        } else {
            "draft"
        },
    );
    let mut unquantized = Vec::new();
    let mut dtype_bytes: BTreeMap<String, u64> = BTreeMap::new();
    let mut params: u64 = 0;
    let prequant_bits = prequantized
        .as_ref()
        .and_then(|q| q.get("bits"))
        .and_then(Value::as_i64)
        .unwrap_or(32) as u64;
    for b in &builds {
        let outputs = b.run(&tensors)?;
        let label = outputs.first().map(|(n, _)| n.clone()).unwrap_or_default();
        bar.set_message(label);
        for (name, a) in outputs {
            let mut parts: Vec<(String, Array)> = Vec::new();
            let decision = match quant {
                Some(_) => decide(&name, &a),
                None => Decision::Keep,
            };
            if a.dtype().is_float() && !name.ends_with(".scales") && !name.ends_with(".biases") {
                params += a.size() as u64;
                *dtype_bytes.entry(dtype_label(a.dtype())).or_default() += a.nbytes() as u64;
            } else if a.dtype() == Dtype::U32 && name.ends_with(".weight") {
                params += a.size() as u64 * 32 / prequant_bits;
            }
            match (decision, quant) {
                (Decision::Quantize, Some(q)) => {
                    let module = name.strip_suffix(".weight").expect("decide checks");
                    let qa = a.quantize(GROUP_SIZE, q.bits())?;
                    parts.push((format!("{module}.weight"), qa.weight));
                    parts.push((format!("{module}.scales"), qa.scales));
                    parts.push((format!("{module}.biases"), qa.biases));
                }
                (Decision::KeepShape, _) => {
                    unquantized.push(name.clone());
                    parts.push((name, a));
                }
                _ => parts.push((name, a)),
            }
            let layer_name = format!("{tensor_prefix}{}", parts[0].0);
            let named: Vec<(String, &Array)> = parts
                .iter()
                .map(|(n, a)| (format!("{tensor_prefix}{n}"), a))
                .collect();
            let refs: Vec<(&str, &Array)> = named.iter().map(|(n, a)| (n.as_str(), *a)).collect();
            let bytes = mlx::io::serialize_safetensors(&refs, None)?;
            let mut layer = store.write_blob(lock, media::TENSOR, &bytes)?;
            layer.name = Some(layer_name);
            layers.push(layer);
        }
        let read: u64 = b
            .sources()
            .iter()
            .map(|s| tensors[*s].nbytes() as u64)
            .sum();
        bar.inc(read);
    }
    bar.finish_and_clear();

    // config.json says how the stored matrices are quantized; other files go as they are.
    let quantization = match (quant, &prequantized) {
        (Some(q), _) => {
            let block = serde_json::json!({
                "group_size": GROUP_SIZE, "bits": q.bits(), "mode": "affine"
            });
            if let Some(o) = cfg.as_object_mut() {
                o.insert("quantization".into(), block.clone());
                o.insert("quantization_config".into(), block);
            }
            Some(Quantization {
                kind: q.name().into(),
                bits: q.bits(),
                group_size: GROUP_SIZE,
                mode: "affine".into(),
                unquantized,
            })
        }
        (None, Some(q)) => Some(Quantization {
            kind: "mlx-lm".into(),
            bits: q.get("bits").and_then(Value::as_i64).unwrap_or(0) as i32,
            group_size: q.get("group_size").and_then(Value::as_i64).unwrap_or(0) as i32,
            mode: q
                .get("mode")
                .and_then(Value::as_str)
                .unwrap_or("affine")
                .into(),
            unquantized: Vec::new(),
        }),
        (None, None) => None,
    };
    for name in CHECKPOINT_FILES {
        let Some(path) = input.files.file(name) else {
            continue;
        };
        let bytes = if *name == "config.json" {
            serde_json::to_vec_pretty(&cfg).expect("JSON serializes")
        } else {
            std::fs::read(path).map_err(|source| StoreError::Io {
                path: path.to_path_buf(),
                cause: source,
            })?
        };
        let mut layer = store.write_blob(lock, media::JSON, &bytes)?;
        layer.name = Some(format!("{file_prefix}{name}"));
        layers.push(layer);
    }

    let model_type = cfg_file.model_type()?;
    let architecture = cfg
        .get("architectures")
        .and_then(|a| a.get(0))
        .and_then(Value::as_str)
        .unwrap_or(&model_type)
        .to_string();
    let file_type = match &quantization {
        Some(q) => format!("Q{}", q.bits),
        None => file_type(&dtype_bytes),
    };
    let layers = int_field(&cfg, "num_hidden_layers").unwrap_or(0);
    let mtp = int_field(&cfg, "num_nextn_predict_layers").unwrap_or(0);
    let mtp_layers = (0..mtp)
        .filter(|i| {
            let prefix = format!("model.layers.{}.", layers + i);
            tensors.keys().any(|k| k.starts_with(&prefix))
        })
        .count() as u32;
    Ok(Part {
        mtp_layers,
        model_format: "safetensors".into(),
        architecture,
        model_type,
        file_type,
        parameter_count: params,
        quantization,
        source: input.source.clone(),
    })
}
