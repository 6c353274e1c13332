//! `create` against references: stored models against the checkpoints they came from
//! (transformers' logits), int8 models against mlx-lm's own quantized forward, and int4 models
//! (mixed precision, which no mlx-lm fixture has) against the float forward of what their
//! quantization stands for.

mod common;
use common::*;
use mlx::Array;
use models::CausalLm;
use std::collections::HashMap;
use store::{CreateOptions, QuantType};

fn golden(name: &str) -> HashMap<String, Array> {
    mlx::io::load_safetensors(fixture(name).join("golden.safetensors"))
        .unwrap()
        .arrays
}

fn logits(m: &dyn CausalLm, ids: &[i32]) -> Vec<f32> {
    let mut caches = m.make_caches();
    let t = Array::from_slice(ids, &[1, ids.len() as i32]).unwrap();
    let h = m.forward(&t, &mut caches).unwrap();
    m.logits(&h).unwrap().to_vec::<f32>().unwrap()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn argmaxes(v: &[f32], vocab: usize) -> Vec<usize> {
    v.chunks(vocab)
        .map(|r| {
            r.iter()
                .enumerate()
                .max_by(|a, b| a.1.total_cmp(b.1))
                .unwrap()
                .0
        })
        .collect()
}

/// Logits of the stored `name` against the golden logits of `reference`, full and incremental.
fn check(s: &Scratch, name: &str, reference: &str, tol: f32) -> f32 {
    let m = s.load(name);
    let g = golden(reference);
    let ids = g["input_ids"].to_vec::<i32>().unwrap();
    let v = m.model.vocab_size();
    let want = g["logits"].to_vec::<f32>().unwrap();
    let got = logits(&*m.model, &ids);
    let d = max_diff(&got, &want);
    assert!(d <= tol, "{name} vs {reference}: max |Δ| {d} > {tol}");
    assert_eq!(argmaxes(&got, v), argmaxes(&want, v), "{name}: argmax");
    // Token by token after a 12-token prefill, through the same caches.
    let mut caches = m.model.make_caches();
    let mut inc = Vec::new();
    let t = Array::from_slice(&ids[..12], &[1, 12]).unwrap();
    let h = m.model.forward(&t, &mut caches).unwrap();
    inc.extend(m.model.logits(&h).unwrap().to_vec::<f32>().unwrap());
    for &id in &ids[12..] {
        let t = Array::from_slice(&[id], &[1, 1]).unwrap();
        let h = m.model.forward(&t, &mut caches).unwrap();
        inc.extend(m.model.logits(&h).unwrap().to_vec::<f32>().unwrap());
    }
    let want_inc = g["logits_incremental_split12"].to_vec::<f32>().unwrap();
    let di = max_diff(&inc, &want_inc);
    assert!(di <= tol, "{name} incremental: max |Δ| {di} > {tol}");
    d.max(di)
}

/// The precision `show` reports for tensor `name` of a stored model.
fn precision_of(tensors: &[store::show::TensorPrecision], name: &str) -> String {
    tensors
        .iter()
        .find(|t| t.name == name)
        .unwrap_or_else(|| panic!("no tensor {name}"))
        .precision
        .clone()
}

fn quantize(target: QuantType) -> CreateOptions {
    CreateOptions {
        quantize: Some(target),
        quantize_draft: None,
    }
}

/// The stored model with every quantized tensor replaced by what it stands for
/// (`dequantize(w, scale, bias)`, MLX's), in float: read by the float path, which is checked
/// against transformers, it is a reference for the quantized forward that shares none of its
/// loading code. Also checks each quantized tensor against the checkpoint's own: within one
/// quantization step everywhere.
fn dequantized_twin(s: &Scratch, model: &str, checkpoint: &str) -> std::path::PathBuf {
    let r = s.store.resolve(&name(model)).unwrap();
    let (stored, quant) = models::weights::read_tensors_quantized(&r.target).unwrap();
    let source =
        models::weights::read_tensors(&models::ModelFiles::dir(&fixture(checkpoint)).unwrap())
            .unwrap();
    let mut out: Vec<(String, Array)> = Vec::new();
    for (k, a) in &stored {
        if k.ends_with(".scales") || k.ends_with(".biases") {
            continue;
        }
        let module = k.strip_suffix(".weight").unwrap_or(k);
        let Some(&p) = quant.get(module) else {
            out.push((k.clone(), a.clone()));
            continue;
        };
        let scales = stored[&format!("{module}.scales")].clone();
        let q = mlx::Quantized {
            weight: a.clone(),
            biases: stored.get(&format!("{module}.biases")).cloned(),
            scales: scales.clone(),
            group_size: p.group_size,
            bits: p.bits,
            mode: p.mode,
            panels: false,
        };
        let w = q.dequantize().unwrap().astype(mlx::Dtype::F32).unwrap();
        // Stacked per-expert weights have no single source tensor; the others do. (An affine
        // step is its scale; a microscaling code's step depends on the code.)
        let affine = p.mode == mlx::QuantMode::Affine;
        if let Some(src) = source
            .get(k)
            .or_else(|| source.get(module))
            .filter(|_| affine)
        {
            let src = src
                .astype(mlx::Dtype::F32)
                .unwrap()
                .to_vec::<f32>()
                .unwrap();
            let err = max_diff(&w.to_vec::<f32>().unwrap(), &src);
            let step = scales
                .to_vec::<f32>()
                .unwrap()
                .iter()
                .fold(0f32, |m, x| m.max(x.abs()));
            // MLX snaps each group's zero point to the grid, so an element may be off by up to
            // one step (not half).
            assert!(
                err <= step * 1.001,
                "{k}: |dequantized - source| {err} > a step {step}"
            );
        }
        // Under the checkpoint's own name (a fused `experts.gate_up_proj` has no `.weight`).
        let name = if !source.contains_key(k) && source.contains_key(module) {
            module.to_string()
        } else {
            k.clone()
        };
        out.push((name, w));
    }
    let dir = s.dir.path().join(format!("{model}-dequantized"));
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(fixture(checkpoint).join(f), dir.join(f)).unwrap();
    }
    let refs: Vec<(&str, &Array)> = out.iter().map(|(k, v)| (k.as_str(), v)).collect();
    mlx::io::save_safetensors(dir.join("model.safetensors"), &refs).unwrap();
    dir
}

