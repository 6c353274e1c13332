//! `create`: a Modelfile's FROM (and DRAFT) checkpoints into the store as one named model, in
//! the layout `ollama create --experimental` writes (../../docs/STORE.md), so that ollama's
//! runner loads what we write and we load what it writes.
//!
//! The pipeline: parse the Modelfile; resolve FROM and DRAFT (a checkpoint directory or a
//! stored model); build both models without reading weights (every tensor checked by name and
//! shape, the draft against the target); then, holding the store's write lock, write the
//! tensor blobs ([`crate::tensors`]: one per tensor, quantized by ollama's mixed-precision
//! policy when asked), the checkpoint's JSON files byte for byte, the Modelfile's parts and
//! ollama's config blob; load the result back the same way as a check; and only then point the
//! name at it. Draft tensors and files are stored under `draft.` and `draft/`. A part taken
//! from a stored model unchanged reuses its blobs.

use crate::tensors::{self as import, Inventory};
use crate::Result;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use models::ModelFiles;
use serde_json::Value;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use store::manifest::{media, ConfigV2, DraftV2, Layer, Manifest, ModelConfig};
use store::modelfile::{resolve, Located, Modelfile, Source};
use store::quant::{architecture, Policy, QuantType};
use store::{CreateOptions, CreateReport, ModelName, PartSummary, Store, StoreError, WriteLock};

/// The version of ollama that reads safetensors models (`MinOllamaVersion`).
const REQUIRES: &str = "0.19.0";

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
    /// The checkpoint's JSON files (and chat template), by name, sorted.
    json: Vec<(String, PathBuf)>,
    /// A stored model's own layers for this part (reused when nothing changes) and its
    /// `file_type`.
    stored_layers: Option<(Vec<Layer>, String)>,
    /// A stored model's draft and Modelfile, which a model made FROM it inherits.
    inherits: Option<(Option<Box<Input>>, Modelfile)>,
}

/// The files of a checkpoint directory that go into the store besides its weights: every
/// `*.json` but the shard index (as ollama stores them), and `chat_template.jinja`, which
/// ollama leaves out (it renders prompts with built-in renderers) but a server rendering the
/// model's own template needs.
fn checkpoint_files(dir: &Path) -> Result<Vec<(String, PathBuf)>> {
    let entries = std::fs::read_dir(dir).map_err(|cause| StoreError::Io {
        path: dir.to_path_buf(),
        cause,
    })?;
    let mut out: Vec<(String, PathBuf)> = entries
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
        .filter_map(|e| Some((e.file_name().into_string().ok()?, e.path())))
        .filter(|(n, _)| {
            (n.ends_with(".json") && n != "model.safetensors.index.json")
                || n == "chat_template.jinja"
        })
        .collect();
    out.sort();
    Ok(out)
}

/// The layers of a stored model's part: its tensor blobs and files, in manifest order.
fn part_layers(manifest: &Manifest, draft: bool, tensor_prefix: &str) -> Vec<Layer> {
    manifest
        .layers
        .iter()
        .filter(|l| {
            let n = l.name.as_deref().unwrap_or_default();
            match l.media_type.as_str() {
                media::TENSOR => n.starts_with(tensor_prefix) == draft,
                media::JSON => n.starts_with("draft/") == draft,
                _ => false,
            }
        })
        .cloned()
        .collect()
}

