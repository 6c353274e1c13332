//! A packed forward of several sequences gives each row what the row gives alone: for every
//! fixture model (sliding windows of 8, so rows wrap their rings; KV-shared layers; MLA),
//! rows of mixed lengths and offsets, prefill and decode mixed, over several steps. The solo
//! path is the one checked against transformers (golden.rs).

use mlx::{Array, Dtype};
use models::{load, CausalLm, DtypeChoice, LayerCache, PackedRow};
use std::path::PathBuf;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/models")
        .join(name)
}

fn tokens(ids: &[i32]) -> Array {
    Array::from_slice(ids, &[1, ids.len() as i32]).unwrap()
}

/// Deterministic token ids in the vocabulary.
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

/// Steps of (row, tokens) pieces: each step feeds some rows, each a piece of its own length.
fn check(m: &dyn CausalLm, name: &str, steps: &[Vec<(usize, usize)>]) {
    let rows = 1 + steps.iter().flatten().map(|(r, _)| *r).max().unwrap();
    let streams: Vec<Vec<i32>> = (0..rows).map(|r| ids(r, 64)).collect();
    let mut fed = vec![0usize; rows];
    let mut packed: Vec<Vec<LayerCache>> = (0..rows).map(|_| m.make_caches()).collect();
    let mut solo: Vec<Vec<LayerCache>> = (0..rows).map(|_| m.make_caches()).collect();
    for (s, step) in steps.iter().enumerate() {
        let mut all = Vec::new();
        let mut want = Vec::new();
        for &(r, n) in step {
            let piece = &streams[r][fed[r]..fed[r] + n];
            all.extend_from_slice(piece);
            let h = m.forward(&tokens(piece), &mut solo[r]).unwrap();
            want.extend(m.logits(&h).unwrap().to_vec::<f32>().unwrap());
            fed[r] += n;
        }
        // Borrow each stepped row's caches once, in step order.
        let mut refs: Vec<Option<&mut Vec<LayerCache>>> = packed.iter_mut().map(Some).collect();
        let mut batch: Vec<PackedRow<'_>> = step
            .iter()
            .map(|&(r, n)| PackedRow::text(n, refs[r].take().expect("a row appears once per step")))
            .collect();
        let h = m.forward_packed(&tokens(&all), &mut batch).unwrap();
        let got = m.logits(&h).unwrap().to_vec::<f32>().unwrap();
        let d = max_diff(&got, &want);
        assert!(d < 1e-4, "{name} step {s}: max |Δ| {d}");
        let v = m.vocab_size();
        let argmax = |x: &[f32]| -> Vec<usize> {
            x.chunks(v)
                .map(|r| (0..v).max_by(|&a, &b| r[a].total_cmp(&r[b])).unwrap())
                .collect()
        };
        assert_eq!(argmax(&got), argmax(&want), "{name} step {s}");
    }
    for r in 0..rows {
        for (a, b) in packed[r].iter().zip(&solo[r]) {
            assert_eq!(a.offset(), b.offset(), "{name} row {r}");
        }
    }
}

#[test]
fn packed_rows_match_each_row_alone() {
    // Row 0 prefills long (past the window of 8) while row 1 decodes; then three rows decode
    // together; then a verify-sized block beside single tokens; then one row alone.
    let mut steps = vec![vec![(0, 13), (1, 3)], vec![(1, 1), (0, 1), (2, 9)]];
    for _ in 0..10 {
        steps.push(vec![(0, 1), (1, 1), (2, 1)]);
    }
    steps.push(vec![(2, 4), (0, 1), (1, 5)]);
    steps.push(vec![(1, 1)]);
    steps.push(vec![(0, 1), (2, 1), (1, 1)]);
    for name in [
        "gemma4_e2b_like",
        "gemma4_26b_a4b_like",
        "gemma4_31b_like",
        "glm4_moe_lite",
        "glm4_moe_lite_q4",
        "glm4_moe_lite_q3",
        "gemma4_26b_a4b_like_mixed",
        "gemma4_26b_a4b_like_mxfp4",
        "glm4_moe_lite_nvfp4",
    ] {
        let m = load(&fixture(name), DtypeChoice::Fixed(Dtype::F32)).unwrap();
        check(&*m.model, name, &steps);
    }
}

#[test]
fn packed_batches_are_checked() {
    let m = load(&fixture("gemma4_e2b_like"), DtypeChoice::Fixed(Dtype::F32)).unwrap();
    let mut a = m.model.make_caches();
    let mut b = m.model.make_caches();
    // Lengths that do not add up to the tokens given.
    let e = m
        .model
        .forward_packed(
            &tokens(&[1, 2, 3]),
            &mut [PackedRow::text(1, &mut a), PackedRow::text(1, &mut b)],
        )
        .unwrap_err();
    assert!(e.to_string().contains("packed forward of 3 tokens"), "{e}");
    // A batch dimension is not how rows are given.
    let e = m
        .model
        .forward(
            &Array::from_slice(&[1i32, 2], &[2, 1]).unwrap(),
            &mut m.model.make_caches(),
        )
        .unwrap_err();
    assert!(e.to_string().contains("forward_packed"), "{e}");
}