/// Logits of the stored `model` against those of the float model at `reference`.
fn check_against(s: &Scratch, model: &str, reference: &std::path::Path, tol: f32) -> f32 {
    let m = s.load(model);
    let twin = models::load(reference, models::DtypeChoice::Fixed(mlx::Dtype::F32)).unwrap();
    // The golden input of the checkpoint the twin was made from.
    let checkpoint = std::fs::read_to_string(reference.join("config.json")).unwrap();
    let golden_of = if checkpoint.contains("glm4_moe_lite") {
        "glm4_moe_lite"
    } else {
        "gemma4_26b_a4b_like"
    };
    let ids = golden(golden_of)["input_ids"].to_vec::<i32>().unwrap();
    let got = logits(&*m.model, &ids);
    let want = logits(&*twin.model, &ids);
    let d = max_diff(&got, &want);
    assert!(
        d <= tol,
        "{model} vs its dequantized twin: max |Δ| {d} > {tol}"
    );
    assert_eq!(
        argmaxes(&got, m.model.vocab_size()),
        argmaxes(&want, m.model.vocab_size())
    );
    d
}

#[test]
fn quantized_glm_serves_what_its_quantization_stands_for() {
    // ollama's policy at int4: down projections, lm_head at int8, the embedding, norms, the
    // router and matrices that do not fit a group in float.
    let s = Scratch::new();
    let r = s
        .create("glm-q4", &from("glm4_moe_lite"), &quantize(QuantType::Q4))
        .unwrap();
    assert_eq!(r.config.part.file_type, "int4");
    let p = &r.target.precisions;
    assert!(
        p["int4"] > 0 && p["int8"] > 0 && p["F32"] > 0,
        "mixed: {p:?}"
    );
    let stored = s.store.resolve(&name("glm-q4")).unwrap();
    let tensors = store::show::precisions(&stored.target).unwrap();
    assert_eq!(
        store::show::mtp_layers(&stored.target, &tensors),
        1,
        "the MTP layer is kept"
    );
    let of = |n: &str| precision_of(&tensors, n);
    assert_eq!(of("lm_head.weight"), "int8");
    assert_eq!(
        of("model.layers.1.mlp.experts.down_proj.weight"),
        "F32",
        "input 32 fits no group"
    );
    assert_eq!(of("model.layers.1.mlp.experts.up_proj.weight"), "int4");
    assert_eq!(of("model.layers.0.mlp.down_proj.weight"), "int8");
    assert_eq!(of("model.embed_tokens.weight"), "F32");
    let twin = dequantized_twin(&s, "glm-q4", "glm4_moe_lite");
    let d = check_against(&s, "glm-q4", &twin, 1e-3);
    eprintln!("glm4_moe_lite int4 vs its dequantized twin: max |Δ| {d:e}");
}