fn input(store: &Store, base: &Path, at: &Located, what: &str) -> Result<Input> {
    let located = |message: String| StoreError::Invalid(format!("line {}: {message}", at.line));
    match resolve(base, &at.value) {
        Source::Dir(dir) => {
            if !dir.join("config.json").is_file() {
                return Err(crate::ImportError::Store(located(format!(
                    "{what} {} is not a safetensors model directory (no config.json)",
                    dir.display()
                ))));
            }
            let canonical = std::fs::canonicalize(&dir).unwrap_or_else(|_| dir.clone());
            Ok(Input {
                files: ModelFiles::dir(&dir)?,
                source: at.value.clone(),
                identity: canonical.display().to_string(),
                json: checkpoint_files(&dir)?,
                stored_layers: None,
                inherits: None,
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
            let modelfile = store::show::modelfile(store, &resolved)?;
            let sorted = |files: &ModelFiles| {
                let mut v: Vec<(String, PathBuf)> = files
                    .files
                    .iter()
                    .map(|(k, p)| (k.clone(), p.clone()))
                    .collect();
                v.sort();
                v
            };
            let draft = match (resolved.draft, &resolved.config.draft) {
                (Some(files), Some(info)) => {
                    files.verify()?;
                    let source = match info.part.source.as_str() {
                        "" => format!("the draft of {parsed}"),
                        s => s.to_string(),
                    };
                    Some(Box::new(Input {
                        json: sorted(&files),
                        stored_layers: Some((
                            part_layers(&resolved.manifest, true, &info.tensor_prefix),
                            info.part.file_type.clone(),
                        )),
                        files,
                        source,
                        identity: format!("model:{parsed}/draft"),
                        inherits: None,
                    }))
                }
                _ => None,
            };
            let prefix = resolved
                .config
                .draft
                .as_ref()
                .map_or("draft.", |d| d.tensor_prefix.as_str());
            Ok(Input {
                json: sorted(&resolved.target),
                stored_layers: Some((
                    part_layers(&resolved.manifest, false, prefix),
                    resolved.config.part.file_type.clone(),
                )),
                files: resolved.target,
                source: at.value.clone(),
                identity: format!("model:{parsed}"),
                inherits: Some((draft, modelfile)),
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
            let mut i = input(store, base, d, "DRAFT")?;
            if i.identity == target_in.identity {
                return Err(crate::ImportError::Store(StoreError::Invalid(format!(
                    "line {}: DRAFT is the same model as FROM; a draft must be a smaller model",
                    d.line
                ))));
            }
            // A stored model's tensors become a draft's under a new prefix: rewritten.
            i.stored_layers = None;
            Some(i)
        }
        None => None,
    };
    // FROM a stored model brings what it carries (its draft, parameters, template, ...) where
    // this Modelfile does not say otherwise.
    if let Some((inherited_draft, base_mf)) = target_in.inherits.take() {
        inherit(&mut mf, base_mf);
        if draft_in.is_none() {
            draft_in = inherited_draft.map(|d| *d);
        }
    }
    if opts.quantize_draft.is_some() && draft_in.is_none() {
        return Err(crate::ImportError::Store(StoreError::Invalid(
            "--quantize-draft needs a DRAFT line in the Modelfile".into(),
        )));
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
    let file_type = import_part(store, &lock, &target_in, opts.quantize, false, &mut layers)?;
    let target_cfg = models::JsonFile::read(target_in.files.config()?)?.value;
    let mut draft_file_type = String::new();
    let draft = match &draft_in {
        Some(d) => {
            draft_file_type = import_part(store, &lock, d, opts.quantize_draft, true, &mut layers)?;
            let cfg = models::JsonFile::read(d.files.config()?)?.value;
            Some(DraftV2 {
                model_format: "safetensors".into(),
                architecture: architecture(&cfg),
                tensor_prefix: "draft.".into(),
                config: "draft/config.json".into(),
            })
        }
        None => None,
    };
    modelfile_layers(store, &lock, mf, &mut layers)?;
    let family = family(&target_cfg);
    let config = ConfigV2 {
        model_format: "safetensors".into(),
        model_family: String::new(),
        model_families: None,
        model_type: String::new(),
        file_type,
        renderer: family.clone(),
        parser: family.clone(),
        requires: REQUIRES.into(),
        capabilities: capabilities(&target_cfg, &target_in, !family.is_empty()),
        draft,
        architecture: String::new(),
        os: String::new(),
    };
    let config_bytes = serde_json::to_vec(&config).expect("configs serialize");
    let config_layer = store.write_blob(&lock, media::CONFIG, &config_bytes)?;
    let config: ModelConfig = serde_json::from_slice(&config_bytes).expect("our config parses");
    let manifest = Manifest::new(config_layer, layers);

    // Load what was written the way the runner will, before the name points at it.
    let (t, d) = store.files_of(name, &manifest, &config)?;
    let written = models::inspect(&t)?;
    if let Some(d) = &d {
        models::inspect_draft(d, &written)?;
    }
    drop(written);
    let target = summary(&t, &config.part.file_type)?;
    let draft = match &d {
        Some(files) => Some(summary(files, &draft_file_type)?),
        None => None,
    };

    let digest = store.write_manifest(&lock, name, &manifest)?;
    let (removed_blobs, _) = store.collect_garbage(&lock)?;
    Ok(CreateReport {
        digest,
        layers: manifest.layers.len(),
        bytes: manifest.all_layers().map(|l| l.size).sum(),
        config,
        target,
        draft,
        removed_blobs,
    })
}

fn summary(files: &ModelFiles, file_type: &str) -> Result<PartSummary> {
    let cfg = models::JsonFile::read(files.config()?)?.value;
    let mut precisions = BTreeMap::new();
    for t in store::show::precisions(files)? {
        *precisions.entry(t.precision).or_default() += 1;
    }
    Ok(PartSummary {
        architecture: architecture(&cfg),
        file_type: file_type.to_string(),
        precisions,
    })
}

/// ollama's renderer and parser for the model's family (`x/create/client/create.go`); the
/// families mlx-runner loads have one name for both.
fn family(cfg: &Value) -> String {
    let mut ids: Vec<String> = cfg
        .get("architectures")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .map(str::to_lowercase)
        .collect();
    for v in [cfg.get("model_type"), cfg.pointer("/llm_config/model_type")] {
        ids.extend(v.and_then(Value::as_str).map(str::to_lowercase));
    }
    ids.iter()
        .find_map(|s| {
            if s.contains("gemma4") {
                Some("gemma4")
            } else if s.contains("glm4") || s.contains("glm-4") {
                Some("glm-4.7")
            } else {
                None
            }
        })
        .unwrap_or_default()
        .to_string()
}

/// What ollama serves the model for (`inferSafetensorsCapabilities`): completion; vision and
/// audio when the config has those towers; tools and thinking from the family's parser (both
/// of ours have them) or a template that thinks.
fn capabilities(cfg: &Value, input: &Input, parser: bool) -> Vec<String> {
    let present = |k: &str| cfg.get(k).is_some_and(|v| !v.is_null());
    let mut caps = vec!["completion".to_string()];
    if present("vision_config") || cfg.get("has_vision") == Some(&Value::Bool(true)) {
        caps.push("vision".into());
    }
    if present("audio_config") || present("sound_config") {
        caps.push("audio".into());
    }
    if parser {
        caps.push("tools".into());
    }
    let template = chat_template(input);
    let thinks = template.contains("<think>") && template.contains("</think>");
    if parser || thinks {
        caps.push("thinking".into());
    }
    caps
}

/// The chat template: tokenizer_config.json's, else chat_template.jinja.
fn chat_template(input: &Input) -> String {
    let file = |n: &str| {
        input
            .json
            .iter()
            .find(|(name, _)| name == n)
            .and_then(|(_, p)| std::fs::read_to_string(p).ok())
    };
    file("tokenizer_config.json")
        .and_then(|t| serde_json::from_str::<Value>(&t).ok())
        .and_then(|v| v.get("chat_template")?.as_str().map(String::from))
        .filter(|t| !t.is_empty())
        .or_else(|| file("chat_template.jinja"))
        .unwrap_or_default()
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

/// The Modelfile's layers, in ollama's order (`createModelfileLayers`): template, system,
/// licenses, then (ours) messages, then the parameters, JSON-encoded with a newline as Go's
/// encoder ends it.
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
    if let Some(t) = &mf.template {
        push(media::TEMPLATE, t.clone().into_bytes())?;
    }
    if let Some(s) = &mf.system {
        push(media::SYSTEM, s.clone().into_bytes())?;
    }
    for l in &mf.license {
        push(media::LICENSE, l.clone().into_bytes())?;
    }
    if !mf.messages.is_empty() {
        push(media::MESSAGES, serde_json::to_vec(&mf.messages).unwrap())?;
    }
    if !mf.parameters.is_empty() {
        let mut bytes = serde_json::to_vec(&mf.parameters).unwrap();
        bytes.push(b'\n');
        push(media::PARAMS, bytes)?;
    }
    Ok(())
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

/// A part's tensors as `create` reads them.
struct Part {
    tensors: models::weights::Tensors,
    /// How each module that is already quantized is: from the blob metadata (ollama's layout)
    /// or config.json's block (mlx-lm's).
    quantized: models::weights::ModuleQuant,
    /// The weights that were block-FP8, decoded to bfloat16: they become mxfp8.
    decoded_fp8: Vec<String>,
}

fn read_part(input: &Input) -> Result<Part> {
    let checkpoint = models::weights::read_checkpoint(&input.files)?;
    let (tensors, from_blobs) = (checkpoint.tensors, checkpoint.quant);
    let cfg = models::JsonFile::read(input.files.config()?)?.value;
    let block = models::weights::QuantConfig::of_config(&cfg).map_err(|message| {
        StoreError::Invalid(format!("{}: config.json: {message}", input.source))
    })?;
    let mut quantized = HashMap::new();
    for name in tensors.keys() {
        let Some(module) = name.strip_suffix(".scales") else {
            continue;
        };
        let params = from_blobs
            .get(module)
            .copied()
            .or_else(|| block.as_ref().and_then(|b| b.module_params(module)));
        match params {
            Some(p) => {
                quantized.insert(module.to_string(), p);
            }
            None => {
                return Err(crate::ImportError::Store(StoreError::Invalid(format!(
                    "{}: {name} has scales but nothing says how {module} is quantized",
                    input.source
                ))))
            }
        }
    }
    Ok(Part {
        tensors,
        quantized,
        decoded_fp8: checkpoint.decoded_fp8,
    })
}

/// The most common type among already quantized modules (`""` for none).
fn common_type(quantized: &models::weights::ModuleQuant) -> String {
    let mut counts: BTreeMap<String, usize> = BTreeMap::new();
    for q in quantized.values() {
        *counts
            .entry(store::quant::type_name(q.mode.name(), q.bits, q.group_size))
            .or_default() += 1;
    }
    counts
        .into_iter()
        .max_by_key(|(_, n)| *n)
        .map(|(name, _)| name)
        .unwrap_or_default()
}

/// Refuses to quantize a checkpoint that already is (block-FP8 ones become mxfp8 by
/// themselves, as ollama imports them).
fn check_quantizable(input: &Input, quant: Option<QuantType>, flag: &str) -> Result<()> {
    let Some(want) = quant else {
        return Ok(());
    };
    let part = read_part(input)?;
    if !part.decoded_fp8.is_empty() {
        return Err(crate::ImportError::Store(StoreError::Invalid(format!(
            "{} is a block-FP8 checkpoint, which is stored as mxfp8; create it without {flag} {}",
            input.source,
            want.name()
        ))));
    }
    let quantized = part.quantized;
    if !quantized.is_empty() {
        return Err(crate::ImportError::Store(StoreError::Invalid(format!(
            "{} is already quantized ({}); create it without {flag} {}",
            input.source,
            common_type(&quantized),
            want.name()
        ))));
    }
    Ok(())
}

/// Stores one part (the target, or the draft under `draft.` and `draft/`): its own blobs again
/// when it comes unchanged from a stored model, else its tensors planned and written as ollama
/// writes them, then its files. Returns its `file_type`.
fn import_part(
    store: &Store,
    lock: &WriteLock,
    input: &Input,
    quant: Option<QuantType>,
    draft: bool,
    layers: &mut Vec<Layer>,
) -> Result<String> {
    if let (Some((stored, file_type)), None) = (&input.stored_layers, quant) {
        layers.extend(stored.iter().cloned());
        // A model of the earlier format says Q4, Q8, or its float dtype.
        return Ok(match file_type.as_str() {
            "Q4" => "int4".into(),
            "Q8" => "int8".into(),
            "F32" | "F16" | "BF16" => String::new(),
            other => other.to_string(),
        });
    }
    let (tensor_prefix, file_prefix) = if draft {
        ("draft.", "draft/")
    } else {
        ("", "")
    };
    let cfg = models::JsonFile::read(input.files.config()?)?.value;
    let Part {
        tensors,
        quantized,
        decoded_fp8,
    } = read_part(input)?;
    // A block-FP8 checkpoint's float8 weights become mxfp8 where ollama's policy quantizes
    // them (bfloat16 elsewhere); its other tensors stay as they are.
    let (quant, only) = match quant {
        None if !decoded_fp8.is_empty() => (Some(QuantType::Mxfp8), Some(decoded_fp8)),
        q => (q, None),
    };
    let file_type = match quant {
        Some(q) => q.name().to_string(),
        // The source's own quantization.
        None => common_type(&quantized),
    };
    let inv = Inventory {
        tensors: &tensors,
        quantized,
        quantizable: only.map(|v| v.into_iter().collect()),
    };
    let blobs = import::plan(&inv, quant, Policy::for_config(&cfg, draft))?;
    let total: u64 = tensors.values().map(|a| a.nbytes() as u64).sum();
    let bar = progress(total, if draft { "draft" } else { "model" });
    for spec in &blobs {
        bar.set_message(spec.name.clone());
        let bytes = import::write(spec, &tensors, tensor_prefix)?;
        let mut layer = store.write_blob(lock, media::TENSOR, &bytes)?;
        layer.name = Some(format!("{tensor_prefix}{}", spec.name));
        layers.push(layer);
        bar.inc(import::source_bytes(spec, &tensors));
    }
    bar.finish_and_clear();
    for (name, path) in &input.json {
        let bytes = std::fs::read(path).map_err(|cause| StoreError::Io {
            path: path.clone(),
            cause,
        })?;
        let mut layer = store.write_blob(lock, media::JSON, &bytes)?;
        layer.name = Some(format!("{file_prefix}{name}"));
        layers.push(layer);
    }
    Ok(file_type)
}
