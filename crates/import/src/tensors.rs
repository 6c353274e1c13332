//! A checkpoint's tensors as ollama's importer stores them (`x/create/plan.go`,
//! `x/create/writer.go`, `x/create/quantize.go`, `x/create/prequant.go`): one blob per tensor,
//! named by the tensor; per-expert weights stacked into `<group>.<proj>.weight` with a group's
//! projections in one blob named by the group when they share a precision; every other layout
//! kept as the checkpoint has it (fused `experts.gate_up_proj`, unsplit `kv_b_proj`); quantized
//! tensors as packed `<t>`, `<t>.scale`, `<t>.bias` with the type in the blob's metadata.
//!
//! Planning reads no tensor data and makes every decision; writing then only executes the plan.

use crate::Result;
use mlx::{Array, Dtype};
use std::collections::{BTreeMap, HashMap};
use store::quant::{Policy, QuantType};
use store::StoreError;

/// How an output tensor is made from the checkpoint's tensors.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Build {
    /// One tensor, as it is.
    Copy(String),
    /// Per-expert matrices, in expert order, stacked into `[E, ...]`.
    Stack(Vec<String>),
}

/// One output tensor of a blob.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct TensorSpec {
    /// Its name in the blob (before the draft's prefix).
    pub name: String,
    pub build: Build,
    /// Quantize it (into `<name>`, `<name>.scale` and, for int4/int8, `<name>.bias`) to this
    /// type.
    pub quantize: Option<QuantType>,
}

/// One blob: its layer name, its tensors and (for an already quantized source) its metadata.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct BlobSpec {
    pub name: String,
    pub tensors: Vec<TensorSpec>,
    pub metadata: BTreeMap<String, String>,
}

/// The checkpoint as the planner sees it: names, shapes and dtypes only.
pub(crate) struct Inventory<'a> {
    pub tensors: &'a HashMap<String, Array>,
    /// How each module that is already quantized (mlx-lm's `<m>.weight` + `<m>.scales` (+
    /// `<m>.biases`)) is, by module path.
    pub quantized: models::weights::ModuleQuant,
    /// Where only some tensors may be quantized (a block-FP8 checkpoint's decoded weights,
    /// `planBlockFP8`): those; every tensor otherwise.
    pub quantizable: Option<std::collections::HashSet<String>>,
}

/// The prefixes a layer may sit under for its experts to be grouped (`expertLayerPrefixRegexp`).
const LAYER_PARENTS: &[&str] = &[
    "model.language_model.backbone.",
    "model.language_model.",
    "language_model.",
    "language_model.model.",
    "language_model.backbone.",
    "model.",
    "backbone.",
    "mtp.",
    "",
];

fn is_layer(prefix: &str) -> bool {
    LAYER_PARENTS.iter().any(|p| {
        prefix
            .strip_prefix(p)
            .and_then(|r| r.strip_prefix("layers."))
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
    })
}

/// `model.layers.3.mlp.experts.7.up_proj.weight` → (`model.layers.3.mlp.experts`, 7, `up_proj`)
/// (`ExpertGroupPrefix` and `perExpertGroup`); `None` for anything not one expert's weight.
pub(crate) fn per_expert(name: &str) -> Option<(&str, usize, &str)> {
    name.strip_suffix(".weight")?;
    for marker in [
        ".mlp.experts.",
        ".mlp.shared_experts.",
        ".mlp.switch_mlp.",
        ".moe.experts.",
        ".mixer.experts.",
        ".mixer.shared_experts.",
    ] {
        let Some(at) = name.find(marker) else {
            continue;
        };
        if !is_layer(&name[..at]) {
            continue;
        }
        let group = &name[..at + marker.len() - 1];
        let (index, rest) = name[at + marker.len()..].split_once('.')?;
        let index = index.parse().ok()?;
        return Some((group, index, rest.strip_suffix(".weight")?));
    }
    None
}

