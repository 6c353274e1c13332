//! Block-FP8 checkpoints (`quant_method: "fp8"` in config.json, as DeepSeek's and GLM's FP8
//! releases ship): each linear weight is E4M3 float8 with one float32 scale per 128×128 block
//! beside it (`<w>_scale_inv`, else `<w>_scale`), value = code × the block's scale. MLX has no
//! float8 dtype and no kernel for this layout, so these weights are decoded when the checkpoint
//! is read, the way ollama's importer decodes them: each code to bfloat16, times its block's
//! scale in float32, rounded to bfloat16. The model then sees a bfloat16 checkpoint (and
//! `create` stores it as mxfp8, docs/STORE.md).

use crate::weights::Tensors;
use crate::{ModelError, Result};
use mlx::{Array, Dtype};
use serde_json::Value;

/// The block edge every supported source uses.
pub const BLOCK: i32 = 128;

/// Checks a `quant_method: "fp8"` block: 128×128 blocks of E4M3 values.
pub(crate) fn check_config(q: &serde_json::Map<String, Value>) -> std::result::Result<(), String> {
    if let Some(fmt) = q.get("fmt").and_then(Value::as_str) {
        if !fmt.eq_ignore_ascii_case("e4m3") {
            return Err(format!(
                "quantization_config.fmt is {fmt:?}; only E4M3 block-FP8 checkpoints are supported"
            ));
        }
    }
    match q.get("weight_block_size") {
        None => Err("an fp8 quantization_config without weight_block_size (block-FP8 checkpoints give [128, 128])".into()),
        Some(Value::Array(b))
            if b.len() == 2 && b.iter().all(|v| v.as_i64() == Some(BLOCK as i64)) =>
        {
            Ok(())
        }
        Some(other) => Err(format!(
            "quantization_config.weight_block_size is {other}; only 128x128 blocks are supported"
        )),
    }
}

/// The block-scale companion of float8 weight `name`, if the checkpoint has one.
fn scale_of(tensors: &Tensors, name: &str) -> Option<String> {
    ["_scale_inv", "_scale"]
        .iter()
        .map(|s| format!("{name}{s}"))
        .find(|s| tensors.contains_key(s))
}

/// Replaces every float8 weight of `tensors` (`float8`: their names) by its bfloat16 decoding
/// and drops the scales; returns the names decoded, sorted.
pub(crate) fn decode_all(tensors: &mut Tensors, float8: &[String]) -> Result<Vec<String>> {
    let mut decoded = Vec::new();
    for name in float8 {
        if !name.ends_with(".weight") {
            return Err(ModelError::Tensor {
                name: name.clone(),
                message: "is float8 (F8_E4M3) but neither a block-FP8 weight nor the group scales of an nvfp4 weight beside it: a quantized layout mlx-runner does not load".into(),
            });
        }
        let Some(scale_name) = scale_of(tensors, name) else {
            return Err(ModelError::Tensor {
                name: name.clone(),
                message: format!(
                    "is float8 (F8_E4M3) without a block scale beside it ({name}_scale_inv); only block-FP8 weights are supported"
                ),
            });
        };
        let scale = tensors.remove(&scale_name).expect("found above");
        let weight = &tensors[name];
        let d = decode(weight, &scale).map_err(|message| ModelError::Tensor {
            name: name.clone(),
            message,
        })?;
        tensors.insert(name.clone(), d);
        decoded.push(name.clone());
    }
    decoded.sort();
    Ok(decoded)
}