/// ollama's FP types: nvfp4 on GLM (groups of 16; sensitive projections at mxfp8, expert
/// stacks not promoted), mxfp4 and mxfp8 on gemma4's MoE form. Each serves what its
/// quantization stands for, and is really quantized.
#[test]
fn fp_quantized_models_serve_what_their_quantization_stands_for() {
    let s = Scratch::new();
    let r = s
        .create(
            "glm-nvfp4",
            &from("glm4_moe_lite"),
            &quantize(QuantType::Nvfp4),
        )
        .unwrap();
    assert_eq!(r.config.part.file_type, "nvfp4");
    let stored = s.store.resolve(&name("glm-nvfp4")).unwrap();
    let tensors = store::show::precisions(&stored.target).unwrap();
    let of = |n: &str| precision_of(&tensors, n);
    assert_eq!(of("lm_head.weight"), "mxfp8");
    assert_eq!(of("model.layers.0.mlp.down_proj.weight"), "mxfp8");
    assert_eq!(
        of("model.layers.1.mlp.experts.down_proj.weight"),
        "nvfp4",
        "input 32 is two groups of 16, and stacks are not promoted"
    );
    assert_eq!(of("model.layers.1.mlp.experts.up_proj.weight"), "nvfp4");
    assert_eq!(of("model.embed_tokens.weight"), "F32");
    let twin = dequantized_twin(&s, "glm-nvfp4", "glm4_moe_lite");
    let d = check_against(&s, "glm-nvfp4", &twin, 1e-3);
    eprintln!("glm4_moe_lite nvfp4 vs its dequantized twin: max |Δ| {d:e}");
    for (model, q) in [
        ("moe-mxfp4", QuantType::Mxfp4),
        ("moe-mxfp8", QuantType::Mxfp8),
    ] {
        let r = s
            .create(model, &from("gemma4_26b_a4b_like"), &quantize(q))
            .unwrap();
        assert_eq!(r.config.part.file_type, q.name());
        assert!(
            r.target.precisions[q.name()] > 0,
            "{:?}",
            r.target.precisions
        );
        let twin = dequantized_twin(&s, model, "gemma4_26b_a4b_like");
        let d = check_against(&s, model, &twin, 1e-3);
        eprintln!(
            "gemma4_26b_a4b_like {} vs its dequantized twin: max |Δ| {d:e}",
            q.name()
        );
        // Not the float model's logits.
        let float =
            models::load(&fixture("gemma4_26b_a4b_like"), models::DtypeChoice::Auto).unwrap();
        let m = s.load(model);
        let ids = golden("gemma4_26b_a4b_like")["input_ids"]
            .to_vec::<i32>()
            .unwrap();
        assert!(
            max_diff(&logits(&*m.model, &ids), &logits(&*float.model, &ids)) > 1e-4,
            "{model}: the float model's logits"
        );
    }
}