/// The blobs of a checkpoint, in ollama's order: every tensor that is not one expert's in
/// sorted order, then the expert groups, sorted.
pub(crate) fn plan(
    inv: &Inventory,
    requested: Option<QuantType>,
    policy: Policy,
) -> Result<Vec<BlobSpec>> {
    let mut names: Vec<&String> = inv.tensors.keys().collect();
    names.sort();
    if !inv.quantized.is_empty() {
        return Ok(plan_prequantized(inv, &names));
    }
    let shape = |n: &str| inv.tensors[n].shape();
    let allowed = |sources: &[&str]| {
        inv.quantizable
            .as_ref()
            .is_none_or(|q| sources.iter().all(|s| q.contains(*s)))
    };
    let decide = |n: &str, s: &[i32], sources: &[&str]| {
        requested
            .filter(|_| allowed(sources))
            .and_then(|q| policy.quant_type(n, s, q))
    };
    let mut blobs = Vec::new();
    // group -> projection -> expert -> tensor
    let mut groups: BTreeMap<&str, BTreeMap<&str, BTreeMap<usize, &str>>> = BTreeMap::new();
    for name in names {
        if let Some((group, index, proj)) = per_expert(name) {
            groups
                .entry(group)
                .or_default()
                .entry(proj)
                .or_default()
                .insert(index, name);
            continue;
        }
        let quantize = decide(name, &shape(name), &[name.as_str()]);
        blobs.push(BlobSpec {
            name: name.clone(),
            tensors: vec![TensorSpec {
                name: name.clone(),
                build: Build::Copy(name.clone()),
                quantize,
            }],
            metadata: BTreeMap::new(),
        });
    }
    for (group, projections) in groups {
        let mut tensors = Vec::new();
        for (proj, experts) in projections {
            let first =
                inv.tensors[*experts.values().next().expect("a group has an expert")].clone();
            for (i, n) in &experts {
                let t = &inv.tensors[*n];
                if t.dtype() != first.dtype() || t.shape() != first.shape() {
                    return Err(crate::ImportError::Store(StoreError::Invalid(format!(
                        "expert {i} of {group}.{proj} is {:?} {:?}, the others {:?} {:?}: the experts of a projection must match",
                        t.dtype(),
                        t.shape(),
                        first.dtype(),
                        first.shape()
                    ))));
                }
            }
            let name = format!("{group}.{proj}.weight");
            let mut stacked = vec![experts.len() as i32];
            stacked.extend(first.shape());
            let sources: Vec<&str> = experts.values().copied().collect();
            tensors.push(TensorSpec {
                quantize: decide(&name, &stacked, &sources),
                name,
                build: Build::Stack(experts.values().map(|s| s.to_string()).collect()),
            });
        }
        // One blob per group when its projections share a precision, so that the blob's
        // metadata describes all of it; one per projection otherwise.
        if tensors.iter().all(|t| t.quantize == tensors[0].quantize) {
            blobs.push(BlobSpec {
                name: group.to_string(),
                tensors,
                metadata: BTreeMap::new(),
            });
        } else {
            blobs.extend(tensors.into_iter().map(|t| BlobSpec {
                name: t.name.clone(),
                tensors: vec![t],
                metadata: BTreeMap::new(),
            }));
        }
    }
    Ok(blobs)
}

/// An already quantized checkpoint (mlx-lm's layout, NVIDIA's nvfp4 ones as the reader
/// rewrites them, or a stored quantized model): each quantized module's weight, scales, biases
/// and global scale fused into one blob named by the weight, as `<m>.weight`,
/// `<m>.weight.scale`, `<m>.weight.bias`, `<m>.weight.global_scale` with the module's own type
/// in the metadata; every other tensor as it is (`planPrequantized`).
fn plan_prequantized(inv: &Inventory, names: &[&String]) -> Vec<BlobSpec> {
    let mut blobs = Vec::new();
    for name in names {
        let module = name
            .strip_suffix(".scales")
            .or_else(|| name.strip_suffix(".biases"))
            .or_else(|| name.strip_suffix(".global_scale"));
        if module.is_some_and(|m| inv.quantized.contains_key(m)) {
            continue;
        }
        let quantized = name
            .strip_suffix(".weight")
            .and_then(|m| inv.quantized.get(m).map(|q| (m, q)));
        let Some((module, q)) = quantized else {
            blobs.push(BlobSpec {
                name: name.to_string(),
                tensors: vec![TensorSpec {
                    name: name.to_string(),
                    build: Build::Copy(name.to_string()),
                    quantize: None,
                }],
                metadata: BTreeMap::new(),
            });
            continue;
        };
        let mut tensors = vec![TensorSpec {
            name: name.to_string(),
            build: Build::Copy(name.to_string()),
            quantize: None,
        }];
        for (from, to) in [
            ("scales", "scale"),
            ("biases", "bias"),
            ("global_scale", "global_scale"),
        ] {
            let src = format!("{module}.{from}");
            if inv.tensors.contains_key(&src) {
                tensors.push(TensorSpec {
                    name: format!("{name}.{to}"),
                    build: Build::Copy(src),
                    quantize: None,
                });
            }
        }
        let kind = store::quant::type_name(q.mode.name(), q.bits, q.group_size);
        blobs.push(BlobSpec {
            name: name.to_string(),
            tensors,
            metadata: BTreeMap::from([
                ("quant_type".to_string(), kind),
                ("group_size".to_string(), q.group_size.to_string()),
            ]),
        });
    }
    blobs
}