/// One weight `[..., rows, cols]` of E4M3 codes and its scales `[..., ⌈rows/128⌉, ⌈cols/128⌉]`
/// as bfloat16 (a leading expert axis is decoded expert by expert).
pub fn decode(weight: &Array, scale: &Array) -> std::result::Result<Array, String> {
    let shape = weight.shape();
    let rank = shape.len();
    if !(2..=3).contains(&rank) {
        return Err(format!(
            "is float8 of shape {shape:?}; block-FP8 weights are matrices (or stacks of them)"
        ));
    }
    let (rows, cols) = (shape[rank - 2], shape[rank - 1]);
    let (sr, sc) = ((rows + BLOCK - 1) / BLOCK, (cols + BLOCK - 1) / BLOCK);
    let mut want = shape[..rank - 2].to_vec();
    want.extend([sr, sc]);
    if scale.shape() != want {
        return Err(format!(
            "has block scales of shape {:?}; its shape {shape:?} in 128x128 blocks needs {want:?}",
            scale.shape()
        ));
    }
    if !scale.dtype().is_float() {
        return Err(format!(
            "has block scales of dtype {:?}, not floating point",
            scale.dtype()
        ));
    }
    let run = || -> mlx::Result<Array> {
        let axes = [rank as i32 - 2, rank as i32 - 1];
        let (pad_r, pad_c) = (sr * BLOCK - rows, sc * BLOCK - cols);
        let mut x = weight.from_fp8(Dtype::Bf16)?;
        if pad_r > 0 || pad_c > 0 {
            x = x.pad(&axes, &[0, 0], &[pad_r, pad_c], 0.0)?;
        }
        let lead = &shape[..rank - 2];
        let mut blocked = lead.to_vec();
        blocked.extend([sr, BLOCK, sc, BLOCK]);
        let per_block = scale
            .astype(Dtype::F32)?
            .expand_dims_axes(&[lead.len() as i32 + 1, lead.len() as i32 + 3])?;
        // bfloat16 × float32 computes in float32; the product is rounded once, to bfloat16.
        let x = x
            .reshape(&blocked)?
            .multiply(&per_block)?
            .astype(Dtype::Bf16)?;
        let mut padded = lead.to_vec();
        padded.extend([sr * BLOCK, sc * BLOCK]);
        let x = x.reshape(&padded)?;
        x.slice_axis(axes[0], 0, Some(rows))?
            .slice_axis(axes[1], 0, Some(cols))?
            .contiguous()
    };
    run().map_err(|e| format!("could not be decoded: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// E4M3 by its definition: sign, 4 exponent bits of bias 7, 3 mantissa bits; exponent 0 is
    /// subnormal (m/8 · 2^-6); S.1111.111 is NaN, and there are no infinities.
    fn e4m3(b: u8) -> f32 {
        let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
        let (e, m) = (((b >> 3) & 0xF) as i32, (b & 7) as f32);
        if e == 15 && m == 7.0 {
            return f32::NAN;
        }
        sign * if e == 0 {
            m / 8.0 * 2f32.powi(-6)
        } else {
            (1.0 + m / 8.0) * 2f32.powi(e - 7)
        }
    }

    /// float32 to bfloat16, round to nearest even, as a float32.
    fn bf16(f: f32) -> f32 {
        if f.is_nan() {
            return f;
        }
        let b = f.to_bits();
        f32::from_bits(((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16)
    }

    /// A stack of two 300 × 260 weights: several whole blocks and partial ones on both edges,
    /// every code (NaN included) and per-block scales, against the definition element by element.
    #[test]
    fn blocks_scale_their_own_codes() {
        let (e, r, c) = (2usize, 300usize, 260usize);
        let codes: Vec<u8> = (0..e * r * c).map(|i| (i * 7 + i / 13) as u8).collect();
        let (sr, sc) = (3usize, 3usize);
        let scales: Vec<f32> = (0..e * sr * sc)
            .map(|i| 0.37 * (i as f32 + 1.0).powf(1.3))
            .collect();
        let w = Array::from_slice(&codes, &[e as i32, r as i32, c as i32]).unwrap();
        let s = Array::from_slice(&scales, &[e as i32, sr as i32, sc as i32]).unwrap();
        let d = decode(&w, &s).unwrap();
        assert_eq!(d.dtype(), Dtype::Bf16);
        assert_eq!(d.shape(), vec![e as i32, r as i32, c as i32]);
        let got = d.astype(Dtype::F32).unwrap().to_vec::<f32>().unwrap();
        for x in 0..e {
            for i in 0..r {
                for j in 0..c {
                    let at = (x * r + i) * c + j;
                    let scale = scales[(x * sr + i / 128) * sc + j / 128];
                    let want = bf16(e4m3(codes[at]) * scale);
                    let ok = if want.is_nan() {
                        got[at].is_nan()
                    } else {
                        got[at] == want
                    };
                    assert!(
                        ok,
                        "[{x}, {i}, {j}] code {:#04x}: {} != {want}",
                        codes[at], got[at]
                    );
                }
            }
        }
    }

    #[test]
    fn scales_must_tile_the_weight() {
        let w = Array::from_slice(&[0u8; 200 * 130], &[200, 130]).unwrap();
        let s = Array::from_slice(&[1f32; 2], &[1, 2]).unwrap();
        let e = decode(&w, &s).unwrap_err();
        assert!(e.contains("needs [2, 2]"), "{e}");
        let s = Array::from_slice(&[1u8; 4], &[2, 2]).unwrap();
        assert!(decode(&w, &s).unwrap_err().contains("not floating point"));
        let v = Array::from_slice(&[0u8; 4], &[4]).unwrap();
        assert!(decode(&v, &s).unwrap_err().contains("matrices"));
    }
}