/// A block-FP8 checkpoint (GLM's FP8 release form) is stored as ollama imports one: its float8
/// weights decoded and quantized to mxfp8 where ollama's policy quantizes them (bfloat16 where
/// it declines), every other tensor as the checkpoint has it; quantizing it otherwise is
/// refused. Each mxfp8 tensor is MLX's quantization of the weight as mlx-lm decodes it.
#[test]
fn block_fp8_checkpoints_are_stored_as_mxfp8() {
    let s = Scratch::new();
    let e = s
        .create(
            "glm-fp8-q4",
            &from("glm4_moe_lite_fp8"),
            &quantize(QuantType::Q4),
        )
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("block-FP8") && e.contains("--quantize int4"),
        "{e}"
    );

    let r = s
        .create(
            "glm-fp8",
            &from("glm4_moe_lite_fp8"),
            &CreateOptions::default(),
        )
        .unwrap();
    assert_eq!(r.config.part.file_type, "mxfp8");
    let stored = s.store.resolve(&name("glm-fp8")).unwrap();
    let tensors = store::show::precisions(&stored.target).unwrap();
    let of = |n: &str| precision_of(&tensors, n);
    assert_eq!(of("model.layers.0.mlp.down_proj.weight"), "mxfp8");
    assert_eq!(of("model.layers.1.mlp.experts.up_proj.weight"), "mxfp8");
    assert_eq!(
        of("model.layers.0.self_attn.q_b_proj.weight"),
        "BF16",
        "rows of 48 are no whole groups of 32: decoded, kept in bfloat16"
    );
    // Not float8 in the checkpoint: as it is, though the policy would quantize them.
    assert_eq!(of("lm_head.weight"), "BF16");
    assert_eq!(of("model.embed_tokens.weight"), "BF16");
    assert!(!tensors.iter().any(|t| t.name.ends_with("_scale_inv")));

    let g = golden("glm4_moe_lite_fp8");
    let (stored_tensors, quant) = models::weights::read_tensors_quantized(&stored.target).unwrap();
    let mut quantized = 0;
    for (k, decoded) in g.iter().filter(|(k, _)| k.starts_with("decoded.")) {
        let w = &k["decoded.".len()..];
        // Expert 0's weight is the first of its layer's stack.
        let (stored_name, expert) = match w.split_once(".experts.0.") {
            Some((layer, proj)) => (format!("{layer}.experts.{proj}"), true),
            None => (w.to_string(), false),
        };
        let module = stored_name.strip_suffix(".weight").unwrap();
        let pick = |a: &Array| {
            if expert {
                a.index(&[mlx::Ix::At(0)]).unwrap()
            } else {
                a.clone()
            }
        };
        let want = decoded.astype(mlx::Dtype::Bf16).unwrap();
        match quant.get(module) {
            Some(p) => {
                assert_eq!(
                    (p.mode, p.bits, p.group_size),
                    (mlx::QuantMode::Mxfp8, 8, 32)
                );
                let q = want.quantize_as(mlx::QuantMode::Mxfp8, 32, 8).unwrap();
                let codes = pick(&stored_tensors[&stored_name]);
                let scales = pick(&stored_tensors[&format!("{module}.scales")]);
                assert_eq!(
                    codes.to_vec::<u32>().unwrap(),
                    q.weight.to_vec::<u32>().unwrap(),
                    "{w}"
                );
                assert_eq!(
                    scales.to_vec::<u8>().unwrap(),
                    q.scales.to_vec::<u8>().unwrap(),
                    "{w}"
                );
                quantized += 1;
            }
            None => {
                let got = pick(&stored_tensors[&stored_name]);
                assert_eq!(got.dtype(), mlx::Dtype::Bf16, "{w}");
                let f32s = |a: &Array| a.astype(mlx::Dtype::F32).unwrap().to_vec::<f32>().unwrap();
                assert_eq!(f32s(&got), f32s(&want), "{w}");
            }
        }
    }
    assert!(quantized >= 5, "{quantized}");
    let twin = dequantized_twin(&s, "glm-fp8", "glm4_moe_lite_fp8");
    let d = check_against(&s, "glm-fp8", &twin, 1e-3);
    eprintln!("glm4_moe_lite block-FP8 as mxfp8 vs its dequantized twin: max |Δ| {d:e}");
}