/// A gemma4 decode step writes each layer's keys and values inside its attention op, into the
/// cache's own buffers: no SliceUpdate or Slice for the caches, one attention op per layer (the
/// KV-shared layers' included), and over many steps, wrapped sliding rings included, no buffer
/// copied.
#[test]
fn a_gemma4_decode_step_writes_its_caches_in_place_inside_attention() {
    for name in ["gemma4_e2b_like", "gemma4_31b_like", "gemma4_26b_a4b_like"] {
        let m = load(&fixture(name), DtypeChoice::Fixed(Dtype::F32)).unwrap();
        let model = &*m.model;
        let mut caches = model.make_caches();
        model
            .forward(&tokens(&ids(1, 12)), &mut caches)
            .unwrap()
            .eval()
            .unwrap();
        let copies = || mlx::fast::fused_kernel_counts().sdpa_write_copies;
        let before = copies();
        for (step, &t) in ids(2, 20).iter().enumerate() {
            let h = model.forward(&tokens(&[t]), &mut caches).unwrap();
            let logits = model.logits(&h).unwrap();
            // Past the first step, which regrows the rings a batched write left linear.
            if step == 5 {
                let ops = mlx::graph_ops(&[&logits]);
                let count = |op: &str| ops.iter().find(|(n, _)| n == op).map_or(0, |(_, c)| *c);
                assert_eq!(count("SliceUpdate"), 0, "{name}: {ops:?}");
                let cfg: serde_json::Value = serde_json::from_slice(
                    &std::fs::read(fixture(name).join("config.json")).unwrap(),
                )
                .unwrap();
                let field = |k: &str| cfg[k].as_u64().or(cfg["text_config"][k].as_u64());
                let layers = field("num_hidden_layers").unwrap() as usize;
                // The only slices: each layer's per-layer embedding and its router's top experts,
                // where the model has them.
                let ple = field("hidden_size_per_layer_input").unwrap_or(0) > 0;
                let moe = cfg["enable_moe_block"].as_bool().unwrap_or(false)
                    || cfg["text_config"]["enable_moe_block"]
                        .as_bool()
                        .unwrap_or(false);
                let slices = layers * (usize::from(ple) + usize::from(moe));
                assert_eq!(count("Slice"), slices, "{name}: {ops:?}");
                assert_eq!(count("MlxrCpuSdpa"), layers, "{name}: {ops:?}");
            }
            logits.eval().unwrap();
        }
        assert_eq!(
            copies(),
            before,
            "{name}: a decode step copied a cache buffer"
        );
    }
}

/// In a quantized gemma4 decode step each layer's attention output projection computes the
/// residual update after it and the feed-forward block's input norm (one op, not two), and its
/// q/k/v projections their heads' norms and rotation. The
/// values are checked against mlx-lm by `golden.rs` (`gemma4_moe_q4_matches_mlx_lm`) and the
/// op against the two it stands for in `quantized_kernel.rs`.
#[test]
fn a_quantized_gemma4_projection_computes_the_residual_update_after_it() {
    let name = "gemma4_26b_a4b_like_q4";
    let m = load(&fixture(name), DtypeChoice::Auto).unwrap();
    let model = &*m.model;
    let mut caches = model.make_caches();
    model
        .forward(&tokens(&ids(3, 9)), &mut caches)
        .unwrap()
        .eval()
        .unwrap();
    let h = model.forward(&tokens(&[17]), &mut caches).unwrap();
    let logits = model.logits(&h).unwrap();
    let ops = mlx::graph_ops(&[&logits]);
    let count = |op: &str| ops.iter().find(|(n, _)| n == op).map_or(0, |(_, c)| *c);
    let cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixture(name).join("config.json")).unwrap()).unwrap();
    let layers = cfg["num_hidden_layers"]
        .as_u64()
        .or(cfg["text_config"]["num_hidden_layers"].as_u64())
        .unwrap() as usize;
    assert_eq!(count("MlxrCpuQuantizedMatmulNorm"), layers, "{ops:?}");
    // And each layer with keys of its own makes its queries, keys and values in one op.
    let shared = cfg["num_kv_shared_layers"]
        .as_u64()
        .or(cfg["text_config"]["num_kv_shared_layers"].as_u64())
        .unwrap_or(0) as usize;
    assert_eq!(
        count("MlxrCpuQuantizedQkvHeads"),
        layers - shared,
        "{ops:?}"
    );
    assert_eq!(count("MlxrCpuQuantizedMatmuls"), 0, "{ops:?}");
    logits.eval().unwrap();
}
