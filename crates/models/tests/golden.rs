//! Parity with references nobody here wrote: transformers (and mlx-lm for the quantized
//! checkpoints), through the golden files in tests/fixtures (made by tests/fixtures/generate.py).
//! float32 logits within 1e-4 and the same argmax at every position, for the full sequence,
//! for prefill + one-token decode past the sliding window, and for chunked prefill.

mod common;

use common::argmax_rows;
use mlx::{Array, Dtype, Ix};
use models::{load, CausalLm, DtypeChoice, LayerCache, LoadedModel};
use std::collections::HashMap;
use std::path::PathBuf;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/models")
        .join(name)
}

fn golden(name: &str) -> HashMap<String, Array> {
    mlx::io::load_safetensors(fixture(name).join("golden.safetensors"))
        .unwrap()
        .arrays
}

fn model(name: &str) -> LoadedModel {
    load(&fixture(name), DtypeChoice::Fixed(Dtype::F32)).unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn tokens(ids: &[i32]) -> Array {
    Array::from_slice(ids, &[1, ids.len() as i32]).unwrap()
}

/// Logits `[T, V]` for `ids`, fed in pieces of the given lengths through one set of caches.
fn run(m: &dyn CausalLm, ids: &[i32], pieces: &[usize]) -> Vec<f32> {
    let mut caches: Vec<LayerCache> = m.make_caches();
    let mut out = Vec::new();
    let mut at = 0;
    for &n in pieces {
        let h = m.forward(&tokens(&ids[at..at + n]), &mut caches).unwrap();
        let l = m.logits(&h).unwrap();
        out.extend(l.to_vec::<f32>().unwrap());
        at += n;
    }
    assert_eq!(at, ids.len());
    out
}

fn compare(what: &str, got: &[f32], want: &[f32], vocab: usize, tol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let worst = got
        .iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(worst <= tol, "{what}: max |Δ| = {worst} > {tol}");
    assert_eq!(
        argmax_rows(got, vocab),
        argmax_rows(want, vocab),
        "{what}: argmax differs"
    );
}

fn check_model(name: &str, tol: f32) {
    check_model_against(name, name, tol)
}

/// [`check_model`] with the golden values of another folder (the same weights in another
/// layout).
fn check_model_against(name: &str, reference: &str, tol: f32) {
    let m = model(name);
    let g = golden(reference);
    let ids = g["input_ids"].to_vec::<i32>().unwrap();
    let v = m.model.vocab_size();
    let t = ids.len();
    let full = g["logits"].to_vec::<f32>().unwrap();
    let inc = g["logits_incremental_split12"].to_vec::<f32>().unwrap();

    compare(
        &format!("{name} full"),
        &run(&*m.model, &ids, &[t]),
        &full,
        v,
        tol,
    );
    let mut pieces = vec![12];
    pieces.extend(std::iter::repeat_n(1, t - 12));
    compare(
        &format!("{name} incremental"),
        &run(&*m.model, &ids, &pieces),
        &inc,
        v,
        tol,
    );
    // Chunked prefill across the window (8): 5 + 5 + 7 + 3 ...
    compare(
        &format!("{name} chunked"),
        &run(&*m.model, &ids, &[5, 5, 7, 1, 2]),
        &full,
        v,
        tol,
    );
    compare(
        &format!("{name} chunked-2"),
        &run(&*m.model, &ids, &[3, 9, 8]),
        &full,
        v,
        tol,
    );

    let layers = g.keys().filter(|k| k.starts_with("hidden_states.")).count();
    if let Some(h) = layers
        .checked_sub(1)
        .and_then(|last| g.get(&format!("hidden_states.{last}")))
    {
        let mut caches = m.model.make_caches();
        let got = m.model.forward(&tokens(&ids), &mut caches).unwrap();
        let got = got.index(&[Ix::At(0)]).unwrap().to_vec::<f32>().unwrap();
        let want = h.to_vec::<f32>().unwrap();
        let worst = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(worst < 1e-4, "{name}: final hidden state max |Δ| = {worst}");
    }
}

#[test]
fn gemma4_e2b_like_matches_transformers() {
    check_model("gemma4_e2b_like", 1e-4);
}

#[test]
fn gemma4_31b_like_matches_transformers() {
    check_model("gemma4_31b_like", 1e-4);
}

#[test]
fn gemma4_26b_a4b_like_matches_transformers() {
    check_model("gemma4_26b_a4b_like", 1e-4);
}

#[test]
fn glm4_moe_lite_matches_transformers() {
    check_model("glm4_moe_lite", 1e-4);
}

#[test]
fn glm4_moe_lite_grouped_matches_transformers() {
    check_model("glm4_moe_lite_grouped", 1e-4);
}

#[test]
fn gemma4_moe_q4_matches_mlx_lm() {
    check_model("gemma4_26b_a4b_like_q4", 1e-3);
}

#[test]
fn glm4_moe_lite_q4_matches_mlx_lm() {
    check_model("glm4_moe_lite_q4", 1e-3);
}

/// On a CPU with AVX-512 the q4 fixtures' projections are held as 16-output panels
/// (docs/MODELS.md, "Quantized weights on the CPU"): their logits are those of the same model in
/// MLX's row layout within float rounding, and (the panels being what ran) not bit for bit.
#[test]
fn quantized_panels_give_the_row_layouts_logits() {
    let ids: Vec<i32> = (0..12).map(|i| (i * 37 + 5) % 200 + 3).collect();
    for name in ["gemma4_26b_a4b_like_q4", "glm4_moe_lite_q4"] {
        let paneled = run(&*model(name).model, &ids, &[8, 1, 1, 1, 1]);
        mlx::set_quantized_panels(false);
        let rows = run(&*model(name).model, &ids, &[8, 1, 1, 1, 1]);
        mlx::set_quantized_panels(true);
        let vocab = paneled.len() / ids.len();
        compare(name, &paneled, &rows, vocab, 1e-4);
        if mlx::quantized_panels_apply(4, 64) {
            assert_ne!(paneled, rows, "{name}: the panels never ran");
        }
    }
}

/// 3-bit codes straddle words: GLM's projections and routed experts at 3 bits.
#[test]
fn glm4_moe_lite_q3_matches_mlx_lm() {
    check_model("glm4_moe_lite_q3", 1e-3);
}

/// mlx-lm's mixed recipe: attention at 6 bits (group 32), the dense MLP at 3, the experts at 5
/// (group 32), the embedding and head at 2, the router in float.
#[test]
fn gemma4_moe_mixed_widths_match_mlx_lm() {
    check_model("gemma4_26b_a4b_like_mixed", 1e-3);
}

/// MLX's microscaling modes (FP4 / FP8 values, 8-bit scales, no biases), run by MLX's own
/// kernels: mxfp4 and mxfp8 on gemma4's MoE form (its routers stay affine, as mlx-lm leaves
/// them), nvfp4 (groups of 16) on GLM.
#[test]
fn gemma4_moe_mxfp4_matches_mlx_lm() {
    check_model("gemma4_26b_a4b_like_mxfp4", 1e-3);
}

#[test]
fn glm4_moe_lite_nvfp4_matches_mlx_lm() {
    check_model("glm4_moe_lite_nvfp4", 1e-3);
}

#[test]
fn gemma4_moe_mxfp8_matches_mlx_lm() {
    check_model("gemma4_26b_a4b_like_mxfp8", 1e-3);
}

/// A block-FP8 checkpoint (E4M3 weights, a float32 scale per 128x128 block) decodes on reading
/// to what mlx-lm's own block-FP8 decoding gives, weight for weight, and runs as mlx-lm runs that
/// decoded checkpoint.
#[test]
fn glm4_moe_lite_block_fp8_matches_mlx_lm() {
    let name = "glm4_moe_lite_fp8";
    let g = golden(name);
    let c = models::weights::read_checkpoint(&models::ModelFiles::dir(&fixture(name)).unwrap())
        .unwrap();
    assert!(c.decoded_fp8.len() > 40, "{:?}", c.decoded_fp8);
    assert!(!c.tensors.keys().any(|k| k.ends_with("_scale_inv")));
    let mut checked = 0;
    for (k, want) in g.iter().filter(|(k, _)| k.starts_with("decoded.")) {
        let w = &k["decoded.".len()..];
        let got = &c.tensors[w];
        assert_eq!(got.dtype(), Dtype::Bf16, "{w}");
        let got = got.astype(Dtype::F32).unwrap().to_vec::<f32>().unwrap();
        assert_eq!(got, want.to_vec::<f32>().unwrap(), "{w}");
        checked += 1;
    }
    assert!(checked >= 10, "{checked}");
    check_model(name, 1e-4);
}

/// NVIDIA's nvfp4 layouts (compressed-tensors and ModelOpt: FP4 codes, E4M3 scales per 16
/// values, a float32 global scale per tensor, routed experts one tensor each) run as mlx-lm runs
/// what MLX's dequantize makes of them.
#[test]
fn glm4_moe_lite_nvfp4_from_nvidia_layouts_matches_mlx_lm() {
    check_model("glm4_moe_lite_nvfp4_ct", 1e-4);
    check_model_against(
        "glm4_moe_lite_nvfp4_modelopt",
        "glm4_moe_lite_nvfp4_ct",
        1e-4,
    );
    let c = models::weights::read_checkpoint(
        &models::ModelFiles::dir(&fixture("glm4_moe_lite_nvfp4_modelopt")).unwrap(),
    )
    .unwrap();
    let experts = &c.quant["model.layers.1.mlp.experts.up_proj"];
    assert_eq!(
        (experts.mode, experts.group_size),
        (mlx::QuantMode::Nvfp4, 16)
    );
    assert_eq!(
        c.tensors["model.layers.1.mlp.experts.up_proj.global_scale"].shape(),
        vec![8],
        "one global scale per expert"
    );
    assert!(c.decoded_fp8.is_empty());
}
