//! `create` against references: a quantized target against mlx-lm's own quantized forward, and
//! stored models against the checkpoints they came from.

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

fn quantize(target: QuantType) -> CreateOptions {
    CreateOptions {
        quantize: Some(target),
        quantize_draft: None,
    }
}

#[test]
fn quantized_glm_matches_mlx_lm() {
    let s = Scratch::new();
    let r = s
        .create("glm-q4", &from("glm4_moe_lite"), &quantize(QuantType::Q4))
        .unwrap();
    assert_eq!(r.config.part.mtp_layers, 1, "the MTP layer is kept");
    let d = check(&s, "glm-q4", "glm4_moe_lite_q4", 1e-3);
    eprintln!("glm4_moe_lite q4 vs mlx-lm: max |Δ| {d:e}");
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
    let q = r.config.part.quantization.as_ref().unwrap();
    assert_eq!((q.bits, q.group_size, q.kind.as_str()), (8, 64, "q8"));
    assert_eq!(r.config.part.file_type, "Q8");
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
        // An mlx-lm quantized directory is stored as it is.
        ("gemma4_26b_a4b_like_q4", 1e-3),
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
    assert_eq!(r.config.part.architecture, "Gemma4ForConditionalGeneration");
    let d = check(&s, "mm", "gemma4_26b_a4b_like_q8_fp_router", 1e-3);
    eprintln!("multimodal gemma4 MoE q8 vs mlx-lm: max |Δ| {d:e}");
    // The tower is stored, in full precision.
    let stored = s.store.resolve(&name("mm")).unwrap();
    let tensors = models::weights::read_tensors(&stored.target).unwrap();
    assert_eq!(tensors[tower].dtype(), mlx::Dtype::F32);
    assert!(!tensors.contains_key(&tower.replace(".weight", ".scales")));
    assert!(
        tensors.contains_key("model.language_model.layers.0.experts.switch_glu.gate_proj.scales")
    );
}