/// NVIDIA's nvfp4 checkpoints (compressed-tensors, ModelOpt) are stored as ollama fuses them:
/// each module's codes, E4M3 scales and global scale in one blob (`<m>.weight`, `.scale`,
/// `.global_scale`), nvfp4 in groups of 16; the stored model computes what the checkpoint does,
/// bit for bit; requantizing is refused.
#[test]
fn nvidia_nvfp4_checkpoints_are_stored_with_their_global_scales() {
    let s = Scratch::new();
    for fixture_name in ["glm4_moe_lite_nvfp4_ct", "glm4_moe_lite_nvfp4_modelopt"] {
        let e = s
            .create("again", &from(fixture_name), &quantize(QuantType::Q4))
            .unwrap_err()
            .to_string();
        assert!(e.contains("already quantized (nvfp4)"), "{e}");
        let model = format!("{fixture_name}-stored").replace('_', "-");
        let r = s
            .create(&model, &from(fixture_name), &CreateOptions::default())
            .unwrap();
        assert_eq!(r.config.part.file_type, "nvfp4");
        let stored = s.store.resolve(&name(&model)).unwrap();
        let tensors = store::show::precisions(&stored.target).unwrap();
        let of = |n: &str| precision_of(&tensors, n);
        assert_eq!(of("model.layers.0.self_attn.o_proj.weight"), "nvfp4");
        assert_eq!(of("model.layers.1.mlp.experts.up_proj.weight"), "nvfp4");
        assert_eq!(of("lm_head.weight"), "BF16");
        let extra: Vec<&String> = tensors
            .iter()
            .map(|t| &t.name)
            .filter(|n| {
                n.contains("input_scale")
                    || n.contains("input_global")
                    || n.ends_with("global_scale")
            })
            .collect();
        assert!(extra.is_empty(), "{extra:?}");
        let blob = stored
            .target
            .tensors
            .iter()
            .find(|p| {
                mlx::io::read_header(p)
                    .unwrap()
                    .0
                    .iter()
                    .any(|t| t.name == "model.layers.0.self_attn.o_proj.weight.global_scale")
            })
            .is_some();
        assert!(blob, "{model}: the global scale is in the module's blob");

        let m = s.load(&model);
        let direct = models::load(
            &fixture(fixture_name),
            models::DtypeChoice::Fixed(mlx::Dtype::F32),
        )
        .unwrap();
        let ids = golden("glm4_moe_lite_nvfp4_ct")["input_ids"]
            .to_vec::<i32>()
            .unwrap();
        assert_eq!(
            logits(&*m.model, &ids),
            logits(&*direct.model, &ids),
            "{model}: the stored model computes what the checkpoint does"
        );
    }
    check(
        &s,
        "glm4-moe-lite-nvfp4-ct-stored",
        "glm4_moe_lite_nvfp4_ct",
        1e-4,
    );
}

