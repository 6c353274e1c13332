//! `show NAME`: what a stored model is, in words.

use crate::manifest::{media, Part};
use crate::modelfile::{Located, Message, Modelfile};
use crate::store::{Resolved, Store};
use crate::Result;
use base::files::ModelFiles;
use std::fmt::Write;

fn count(n: u64) -> String {
    match n {
        n if n >= 1_000_000_000 => format!("{:.1}B", n as f64 / 1e9),
        n if n >= 1_000_000 => format!("{:.1}M", n as f64 / 1e6),
        n if n >= 1_000 => format!("{:.1}K", n as f64 / 1e3),
        n => n.to_string(),
    }
}

/// One part (target or draft) in words: what its config blob says, completed from its files
/// (ollama's config blob leaves the architecture out and counts no parameters).
fn part(out: &mut String, p: &Part, files: &ModelFiles, tensors: &[TensorPrecision]) {
    let cfg = files.config().ok().and_then(read_json).unwrap_or_default();
    let architecture = match p.architecture.as_str() {
        "" => crate::quant::architecture(&cfg),
        a => a.to_string(),
    };
    let model_type = cfg
        .get("model_type")
        .and_then(|v| v.as_str())
        .unwrap_or(&p.model_type)
        .to_string();
    let parameters: u64 = tensors.iter().map(|t| t.parameters).sum();
    let _ = writeln!(out, "    architecture    {architecture}");
    let _ = writeln!(out, "    model type      {model_type}");
    let _ = writeln!(out, "    parameters      {}", count(parameters));
    match (&p.quantization, p.file_type.as_str()) {
        (Some(q), _) => {
            let _ = writeln!(
                out,
                "    quantization    {} ({}-bit {}, group size {})",
                q.kind.to_uppercase(),
                q.bits,
                q.mode,
                q.group_size
            );
            if !q.unquantized.is_empty() {
                let _ = writeln!(
                    out,
                    "    unquantized     {} matrices whose input dimension is not a multiple of {}:",
                    q.unquantized.len(),
                    q.group_size
                );
                for n in &q.unquantized {
                    let _ = writeln!(out, "                      {n}");
                }
            }
        }
        (None, _) => {
            // ollama's config blob has a file_type for the target only: the tensors say.
            let mut kinds: std::collections::BTreeMap<&str, usize> = Default::default();
            for t in tensors.iter().filter(|t| t.precision.starts_with("int")) {
                *kinds.entry(t.precision.as_str()).or_default() += 1;
            }
            let quantized: usize = kinds.values().sum();
            match kinds.iter().max_by_key(|(_, n)| **n) {
                None => {
                    let _ = writeln!(out, "    quantization    none");
                }
                Some((kind, _)) => {
                    let mixed = if kinds.len() > 1 { ", mixed" } else { "" };
                    let _ = writeln!(
                        out,
                        "    quantization    {kind} (affine{mixed}; {quantized} of {} tensors)",
                        tensors.len()
                    );
                }
            }
        }
    }
    if !p.source.is_empty() {
        let _ = writeln!(out, "    source          {}", p.source);
    }
}

/// The Modelfile a stored model was created from, rebuilt from its layers.
pub fn modelfile(store: &Store, r: &Resolved) -> Result<Modelfile> {
    let located = |value: &str| Located {
        value: value.to_string(),
        line: 0,
    };
    // ollama's config blob does not say where a model came from: FROM names the model itself.
    let from = match r.config.part.source.as_str() {
        "" => r.name.to_string(),
        s => s.to_string(),
    };
    let mut mf = Modelfile {
        from: Some(located(&from)),
        draft: r
            .config
            .draft
            .as_ref()
            .filter(|d| !d.part.source.is_empty())
            .map(|d| located(&d.part.source)),
        ..Modelfile::default()
    };
    for l in &r.manifest.layers {
        match l.media_type.as_str() {
            media::PARAMS => {
                mf.parameters = serde_json::from_str(&store.read_text(l)?).unwrap_or_default();
            }
            media::TEMPLATE => mf.template = Some(store.read_text(l)?),
            media::SYSTEM => mf.system = Some(store.read_text(l)?),
            media::MESSAGES => {
                let m: Vec<Message> =
                    serde_json::from_str(&store.read_text(l)?).unwrap_or_default();
                mf.messages = m;
            }
            media::LICENSE => mf.license.push(store.read_text(l)?),
            _ => {}
        }
    }
    Ok(mf)
}

/// One stored tensor: its name, its precision (`F32`, `BF16`, ..., `int4`, `int8`), its bytes
/// (a quantized weight's scales and biases included) and the parameters it holds.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorPrecision {
    pub name: String,
    pub precision: String,
    pub bytes: u64,
    pub parameters: u64,
}

