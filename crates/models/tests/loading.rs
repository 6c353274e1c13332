//! Loading every layout the ecosystem writes, and failing clearly on everything else.

use mlx::{Array, Dtype, Ix};
use models::{load, DtypeChoice, LoadedModel, ModelError};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/models")
        .join(name)
}

/// A copy of a fixture model directory that a test may change.
struct Scratch {
    dir: tempfile::TempDir,
}

impl Scratch {
    fn of(name: &str) -> Scratch {
        let dir = tempfile::tempdir().unwrap();
        for e in std::fs::read_dir(fixture(name)).unwrap() {
            let p = e.unwrap().path();
            std::fs::copy(&p, dir.path().join(p.file_name().unwrap())).unwrap();
        }
        Scratch { dir }
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    fn config(&self) -> Value {
        serde_json::from_str(&std::fs::read_to_string(self.path().join("config.json")).unwrap())
            .unwrap()
    }

    fn set_config(&self, v: &Value) {
        std::fs::write(
            self.path().join("config.json"),
            serde_json::to_string_pretty(v).unwrap(),
        )
        .unwrap();
    }

    fn tensors(&self) -> HashMap<String, Array> {
        mlx::io::load_safetensors(self.path().join("model.safetensors"))
            .unwrap()
            .arrays
    }

    fn set_tensors(&self, t: &HashMap<String, Array>) {
        std::fs::remove_file(self.path().join("model.safetensors")).ok();
        save(&self.path().join("model.safetensors"), t);
    }

    fn load(&self) -> models::Result<LoadedModel> {
        load(self.path(), DtypeChoice::Fixed(Dtype::F32))
    }
}

fn save(path: &Path, t: &HashMap<String, Array>) {
    let refs: Vec<(&str, &Array)> = t.iter().map(|(k, v)| (k.as_str(), v)).collect();
    mlx::io::save_safetensors(path, &refs).unwrap();
}

/// Last-position logits of the golden token sequence.
fn last_logits(m: &LoadedModel) -> Vec<f32> {
    let ids: Vec<i32> = vec![2, 17, 200, 45, 3, 99, 128, 7, 7, 250, 31, 64];
    let mut c = m.model.make_caches();
    let h = m
        .model
        .forward(&Array::from_slice(&ids, &[1, 12]).unwrap(), &mut c)
        .unwrap();
    let h = h.index(&[Ix::full(), Ix::At(-1)]).unwrap();
    m.model
        .logits(&h)
        .unwrap()
        .astype(Dtype::F32)
        .unwrap()
        .to_vec()
        .unwrap()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn reference(name: &str) -> Vec<f32> {
    last_logits(&load(&fixture(name), DtypeChoice::Fixed(Dtype::F32)).unwrap())
}

#[test]
fn gemma4_multimodal_wrapper_with_towers() {
    let s = Scratch::of("gemma4_e2b_like");
    let text = s.config();
    s.set_config(
        &json!({"model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"],
                         "text_config": text, "vision_config": {"hidden_size": 16}}),
    );
    let mut t: HashMap<String, Array> = s
        .tensors()
        .into_iter()
        .map(|(k, v)| (k.replacen("model.", "model.language_model.", 1), v))
        .collect();
    // Towers and clip buffers that text generation must skip.
    t.insert(
        "model.vision_tower.encoder.weight".into(),
        Array::zeros(&[4, 4], Dtype::F32).unwrap(),
    );
    t.insert(
        "model.embed_vision.embedding_projection.weight".into(),
        Array::zeros(&[4, 4], Dtype::F32).unwrap(),
    );
    s.set_tensors(&t);
    let m = s.load().unwrap();
    assert!(max_diff(&last_logits(&m), &reference("gemma4_e2b_like")) < 1e-5);
    assert!(m
        .unused_tensors
        .iter()
        .any(|n| n.starts_with("model.vision_tower")));
}

#[test]
fn gemma4_per_layer_config_spelling() {
    // transformers >= 5.2x writes per_layer_config instead of the global fields.
    let s = Scratch::of("gemma4_31b_like");
    let mut c = s.config();
    let ghd = c["global_head_dim"].clone();
    let gkv = c["num_global_key_value_heads"].clone();
    let obj = c.as_object_mut().unwrap();
    obj.remove("global_head_dim");
    obj.remove("num_global_key_value_heads");
    let per: serde_json::Map<String, Value> = [2, 5]
        .iter()
        .map(|i| {
            (
                i.to_string(),
                json!({"head_dim": ghd, "num_key_value_heads": gkv}),
            )
        })
        .collect();
    obj.insert("per_layer_config".into(), Value::Object(per));
    s.set_config(&c);
    assert!(
        max_diff(
            &last_logits(&s.load().unwrap()),
            &reference("gemma4_31b_like")
        ) < 1e-5
    );
}

#[test]
fn gemma4_window_pattern_instead_of_layer_types() {
    let s = Scratch::of("gemma4_26b_a4b_like");
    let mut c = s.config();
    c.as_object_mut().unwrap().remove("layer_types");
    c["sliding_window_pattern"] = json!(3); // S, S, F, S, S, F
    s.set_config(&c);
    assert!(
        max_diff(
            &last_logits(&s.load().unwrap()),
            &reference("gemma4_26b_a4b_like")
        ) < 1e-5
    );
}

#[test]
fn glm_alternative_spellings() {
    let s = Scratch::of("glm4_moe_lite");
    let mut c = s.config();
    let o = c.as_object_mut().unwrap();
    // Only the transformers spellings: mlp_layer_types and rope_parameters.
    for k in ["first_k_dense_replace", "rope_theta", "moe_layer_freq"] {
        o.remove(k);
    }
    s.set_config(&c);
    assert!(
        max_diff(
            &last_logits(&s.load().unwrap()),
            &reference("glm4_moe_lite")
        ) < 1e-5
    );
    // Only the mlx-lm / GLM-4.7-Flash spellings.
    let o = c.as_object_mut().unwrap();
    o.remove("mlp_layer_types");
    o.remove("rope_parameters");
    o.insert("first_k_dense_replace".into(), json!(1));
    o.insert("rope_theta".into(), json!(1000000.0));
    s.set_config(&c);
    assert!(
        max_diff(
            &last_logits(&s.load().unwrap()),
            &reference("glm4_moe_lite")
        ) < 1e-5
    );
}

#[test]
fn sharded_checkpoint_with_index() {
    let s = Scratch::of("glm4_moe_lite");
    let t = s.tensors();
    let mut names: Vec<&String> = t.keys().collect();
    names.sort();
    let (a, b) = names.split_at(names.len() / 2);
    let mut map = serde_json::Map::new();
    for (file, part) in [
        ("model-00001-of-00002.safetensors", a),
        ("model-00002-of-00002.safetensors", b),
    ] {
        let shard: HashMap<String, Array> =
            part.iter().map(|n| ((*n).clone(), t[*n].clone())).collect();
        save(&s.path().join(file), &shard);
        for n in part {
            map.insert((*n).clone(), json!(file));
        }
    }
    std::fs::remove_file(s.path().join("model.safetensors")).unwrap();
    std::fs::write(
        s.path().join("model.safetensors.index.json"),
        serde_json::to_string(&json!({"metadata": {}, "weight_map": map})).unwrap(),
    )
    .unwrap();
    assert!(
        max_diff(
            &last_logits(&s.load().unwrap()),
            &reference("glm4_moe_lite")
        ) < 1e-5
    );
}

/// A bf16 (or f16) checkpoint computes exactly like an f32 one holding the same rounded values.
#[test]
fn half_precision_checkpoints() {
    for half in [Dtype::Bf16, Dtype::F16] {
        let low = Scratch::of("gemma4_e2b_like");
        let rounded = Scratch::of("gemma4_e2b_like");
        let t = low.tensors();
        let cast: HashMap<String, Array> = t
            .iter()
            .map(|(k, v)| (k.clone(), v.astype(half).unwrap()))
            .collect();
        low.set_tensors(&cast);
        let back: HashMap<String, Array> = cast
            .iter()
            .map(|(k, v)| (k.clone(), v.astype(Dtype::F32).unwrap()))
            .collect();
        rounded.set_tensors(&back);
        let a = last_logits(&low.load().unwrap());
        let b = last_logits(&rounded.load().unwrap());
        assert_eq!(a, b, "{half:?}");
        assert!(max_diff(&a, &reference("gemma4_e2b_like")) < 0.5);
    }
}

fn load_err(s: &Scratch) -> String {
    match s.load() {
        Ok(_) => panic!("loaded a broken model"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn missing_tensor_is_named() {
    let s = Scratch::of("gemma4_31b_like");
    let mut t = s.tensors();
    t.remove("model.layers.3.self_attn.q_norm.weight");
    s.set_tensors(&t);
    let e = load_err(&s);
    assert!(
        e.contains("missing tensor model.layers.3.self_attn.q_norm.weight"),
        "{e}"
    );
}

#[test]
fn wrong_shape_is_named() {
    let s = Scratch::of("glm4_moe_lite");
    let mut t = s.tensors();
    t.insert(
        "model.layers.1.self_attn.o_proj.weight".into(),
        Array::zeros(&[64, 60], Dtype::F32).unwrap(),
    );
    s.set_tensors(&t);
    let e = load_err(&s);
    assert!(
        e.contains("model.layers.1.self_attn.o_proj.weight has shape [64, 60]")
            && e.contains("[64, 64]"),
        "{e}"
    );
}

#[test]
fn wrong_dtype_is_named() {
    let s = Scratch::of("gemma4_31b_like");
    let mut t = s.tensors();
    t.insert(
        "model.norm.weight".into(),
        Array::zeros(&[64], Dtype::I32).unwrap(),
    );
    s.set_tensors(&t);
    let e = load_err(&s);
    assert!(
        e.contains("model.norm.weight") && e.contains("floating-point"),
        "{e}"
    );
}

#[test]
fn truncated_safetensors_is_named() {
    let s = Scratch::of("gemma4_31b_like");
    let p = s.path().join("model.safetensors");
    let bytes = std::fs::read(&p).unwrap();
    std::fs::write(&p, &bytes[..bytes.len() / 2]).unwrap();
    let e = load_err(&s);
    assert!(e.contains("model.safetensors"), "{e}");
}

#[test]
fn config_problems_are_named() {
    let s = Scratch::of("gemma4_31b_like");
    let mut c = s.config();
    c.as_object_mut().unwrap().remove("hidden_size");
    s.set_config(&c);
    let e = load_err(&s);
    assert!(
        e.contains("config.json") && e.contains("hidden_size"),
        "{e}"
    );

    c["hidden_size"] = json!("sixty-four");
    s.set_config(&c);
    let e = load_err(&s);
    assert!(
        e.contains("config.json") && e.contains("invalid type"),
        "{e}"
    );

    c["hidden_size"] = json!(64);
    c["model_type"] = json!("llama");
    s.set_config(&c);
    let e = s.load().err().unwrap();
    assert!(matches!(e, ModelError::UnknownArchitecture { .. }), "{e}");
    assert!(e.to_string().contains("\"llama\""), "{e}");

    c.as_object_mut().unwrap().remove("model_type");
    s.set_config(&c);
    assert!(load_err(&s).contains("model_type"));

    std::fs::write(s.path().join("config.json"), "{not json").unwrap();
    let e = load_err(&s);
    assert!(e.contains("config.json: not valid JSON"), "{e}");

    let s = Scratch::of("glm4_moe_lite");
    let mut c = s.config();
    c["num_experts_per_tok"] = json!(99);
    s.set_config(&c);
    assert!(load_err(&s).contains("num_experts_per_tok exceeds n_routed_experts"));
}

#[test]
fn missing_files_are_named() {
    let e = load(Path::new("/nonexistent/model"), DtypeChoice::Auto)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("/nonexistent/model"), "{e}");
    let s = Scratch::of("gemma4_31b_like");
    std::fs::remove_file(s.path().join("tokenizer.json")).unwrap();
    assert!(load_err(&s).contains("tokenizer.json"));
    let s = Scratch::of("gemma4_31b_like");
    std::fs::remove_file(s.path().join("model.safetensors")).unwrap();
    assert!(load_err(&s).contains("no model*.safetensors"));
}

#[test]
fn quantized_tensor_without_quantization_block() {
    let s = Scratch::of("glm4_moe_lite_q4");
    let mut c = s.config();
    let o = c.as_object_mut().unwrap();
    o.remove("quantization");
    o.remove("quantization_config");
    s.set_config(&c);
    let e = load_err(&s);
    assert!(e.contains("no quantization block"), "{e}");
}

/// A quantization block naming a width or a group MLX's affine mode does not have is refused
/// at load, naming the tensor; one that disagrees with the stored codes names their shape.
#[test]
fn quantization_formats_mlx_does_not_have_are_named() {
    for (bits, group, want) in [
        (7, 64, "at 7 bits, which MLX's affine mode does not have"),
        (
            4,
            16,
            "group size of 16, which MLX's affine mode does not have",
        ),
        (3, 64, "does not hold"),
    ] {
        let s = Scratch::of("glm4_moe_lite_q4");
        let mut c = s.config();
        for key in ["quantization", "quantization_config"] {
            c[key]["bits"] = json!(bits);
            c[key]["group_size"] = json!(group);
        }
        s.set_config(&c);
        let e = load_err(&s);
        assert!(
            e.contains(want) && e.contains(".weight"),
            "{bits} bits, group {group}: {e}"
        );
    }
}

/// A mode MLX does not have, a microscaling format with another group size, and scales that are
/// not 8-bit codes are each refused with the field or tensor named.
#[test]
fn quantization_modes_are_checked() {
    let s = Scratch::of("glm4_moe_lite_q4");
    let mut c = s.config();
    for key in ["quantization", "quantization_config"] {
        c[key]["mode"] = json!("int3");
    }
    s.set_config(&c);
    let e = load_err(&s);
    assert!(
        e.contains("quantization.mode \"int3\" is not one of MLX's"),
        "{e}"
    );

    let s = Scratch::of("glm4_moe_lite_nvfp4");
    let mut c = s.config();
    for key in ["quantization", "quantization_config"] {
        c[key]["group_size"] = json!(32);
    }
    s.set_config(&c);
    let e = load_err(&s);
    assert!(
        e.contains("nvfp4 is 4 bits in groups of 16") && e.contains(".weight"),
        "{e}"
    );

    // The affine 4-bit fixture's float scales read as mxfp4's would be the wrong type.
    let s = Scratch::of("glm4_moe_lite_q4");
    let mut c = s.config();
    for key in ["quantization", "quantization_config"] {
        c[key] = json!({"group_size": 32, "bits": 4, "mode": "mxfp4"});
    }
    s.set_config(&c);
    let e = load_err(&s);
    assert!(
        e.contains("mxfp4 has no biases") || e.contains("uint8 codes"),
        "{e}"
    );
}

/// The same bytes with `from` replaced by `to` (of the same length) in the safetensors header.
fn patch_header(s: &Scratch, from: &str, to: &str) {
    assert_eq!(from.len(), to.len());
    let path = s.path().join("model.safetensors");
    let mut bytes = std::fs::read(&path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = std::str::from_utf8(&bytes[8..8 + n])
        .unwrap()
        .replace(from, to);
    bytes[8..8 + n].copy_from_slice(header.as_bytes());
    std::fs::write(&path, bytes).unwrap();
}

/// `fixture` with `quantization_config.<field>` set to `value` fails to load, the error naming
/// config.json and saying `want`.
fn quantization_field_is_refused(fixture: &str, field: &str, value: Value, want: &str) {
    let s = Scratch::of(fixture);
    let mut c = s.config();
    c["quantization_config"][field] = value;
    s.set_config(&c);
    let e = load_err(&s);
    assert!(
        e.contains(want) && e.contains("config.json"),
        "{fixture}, {field}: {e}"
    );
}

/// Block-FP8 checkpoints in a form we cannot decode are refused by name: E5M2 values, a float8
/// weight without its block scales, blocks other than 128x128, another FP8 format, and
/// another producer's quantization method.
#[test]
fn block_fp8_checkpoints_are_checked() {
    let s = Scratch::of("glm4_moe_lite_fp8");
    patch_header(&s, "F8_E4M3", "F8_E5M2");
    let e = load_err(&s);
    assert!(e.contains("is F8_E5M2; only F8_E4M3"), "{e}");

    let s = Scratch::of("glm4_moe_lite_fp8");
    let w = "model.layers.0.self_attn.o_proj.weight";
    patch_header(&s, &format!("{w}_scale_inv"), &format!("{w}_scale_xxx"));
    let e = load_err(&s);
    assert!(e.contains(w) && e.contains("without a block scale"), "{e}");

    // A float8 tensor that is no weight (and no nvfp4 group scale).
    let s = Scratch::of("glm4_moe_lite_fp8");
    patch_header(&s, &format!("{w}\""), &format!("{}x\"", &w[..w.len() - 1]));
    let e = load_err(&s);
    assert!(e.contains("neither a block-FP8 weight"), "{e}");

    for (field, value, want) in [
        ("weight_block_size", json!([64, 64]), "only 128x128 blocks"),
        ("fmt", json!("e5m2"), "only E4M3"),
        ("quant_method", json!("gptq"), "quant_method is \"gptq\""),
    ] {
        quantization_field_is_refused("glm4_moe_lite_fp8", field, value, want);
    }
    let s = Scratch::of("glm4_moe_lite_fp8");
    let mut c = s.config();
    c["quantization_config"]
        .as_object_mut()
        .unwrap()
        .remove("weight_block_size");
    s.set_config(&c);
    assert!(load_err(&s).contains("without weight_block_size"));
}

/// NVIDIA's nvfp4 layouts in forms we do not read are refused by name.
#[test]
fn nvfp4_layouts_are_checked() {
    for (fixture, field, value, want) in [
        (
            "glm4_moe_lite_nvfp4_ct",
            "format",
            json!("float-quantized"),
            "nvfp4-pack-quantized",
        ),
        (
            "glm4_moe_lite_nvfp4_modelopt",
            "quant_algo",
            json!("FP8"),
            "NVFP4",
        ),
    ] {
        quantization_field_is_refused(fixture, field, value, want);
    }
    let s = Scratch::of("glm4_moe_lite_nvfp4_ct");
    let m = "model.layers.0.self_attn.o_proj";
    patch_header(
        &s,
        &format!("{m}.weight_scale\""),
        &format!("{m}.weight_scalf\""),
    );
    let e = load_err(&s);
    assert!(e.contains("without its group scales"), "{e}");
}

/// A mixed recipe's entry for a module the checkpoint does not have (a recipe copied from
/// another model, a typo) is refused naming the entry, whichever key holds the block.
#[test]
fn a_recipe_naming_a_missing_module_is_refused() {
    for key in ["quantization", "quantization_config"] {
        let s = Scratch::of("gemma4_26b_a4b_like_mixed");
        let mut c = s.config();
        let o = c.as_object_mut().unwrap();
        let block = o.remove("quantization").unwrap();
        o.remove("quantization_config");
        o.insert(key.into(), block);
        c[key]["model.layers.0.self_attn.qproj"] = json!({"bits": 4, "group_size": 64});
        s.set_config(&c);
        let e = load_err(&s);
        assert!(
            e.contains("model.layers.0.self_attn.qproj") && e.contains("no tensors of that module"),
            "{key}: {e}"
        );
    }
}