#[test]
fn quantized_gemma_moe_matches_mlx_lm() {
    // Fused experts are split and stacked as mlx-lm stores them, then quantized; the router
    // stays in full precision (the reference was made with mlx-lm under the same rule).
    let s = Scratch::new();
    let r = s
        .create(
            "moe-q8",
            &from("gemma4_26b_a4b_like"),
            &quantize(QuantType::Q8),
        )
        .unwrap();
    assert_eq!(r.config.part.file_type, "int8");
    assert!(r.config.part.quantization.is_none(), "ollama's config blob");
    // At int8 ollama's policy and mlx-lm's (router in full precision) agree tensor for tensor.
    let d = check(&s, "moe-q8", "gemma4_26b_a4b_like_q8_fp_router", 1e-3);
    eprintln!("gemma4_26b_a4b_like q8 vs mlx-lm: max |Δ| {d:e}");
}

#[test]
fn unquantized_models_match_their_references() {
    let s = Scratch::new();
    for (name, tol) in [
        ("gemma4_e2b_like", 1e-4),
        ("gemma4_26b_a4b_like", 1e-4),
        ("glm4_moe_lite", 1e-4),
        // An mlx-lm quantized directory is stored as it is, in any of MLX's modes.
        ("gemma4_26b_a4b_like_q4", 1e-3),
        ("gemma4_26b_a4b_like_mxfp4", 1e-3),
        ("glm4_moe_lite_nvfp4", 1e-3),
    ] {
        let r = s
            .create(name, &from(name), &CreateOptions::default())
            .unwrap();
        assert!(r.config.draft.is_none());
        check(&s, name, name, tol);
    }
}

#[test]
fn multimodal_gemma_keeps_its_towers_and_quantizes_the_text_model() {
    // The 26B-style MoE fixture wrapped the way multimodal checkpoints are: text weights under
    // model.language_model, a vision tower beside them.
    let s = Scratch::new();
    let src = fixture("gemma4_26b_a4b_like");
    let dir = s.dir.path().join("multimodal");
    std::fs::create_dir(&dir).unwrap();
    for f in [
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        std::fs::copy(src.join(f), dir.join(f)).unwrap();
    }
    let text: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    let cfg = serde_json::json!({
        "model_type": "gemma4",
        "architectures": ["Gemma4ForConditionalGeneration"],
        "text_config": text,
        "vision_config": {"hidden_size": 64},
    });
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    let t = mlx::io::load_safetensors(src.join("model.safetensors"))
        .unwrap()
        .arrays;
    let mut renamed: Vec<(String, Array)> = t
        .into_iter()
        .map(|(k, v)| (k.replacen("model.", "model.language_model.", 1), v))
        .collect();
    let tower = "model.vision_tower.encoder.layers.0.mlp.fc1.weight";
    renamed.push((
        tower.into(),
        Array::ones(&[64, 64], mlx::Dtype::F32).unwrap(),
    ));
    let refs: Vec<(&str, &Array)> = renamed.iter().map(|(k, v)| (k.as_str(), v)).collect();
    mlx::io::save_safetensors(dir.join("model.safetensors"), &refs).unwrap();

    let r = s
        .create(
            "mm",
            &format!("FROM {}\n", dir.display()),
            &quantize(QuantType::Q8),
        )
        .unwrap();
    assert_eq!(r.target.architecture, "Gemma4ForConditionalGeneration");
    let d = check(&s, "mm", "gemma4_26b_a4b_like_q8_fp_router", 1e-3);
    eprintln!("multimodal gemma4 MoE q8 vs mlx-lm: max |Δ| {d:e}");
    // The tower is stored, in full precision.
    let stored = s.store.resolve(&name("mm")).unwrap();
    let tensors = models::weights::read_tensors(&stored.target).unwrap();
    assert_eq!(tensors[tower].dtype(), mlx::Dtype::F32);
    assert!(!tensors.contains_key(&tower.replace(".weight", ".scales")));
    // The fused experts stay fused, quantized as one tensor, as ollama stores them.
    assert!(tensors.contains_key("model.language_model.layers.0.experts.gate_up_proj.scales"));
}
