//! Other producers' nvfp4 checkpoints, read as MLX's nvfp4 tables with a global scale.
//!
//! NVIDIA's two nvfp4 layouts hold exactly MLX's nvfp4 codes and scales: FP4 (E2M1) values two
//! to a byte, low nibble first (MLX's uint32 words, little-endian, are the same bytes), and one
//! E4M3 scale per 16 values; on top, one float32 scale per tensor.
//!
//! | producer | weight | group scales | global scale g (w = fp4 · scale · g) |
//! |---|---|---|---|
//! | compressed-tensors (`nvfp4-pack-quantized`) | `<m>.weight_packed` u8 | `<m>.weight_scale` E4M3 | 1 / `<m>.weight_global_scale` |
//! | ModelOpt (`NVFP4`) | `<m>.weight` u8 | `<m>.weight_scale` E4M3 | `<m>.weight_scale_2` |
//!
//! Both become `<m>.weight` (uint32), `<m>.scales` (uint8) and `<m>.global_scale` (float32),
//! nvfp4 in groups of 16, as ollama's importer fuses them (`.weight.global_scale` in its blobs,
//! which the reader renames the same way). Activation scales (`input_scale`,
//! `input_global_scale`) are dropped: MLX multiplies float activations. Quantized per-expert
//! matrices (`…experts.<i>.<proj>`), whoever wrote them, are stacked into
//! `…experts.<proj>` as the models read experts.

use crate::weights::{ModuleQuant, QuantParams, Tensors};
use crate::{ModelError, Result};
use mlx::{Array, Dtype, QuantMode};
use std::collections::{BTreeMap, HashSet};

const NVFP4: QuantParams = QuantParams {
    group_size: 16,
    bits: 4,
    mode: QuantMode::Nvfp4,
};

fn tensor_err(name: &str, message: String) -> ModelError {
    ModelError::Tensor {
        name: name.to_string(),
        message,
    }
}

/// A float32 scalar (shape `[]` or `[1]`) from a global-scale tensor.
fn scalar(name: &str, a: &Array) -> Result<Array> {
    if !a.dtype().is_float() || a.size() != 1 {
        return Err(tensor_err(
            name,
            format!(
                "is {:?} {:?}; a global scale is one floating-point value",
                a.dtype(),
                a.shape()
            ),
        ));
    }
    Ok(a.astype(Dtype::F32)?.reshape(&[])?)
}

