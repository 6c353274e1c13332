//! `show NAME`: what a stored model is, in words.

use crate::manifest::{media, Part};
use crate::modelfile::{Located, Message, Modelfile};
use crate::store::{Resolved, Store};
use crate::Result;
use std::fmt::Write;

fn count(n: u64) -> String {
    match n {
        n if n >= 1_000_000_000 => format!("{:.1}B", n as f64 / 1e9),
        n if n >= 1_000_000 => format!("{:.1}M", n as f64 / 1e6),
        n if n >= 1_000 => format!("{:.1}K", n as f64 / 1e3),
        n => n.to_string(),
    }
}

fn part(out: &mut String, p: &Part) {
    let _ = writeln!(out, "    architecture    {}", p.architecture);
    let _ = writeln!(out, "    model type      {}", p.model_type);
    let _ = writeln!(out, "    parameters      {}", count(p.parameter_count));
    match &p.quantization {
        Some(q) => {
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
        None => {
            let _ = writeln!(out, "    quantization    none ({})", p.file_type);
        }
    }
    let _ = writeln!(out, "    source          {}", p.source);
}

/// The Modelfile a stored model was created from, rebuilt from its layers.
pub fn modelfile(store: &Store, r: &Resolved) -> Result<Modelfile> {
    let located = |value: &str| Located {
        value: value.to_string(),
        line: 0,
    };
    let mut mf = Modelfile {
        from: Some(located(&r.config.part.source)),
        draft: r.config.draft.as_ref().map(|d| located(&d.part.source)),
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

/// One stored tensor of the target: its name, its precision (`F32`, `BF16`, ..., `int4`,
/// `int8`) and its bytes (a quantized weight's scales and biases included).
#[derive(Debug, Clone, PartialEq)]
pub struct TensorPrecision {
    pub name: String,
    pub precision: String,
    pub bytes: u64,
}

/// The precision of every stored tensor of the target, from its blobs' headers: ollama's
/// quantized layout (a packed `<t>` with `<t>.scale`, `<t>.bias` and the type in the metadata)
/// and mlx-lm's (`<m>.weight` with `<m>.scales`, `<m>.biases`, bits from the shapes).
pub fn precisions(r: &Resolved) -> Result<Vec<TensorPrecision>> {
    let group = r
        .config
        .part
        .quantization
        .as_ref()
        .map_or(64, |q| q.group_size.max(1) as u64);
    let mut out = Vec::new();
    for path in &r.target.tensors {
        let (infos, meta) = mlx::io::read_header(path).map_err(|e| crate::StoreError::Corrupt {
            path: path.clone(),
            message: e.to_string(),
        })?;
        let tensors: std::collections::BTreeMap<String, (String, Vec<i32>, u64)> = infos
            .into_iter()
            .map(|t| {
                let label = crate::create::dtype_label(t.dtype);
                (t.name, (label, t.shape, t.nbytes as u64))
            })
            .collect();
        for (name, (dtype, shape, bytes)) in &tensors {
            let module = name.strip_suffix(".weight").unwrap_or(name);
            let companion = |suffix: &str| {
                tensors
                    .get(&format!("{name}.{suffix}"))
                    .or_else(|| tensors.get(&format!("{module}.{suffix}s")))
            };
            let is_part = [".scale", ".bias", ".scales", ".biases"]
                .iter()
                .any(|s| name.ends_with(s))
                && dtype != "U32";
            if is_part {
                continue;
            }
            let (precision, bytes) = match (dtype.as_str(), companion("scale")) {
                ("U32", Some(scales)) => {
                    let kind = meta
                        .get(&format!("{name}.quant_type"))
                        .or_else(|| meta.get("quant_type"))
                        .cloned()
                        .unwrap_or_else(|| {
                            let packed = shape.last().copied().unwrap_or(0) as u64;
                            let inputs = scales.1.last().copied().unwrap_or(0) as u64 * group;
                            format!("int{}", packed * 32 / inputs.max(1))
                        });
                    let extra: u64 = ["scale", "bias"]
                        .iter()
                        .filter_map(|s| companion(s))
                        .map(|t| t.2)
                        .sum();
                    (kind, bytes + extra)
                }
                _ => (dtype.clone(), *bytes),
            };
            out.push(TensorPrecision {
                name: name
                    .strip_prefix(&r.target.tensor_prefix)
                    .unwrap_or(name)
                    .to_string(),
                precision,
                bytes,
            });
        }
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

/// The text `show NAME` prints.
pub fn describe(store: &Store, r: &Resolved) -> Result<String> {
    describe_with(store, r, false)
}

/// As [`describe`]; `verbose` lists every tensor with its precision.
pub fn describe_with(store: &Store, r: &Resolved, verbose: bool) -> Result<String> {
    let mut out = String::new();
    let _ = writeln!(out, "  Model");
    part(&mut out, &r.config.part);
    let size: u64 = r.manifest.all_layers().map(|l| l.size).sum();
    let _ = writeln!(out, "    size            {:.1} MB", size as f64 / 1e6);
    let _ = writeln!(out, "    id              {}", &r.digest[..12]);
    let _ = writeln!(out);
    let _ = writeln!(out, "  Draft");
    match &r.config.draft {
        Some(d) => part(&mut out, &d.part),
        None if r.config.part.mtp_layers > 0 => {
            let _ = writeln!(
                out,
                "    the model's own MTP layer ({} in the checkpoint)",
                r.config.part.mtp_layers
            );
        }
        None => {
            let _ = writeln!(out, "    none");
        }
    }
    let tensors = precisions(r)?;
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
