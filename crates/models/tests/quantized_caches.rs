//! Models over quantized caches (`--kv-cache-type q8|q4`): a packed forward of several rows
//! gives each row what it gives alone over caches of the same type (GLM's batched decode reads
//! its quantized latents as values in place; gemma4's KV-shared layers read their source's
//! quantized slots), the caches really hold packed rows, and the logits stay near a float32
//! cache's. GLM's fixture latent rows (32 + 8 values) fit no MLX group, so the test widens its
//! rope key to 32 (rows of 64, groups of 32 that never straddle the latent's end).

use mlx::{Array, Dtype, RowFormat};
use models::{load, CausalLm, DtypeChoice, LayerCache, LoadedModel, PackedRow};
use std::path::{Path, PathBuf};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/models")
        .join(name)
}

fn tokens(ids: &[i32]) -> Array {
    Array::from_slice(ids, &[1, ids.len() as i32]).unwrap()
}

fn ids(seed: usize, n: usize) -> Vec<i32> {
    (0..n)
        .map(|i| ((seed * 131 + i * 37 + 11) % 500) as i32)
        .collect()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn mean_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).sum::<f32>() / a.len() as f32
}

/// Deterministic small weights of `shape`.
fn filler(shape: &[i32], salt: u32) -> Array {
    let n: i32 = shape.iter().product();
    let v: Vec<f32> = (0..n as u32)
        .map(|i| {
            let h = i
                .wrapping_mul(2654435761)
                .wrapping_add(salt.wrapping_mul(40503));
            ((h % 2000) as f32 / 1000.0 - 1.0) * 0.1
        })
        .collect();
    Array::from_slice(&v, shape).unwrap()
}

/// The GLM fixture with its rope key widened from 8 to 32 values (latent rows of 32 + 32),
/// fresh deterministic weights for the widened parts.
fn widened_glm(dir: &Path) -> PathBuf {
    let from = fixture("glm4_moe_lite");
    for f in [
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        std::fs::copy(from.join(f), dir.join(f)).unwrap();
    }
    let mut cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(from.join("config.json")).unwrap()).unwrap();
    let field = |k: &str| cfg[k].as_i64().unwrap() as i32;
    let (heads, nope, old) = (
        field("num_attention_heads"),
        field("qk_nope_head_dim"),
        field("qk_rope_head_dim"),
    );
    let new = 32;
    let extra = new - old;
    cfg["qk_rope_head_dim"] = new.into();
    cfg["qk_head_dim"] = (nope + new).into();
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    // In name order: the map's own order changes from run to run, and with it which salt each
    // widened tensor's filler gets (the drift this test bounds came out different every run).
    let mut tensors: Vec<(String, Array)> =
        mlx::io::load_safetensors_mlx(from.join("model.safetensors"))
            .unwrap()
            .into_iter()
            .collect();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    let mut out: Vec<(String, Array)> = Vec::new();
    for (i, (name, a)) in tensors.into_iter().enumerate() {
        let salt = i as u32;
        let a = if name.ends_with("self_attn.kv_a_proj_with_mqa.weight") {
            // [latent | rope key] rows: the rope key's new rows after its old ones.
            let h = a.shape()[1];
            mlx::concatenate(&[&a, &filler(&[extra, h], salt)], 0).unwrap()
        } else if name.ends_with("self_attn.q_b_proj.weight") {
            // Per head [nope | rope] rows: each head's new rope rows after its old ones.
            let k = a.shape()[1];
            let per = a.reshape(&[heads, nope + old, k]).unwrap();
            let more = filler(&[heads, extra, k], salt);
            mlx::concatenate(&[&per, &more], 1)
                .unwrap()
                .reshape(&[heads * (nope + new), k])
                .unwrap()
        } else {
            a
        };
        out.push((name, a));
    }
    let refs: Vec<(&str, &Array)> = out.iter().map(|(n, a)| (n.as_str(), a)).collect();
    mlx::io::save_safetensors(dir.join("model.safetensors"), &refs).unwrap();
    dir.to_path_buf()
}

fn loaded(dir: &Path, format: RowFormat) -> LoadedModel {
    let mut m = load(dir, DtypeChoice::Fixed(Dtype::F32)).unwrap();
    m.model.set_cache_format(format);
    m
}

/// Logits of the rows in `steps` (row, tokens) fed packed, and fed alone.
fn packed_and_alone(m: &dyn CausalLm, steps: &[Vec<(usize, usize)>]) -> (Vec<f32>, Vec<f32>) {
    let rows = 1 + steps.iter().flatten().map(|(r, _)| *r).max().unwrap();
    let streams: Vec<Vec<i32>> = (0..rows).map(|r| ids(r, 64)).collect();
    let mut fed = vec![0usize; rows];
    let mut packed: Vec<Vec<LayerCache>> = (0..rows).map(|_| m.make_caches()).collect();
    let mut solo: Vec<Vec<LayerCache>> = (0..rows).map(|_| m.make_caches()).collect();
    let (mut got, mut want) = (Vec::new(), Vec::new());
    for step in steps {
        let mut all = Vec::new();
        for &(r, n) in step {
            let piece = &streams[r][fed[r]..fed[r] + n];
            all.extend_from_slice(piece);
            let h = m.forward(&tokens(piece), &mut solo[r]).unwrap();
            want.extend(m.logits(&h).unwrap().to_vec::<f32>().unwrap());
            fed[r] += n;
        }
        let mut refs: Vec<Option<&mut Vec<LayerCache>>> = packed.iter_mut().map(Some).collect();
        let mut batch: Vec<PackedRow<'_>> = step
            .iter()
            .map(|&(r, n)| PackedRow::text(n, refs[r].take().unwrap()))
            .collect();
        let h = m.forward_packed(&tokens(&all), &mut batch).unwrap();
        got.extend(m.logits(&h).unwrap().to_vec::<f32>().unwrap());
    }
    (got, want)
}