/// Executes one planned blob, its tensor names under `prefix`: the blob's bytes.
pub(crate) fn write(
    spec: &BlobSpec,
    tensors: &HashMap<String, Array>,
    prefix: &str,
) -> Result<Vec<u8>> {
    let mut out: Vec<(String, Array)> = Vec::new();
    let mut metadata = spec.metadata.clone();
    let types: Vec<Option<QuantType>> = spec.tensors.iter().map(|t| t.quantize).collect();
    let uniform = types.iter().all(|t| *t == types[0]);
    for t in &spec.tensors {
        let a = match &t.build {
            Build::Copy(src) => tensors[src].clone(),
            Build::Stack(srcs) => {
                let arrays: Vec<&Array> = srcs.iter().map(|s| &tensors[s]).collect();
                mlx::stack(&arrays, 0)?
            }
        };
        let name = format!("{prefix}{}", t.name);
        match t.quantize {
            Some(q) => {
                // MLX quantizes floating-point weights; ollama casts anything else to bf16.
                let a = if a.dtype().is_float() {
                    a
                } else {
                    a.astype(Dtype::Bf16)?
                };
                let mode = mlx::QuantMode::parse(q.mode()).expect("ollama's types are MLX's modes");
                let qa = a.quantize_as(mode, q.group_size(), q.bits())?;
                if !uniform {
                    metadata.insert(format!("{name}.quant_type"), q.name().into());
                    metadata.insert(format!("{name}.group_size"), q.group_size().to_string());
                }
                out.push((format!("{name}.scale"), qa.scales));
                if let Some(biases) = qa.biases {
                    out.push((format!("{name}.bias"), biases));
                }
                out.push((name, qa.weight));
            }
            None => out.push((name, a)),
        }
    }
    if uniform {
        if let Some(q) = types[0] {
            metadata.insert("quant_type".into(), q.name().into());
            metadata.insert("group_size".into(), q.group_size().to_string());
        }
    }
    let refs: Vec<(&str, &Array)> = out.iter().map(|(n, a)| (n.as_str(), a)).collect();
    let metadata = (!metadata.is_empty()).then(|| metadata.into_iter().collect());
    Ok(mlx::io::serialize_safetensors(&refs, metadata)?)
}

/// The checkpoint bytes one blob reads.
pub(crate) fn source_bytes(spec: &BlobSpec, tensors: &HashMap<String, Array>) -> u64 {
    spec.tensors
        .iter()
        .flat_map(|t| match &t.build {
            Build::Copy(s) => vec![s],
            Build::Stack(v) => v.iter().collect(),
        })
        .map(|s| tensors[s].nbytes() as u64)
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn experts_are_grouped_by_layer() {
        assert_eq!(
            per_expert("model.layers.1.mlp.experts.7.up_proj.weight"),
            Some(("model.layers.1.mlp.experts", 7, "up_proj"))
        );
        assert_eq!(
            per_expert("model.language_model.layers.12.moe.experts.0.down_proj.weight"),
            Some(("model.language_model.layers.12.moe.experts", 0, "down_proj"))
        );
        // Shared experts have no index; stacked tensors have none either; a routing gate is not
        // an expert; a layer under an unknown parent is not grouped.
        assert_eq!(
            per_expert("model.layers.1.mlp.shared_experts.up_proj.weight"),
            None
        );
        assert_eq!(per_expert("model.layers.1.experts.gate_up_proj"), None);
        assert_eq!(
            per_expert("model.layers.1.mlp.experts.gate_up_proj.weight"),
            None
        );
        assert_eq!(per_expert("model.layers.1.mlp.gate.weight"), None);
        assert_eq!(
            per_expert("encoder.layers.1.mlp.experts.0.up_proj.weight"),
            None
        );
        assert_eq!(
            per_expert("model.layers.x.mlp.experts.0.up_proj.weight"),
            None
        );
    }
}