/// Rewrites the nvfp4 layouts above into MLX's, recording each module in `quant`; the E4M3
/// scales they hold leave `float8` (they are codes, not weights to decode).
pub(crate) fn canonicalize(
    tensors: &mut Tensors,
    float8: &mut Vec<String>,
    quant: &mut ModuleQuant,
) -> Result<()> {
    let e4m3: HashSet<String> = float8.iter().cloned().collect();
    let mut names: Vec<String> = tensors.keys().cloned().collect();
    names.sort();
    let mut consumed = HashSet::new();
    for name in &names {
        // (module, global-scale companion, whether it is stored inverted)
        let found = if let Some(m) = name.strip_suffix(".weight_packed") {
            Some((m, "weight_global_scale", true))
        } else {
            name.strip_suffix(".weight")
                .filter(|m| {
                    tensors[name].dtype() == Dtype::U8
                        && !e4m3.contains(name)
                        && e4m3.contains(&format!("{m}.weight_scale"))
                })
                .map(|m| (m, "weight_scale_2", false))
        };
        let Some((module, global_name, inverted)) = found else {
            continue;
        };
        let scale_name = format!("{module}.weight_scale");
        let scales = tensors.get(&scale_name).cloned().ok_or_else(|| {
            tensor_err(
                name,
                format!("is packed FP4 without its group scales ({scale_name})"),
            )
        })?;
        let packed = &tensors[name];
        let shape = packed.shape();
        if packed.dtype() != Dtype::U8 || shape.len() != 2 || shape[1] % 8 != 0 {
            return Err(tensor_err(
                name,
                format!(
                    "is {:?} {shape:?}; packed FP4 weights are uint8 [out, in/2] with in a multiple of 16",
                    packed.dtype()
                ),
            ));
        }
        let (rows, cols) = (shape[0], shape[1] * 2);
        if scales.dtype() != Dtype::U8 || scales.shape() != [rows, cols / 16] {
            return Err(tensor_err(
                &scale_name,
                format!(
                    "is {:?} {:?}; nvfp4 group scales of a {rows}x{cols} weight are E4M3 [{rows}, {}]",
                    scales.dtype(),
                    scales.shape(),
                    cols / 16
                ),
            ));
        }
        let weight = packed.view(Dtype::U32)?;
        let global_src = format!("{module}.{global_name}");
        let global = match tensors.get(&global_src) {
            Some(g) => {
                let g = scalar(&global_src, g)?;
                Some(if inverted { g.reciprocal()? } else { g })
            }
            None => None,
        };
        consumed.extend([name.clone(), scale_name.clone(), global_src]);
        for extra in ["input_scale", "input_global_scale", "weight_shape"] {
            consumed.insert(format!("{module}.{extra}"));
        }
        tensors.insert(format!("{module}.weight"), weight);
        tensors.insert(format!("{module}.scales"), scales);
        if let Some(g) = global {
            tensors.insert(format!("{module}.global_scale"), g);
        }
        float8.retain(|f| f != &scale_name);
        quant.insert(module.to_string(), NVFP4);
    }
    for c in &consumed {
        // The weight itself was replaced under `.weight` (ModelOpt's own name): keep that.
        if !c.ends_with(".weight") {
            tensors.remove(c);
        }
    }
    stack_experts(tensors, quant)
}

/// `…experts.<i>.<proj>` → (`…experts.<proj>`, i) for a module path.
fn expert_of(module: &str) -> Option<(String, usize)> {
    let at = module.rfind(".experts.")?;
    let (index, proj) = module[at + ".experts.".len()..].split_once('.')?;
    if proj.contains('.') {
        return None;
    }
    let index: usize = index.parse().ok()?;
    Some((format!("{}.experts.{proj}", &module[..at]), index))
}

/// Quantized per-expert matrices stacked into `[E, …]` under the group's module (one
/// format per group; every expert from 0 present).
fn stack_experts(tensors: &mut Tensors, quant: &mut ModuleQuant) -> Result<()> {
    let mut groups: BTreeMap<String, BTreeMap<usize, String>> = BTreeMap::new();
    for module in quant.keys() {
        if let Some((group, i)) = expert_of(module) {
            groups.entry(group).or_default().insert(i, module.clone());
        }
    }
    for (group, experts) in groups {
        let modules: Vec<&String> = experts.values().collect();
        if experts.keys().copied().ne(0..experts.len()) {
            return Err(tensor_err(
                &group,
                format!(
                    "has quantized experts {:?}; a stack needs every expert from 0",
                    experts.keys().collect::<Vec<_>>()
                ),
            ));
        }
        let params = quant[modules[0]];
        if let Some(m) = modules.iter().find(|m| quant[**m] != params) {
            return Err(tensor_err(
                m,
                format!(
                    "is quantized unlike {} ({:?} and {params:?}); one expert stack has one format",
                    modules[0], quant[*m]
                ),
            ));
        }
        for part in ["weight", "scales", "biases", "global_scale"] {
            let parts: Vec<Array> = modules
                .iter()
                .filter_map(|m| tensors.remove(&format!("{m}.{part}")))
                .collect();
            if parts.is_empty() {
                continue;
            }
            if parts.len() != modules.len() {
                return Err(tensor_err(
                    &format!("{group}.{part}"),
                    "is missing for some experts of the stack".into(),
                ));
            }
            let refs: Vec<&Array> = parts.iter().collect();
            tensors.insert(format!("{group}.{part}"), mlx::stack(&refs, 0)?);
        }
        for m in modules {
            quant.remove(m);
        }
        quant.insert(group, params);
    }
    Ok(())
}