#[test]
fn packed_rows_over_quantized_caches_match_each_row_alone() {
    let dir = tempfile::tempdir().unwrap();
    let glm = widened_glm(dir.path());
    // A prefill beside a decode, then several rows decoding together (GLM's batched decode),
    // then a verify-sized block beside single tokens.
    let mut steps = vec![vec![(0, 13), (1, 3)], vec![(1, 1), (0, 1), (2, 9)]];
    for _ in 0..6 {
        steps.push(vec![(0, 1), (1, 1), (2, 1)]);
    }
    steps.push(vec![(2, 4), (0, 1), (1, 5)]);
    for (name, path) in [
        ("glm (latent 32 + rope 32)", glm),
        ("gemma4_e2b_like", fixture("gemma4_e2b_like")),
        ("gemma4_31b_like", fixture("gemma4_31b_like")),
    ] {
        let reference = loaded(&path, RowFormat::Float(Dtype::F32));
        let (f32_logits, _) = packed_and_alone(&*reference.model, &steps);
        let half = loaded(&path, RowFormat::Float(Dtype::F16));
        let (f16_logits, _) = packed_and_alone(&*half.model, &steps);
        eprintln!(
            "{name} f16: logit drift against a float32 cache: max {:.2e}, mean {:.2e}",
            max_diff(&f16_logits, &f32_logits),
            mean_diff(&f16_logits, &f32_logits)
        );
        for bits in [8, 4] {
            let what = format!("{name} q{bits}");
            let m = loaded(&path, RowFormat::Affine { bits });
            // The caches hold packed rows where the rows are wide enough.
            let mut caches = m.model.make_caches();
            m.model.forward(&tokens(&ids(5, 4)), &mut caches).unwrap();
            let quantized = caches
                .iter()
                .filter(|c| c.format() == RowFormat::Affine { bits })
                .count();
            assert!(quantized > 0, "{what}: no cache quantized");

            let (got, want) = packed_and_alone(&*m.model, &steps);
            let d = max_diff(&got, &want);
            let drift = max_diff(&got, &f32_logits);
            let mean = mean_diff(&got, &f32_logits);
            eprintln!(
                "{what}: packed against alone max |Δ| {d:.2e}; logit drift against a float32 \
                 cache: max {drift:.2e}, mean {mean:.2e}"
            );
            // Rows computed together round the same rows a hair differently (1e-6), and a
            // value on a quantization step's edge then takes the next code.
            let (packed_bound, mean_bound) = if bits == 8 { (1e-2, 0.05) } else { (1e-1, 0.6) };
            assert!(
                d < packed_bound,
                "{what}: packed against alone, max |Δ| {d}"
            );
            assert!(mean < mean_bound, "{what}: mean logit drift {mean}");
        }
    }
}

/// Our q8 and q4 caches against mlx-lm's own quantized cache (its `QuantizedKVCache`, groups
/// of 64 as ours), on the all-global gemma4 fixture: the one gemma4 form whose cache mlx-lm
/// can quantize (it cannot quantize a rotating window, nor GLM's MLA cache). The fixture's
/// tokens go in one at a time on both sides, each new key and value row quantized before it is
/// attended to, so both compute the same function and differ by float rounding, and by a
/// code where a value lies on a quantization step's edge.
#[test]
fn quantized_caches_match_mlx_lms_quantized_cache() {
    let path = fixture("gemma4_global_like");
    let golden = mlx::io::load_safetensors_mlx(path.join("kv_golden.safetensors")).unwrap();
    let input = mlx::io::load_safetensors_mlx(path.join("golden.safetensors")).unwrap()
        ["input_ids"]
        .to_vec::<i32>()
        .unwrap();
    let want = |key: &str| golden[key].to_vec::<f32>().unwrap();
    let float = want("logits_f32");
    // Measured: float 3.7e-5, q8 2.0e-5, q4 3.2e-5, where mlx-lm's own q8 and q4 caches move
    // its logits 0.63 and 4.0 from its float cache's.
    for (key, format, bound) in [
        ("logits_f32", RowFormat::Float(Dtype::F32), 1e-4),
        ("logits_q8", RowFormat::Affine { bits: 8 }, 1e-4),
        ("logits_q4", RowFormat::Affine { bits: 4 }, 1e-4),
    ] {
        let m = loaded(&path, format);
        let mut caches = m.model.make_caches();
        let mut got = Vec::new();
        for &t in &input {
            let h = m.model.forward(&tokens(&[t]), &mut caches).unwrap();
            got.extend(m.model.logits(&h).unwrap().to_vec::<f32>().unwrap());
        }
        assert!(
            caches.iter().all(|c| c.format() == format),
            "{key}: every cache in the asked format"
        );
        let theirs = want(key);
        let d = max_diff(&got, &theirs);
        eprintln!(
            "{key}: ours against mlx-lm's max |Δ| {d:.2e} (mean {:.2e}); mlx-lm's own drift from \
             its float cache: max {:.2e}",
            mean_diff(&got, &theirs),
            max_diff(&theirs, &float)
        );
        assert!(d < bound, "{key}: ours against mlx-lm's, max |Δ| {d}");
        let v = theirs.len() / input.len();
        let argmax = |x: &[f32]| {
            x.iter()
                .enumerate()
                .max_by(|a, b| a.1.total_cmp(b.1))
                .unwrap()
                .0
        };
        for i in 0..input.len() {
            let at = i * v..(i + 1) * v;
            assert_eq!(
                argmax(&got[at.clone()]),
                argmax(&theirs[at]),
                "{key}: argmax at position {i}"
            );
        }
    }
}