/// The precision of every stored tensor of a part, from its blobs' headers: ollama's
/// quantized layout (a packed `<t>` with `<t>.scale`, `<t>.bias` and the type in the metadata)
/// and mlx-lm's (`<m>.weight` with `<m>.scales`, `<m>.biases`, bits from the shapes and the
/// group size of config.json's `quantization` block).
pub fn precisions(files: &ModelFiles) -> Result<Vec<TensorPrecision>> {
    let group = files
        .config()
        .ok()
        .and_then(read_json)
        .and_then(|v| v.get("quantization")?.get("group_size")?.as_u64())
        .unwrap_or(64)
        .max(1);
    let mut out = Vec::new();
    for path in &files.tensors {
        let (infos, meta) =
            base::files::safetensors_header(path).map_err(|e| crate::StoreError::Corrupt {
                path: path.clone(),
                message: e.to_string(),
            })?;
        let tensors: std::collections::BTreeMap<String, (String, Vec<i32>, u64)> = infos
            .into_iter()
            .map(|t| (t.name, (t.dtype, t.shape, t.nbytes)))
            .collect();
        for (name, (dtype, shape, bytes)) in &tensors {
            let Some(short) = name.strip_prefix(&files.tensor_prefix) else {
                continue;
            };
            let module = name.strip_suffix(".weight").unwrap_or(name);
            let companion = |suffix: &str| {
                tensors
                    .get(&format!("{name}.{suffix}"))
                    .or_else(|| tensors.get(&format!("{module}.{suffix}s")))
            };
            let is_part = [".scale", ".bias", ".scales", ".biases", ".global_scale"]
                .iter()
                .any(|s| name.ends_with(s))
                && dtype != "U32";
            if is_part {
                continue;
            }
            let elements: u64 = shape.iter().map(|&d| d as u64).product();
            let (precision, bytes, parameters) = match (dtype.as_str(), companion("scale")) {
                ("U32", Some(scales)) => {
                    let packed = shape.last().copied().unwrap_or(0) as u64;
                    let kind = meta
                        .get(&format!("{name}.quant_type"))
                        .or_else(|| meta.get("quant_type"))
                        .cloned()
                        .unwrap_or_else(|| {
                            let inputs = scales.1.last().copied().unwrap_or(0) as u64 * group;
                            format!("int{}", packed * 32 / inputs.max(1))
                        });
                    let bits: u64 = kind
                        .trim_start_matches(|c: char| !c.is_ascii_digit())
                        .parse()
                        .unwrap_or(32);
                    let extra: u64 = ["scale", "bias"]
                        .iter()
                        .filter_map(|s| companion(s))
                        .chain(tensors.get(&format!("{name}.global_scale")))
                        .map(|t| t.2)
                        .sum();
                    (kind, bytes + extra, elements * 32 / bits.max(1))
                }
                _ => (dtype.clone(), *bytes, elements),
            };
            out.push(TensorPrecision {
                name: short.to_string(),
                precision,
                bytes,
                parameters,
            });
        }
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

/// The multi-token-prediction layers (GLM's) a model carries: the layers past
/// `num_hidden_layers` that config.json's `num_nextn_predict_layers` announces and the
/// weights hold.
pub fn mtp_layers(files: &ModelFiles, tensors: &[TensorPrecision]) -> usize {
    let Some(cfg) = files.config().ok().and_then(read_json) else {
        return 0;
    };
    let field = |k: &str| cfg.get(k).and_then(|v| v.as_u64()).unwrap_or(0);
    let layers = field("num_hidden_layers");
    (0..field("num_nextn_predict_layers"))
        .filter(|i| {
            let prefix = format!("model.layers.{}.", layers + i);
            tensors.iter().any(|t| t.name.starts_with(&prefix))
        })
        .count()
}

/// The text `show NAME` prints.
pub fn describe(store: &Store, r: &Resolved) -> Result<String> {
    describe_with(store, r, false)
}

/// As [`describe`]; `verbose` lists every tensor with its precision.
pub fn describe_with(store: &Store, r: &Resolved, verbose: bool) -> Result<String> {
    let mut out = String::new();
    let tensors = precisions(&r.target)?;
    let _ = writeln!(out, "  Model");
    part(&mut out, &r.config.part, &r.target, &tensors);
    let size: u64 = r.manifest.all_layers().map(|l| l.size).sum();
    let _ = writeln!(out, "    size            {:.1} MB", size as f64 / 1e6);
    let _ = writeln!(out, "    id              {}", &r.digest[..12]);
    let _ = writeln!(out);
    let _ = writeln!(out, "  Draft");
    match (&r.config.draft, &r.draft) {
        (Some(d), Some(files)) => part(&mut out, &d.part, files, &precisions(files)?),
        _ if mtp_layers(&r.target, &tensors) > 0 => {
            let _ = writeln!(
                out,
                "    the model's own MTP layer ({} in the checkpoint)",
                mtp_layers(&r.target, &tensors)
            );
        }
        _ => {
            let _ = writeln!(out, "    none");
        }
    }
    let mut by_precision: std::collections::BTreeMap<&str, (usize, u64)> = Default::default();
    for t in &tensors {
        let e = by_precision.entry(t.precision.as_str()).or_default();
        e.0 += 1;
        e.1 += t.bytes;
    }
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "  Precision{}",
        if by_precision.len() > 1 {
            " (mixed)"
        } else {
            ""
        }
    );
    for (p, (n, bytes)) in &by_precision {
        let _ = writeln!(
            out,
            "    {p:<8}{n:>6} tensors  {:>9.1} MB",
            *bytes as f64 / 1e6
        );
    }
    if verbose {
        let _ = writeln!(out);
        let _ = writeln!(out, "  Tensors");
        for t in &tensors {
            let _ = writeln!(out, "    {:<8}{}", t.precision, t.name);
        }
    }
    let mf = modelfile(store, r)?;
    if !mf.parameters.is_empty() {
        let _ = writeln!(out);
        let _ = writeln!(out, "  Parameters");
        for (k, v) in &mf.parameters {
            let _ = writeln!(out, "    {k:<16}{v}");
        }
    }
    let _ = writeln!(out);
    let _ = writeln!(out, "  Modelfile");
    for line in mf.to_string().lines() {
        let _ = writeln!(out, "    {line}");
    }
    Ok(out)
}

/// A JSON file's value, if it reads and parses (what `show` reports is best effort).
fn read_json(path: &std::path::Path) -> Option<serde_json::Value> {
    serde_json::from_str(&std::fs::read_to_string(path).ok()?).ok()
}
