//! Models in ollama's own store. The stores here are written by a writer that follows
//! `ollama create --experimental` step by step (each step names the file of ollama's source it
//! follows; summarised in docs/STORE.md), from the float fixtures,
//! and the runner loads them by name from `$OLLAMA_MODELS`, as a parent that passes
//! `--model gemma4:e4b` expects.

mod common;
use common::*;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use std::ffi::OsStr;
use std::path::Path;

/// One tensor of a checkpoint, as its bytes.
#[derive(Clone)]
struct Tensor {
    name: String,
    dtype: String,
    shape: Vec<u64>,
    data: Vec<u8>,
}

fn read_safetensors(path: &Path) -> Vec<Tensor> {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Map<String, Value> = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let data = &bytes[8 + n..];
    header
        .into_iter()
        .filter(|(k, _)| k != "__metadata__")
        .map(|(name, v)| {
            let (a, b) = (
                v["data_offsets"][0].as_u64().unwrap() as usize,
                v["data_offsets"][1].as_u64().unwrap() as usize,
            );
            Tensor {
                name,
                dtype: v["dtype"].as_str().unwrap().to_string(),
                shape: v["shape"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|d| d.as_u64().unwrap())
                    .collect(),
                data: data[a..b].to_vec(),
            }
        })
        .collect()
}

/// `x/create/inventory.go`: the shards `model.safetensors.index.json` lists, else every
/// `model*.safetensors` of the folder (a `golden.safetensors` beside them is not the model's).
fn inventory(dir: &Path) -> Vec<Tensor> {
    let index = dir.join("model.safetensors.index.json");
    let mut shards: Vec<String> = if index.is_file() {
        let v: Value = serde_json::from_str(&std::fs::read_to_string(&index).unwrap()).unwrap();
        let mut s: Vec<String> = v["weight_map"]
            .as_object()
            .unwrap()
            .values()
            .map(|f| f.as_str().unwrap().to_string())
            .collect();
        s.sort();
        s.dedup();
        s
    } else {
        std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|f| f.starts_with("model") && f.ends_with(".safetensors"))
            .collect()
    };
    shards.sort();
    shards
        .iter()
        .flat_map(|s| read_safetensors(&dir.join(s)))
        .collect()
}

/// `x/create/create.go` (expert stacking) and `x/create/plan.go`: one blob per tensor, named by
/// the tensor; per-expert weights `<group>.<i>.<proj>.weight` are stacked into
/// `<group>.<proj>.weight` (`[E, out, in]`, experts in index order), and a group's projections
/// share one blob named `<group>` when they share a quantization (always, unquantized).
/// Already-stacked tensors (`experts.gate_up_proj`) stay as they are. Blobs in sorted order,
/// then the expert groups, sorted.
fn plan(tensors: Vec<Tensor>) -> Vec<(String, Vec<Tensor>)> {
    use std::collections::BTreeMap;
    let mut single: BTreeMap<String, Tensor> = BTreeMap::new();
    // group -> proj -> expert index -> tensor
    let mut groups: BTreeMap<String, BTreeMap<String, BTreeMap<u64, Tensor>>> = BTreeMap::new();
    for t in tensors {
        let per_expert = t.name.split_once(".experts.").and_then(|(head, rest)| {
            let (i, tail) = rest.split_once('.')?;
            let i: u64 = i.parse().ok()?;
            let proj = tail.strip_suffix(".weight")?;
            (!proj.contains('.')).then(|| (format!("{head}.experts"), proj.to_string(), i))
        });
        match per_expert {
            Some((group, proj, i)) => {
                groups
                    .entry(group)
                    .or_default()
                    .entry(proj)
                    .or_default()
                    .insert(i, t);
            }
            None => {
                single.insert(t.name.clone(), t);
            }
        }
    }
    let mut out: Vec<(String, Vec<Tensor>)> = single
        .into_iter()
        .map(|(name, t)| (name, vec![t]))
        .collect();
    for (group, projs) in groups {
        let stacked = projs
            .into_iter()
            .map(|(proj, experts)| {
                let first = experts.values().next().unwrap().clone();
                let mut shape = vec![experts.len() as u64];
                shape.extend(&first.shape);
                Tensor {
                    name: format!("{group}.{proj}.weight"),
                    dtype: first.dtype,
                    shape,
                    data: experts.into_values().flat_map(|t| t.data).collect(),
                }
            })
            .collect();
        out.push((group, stacked));
    }
    out
}

/// `x/safetensors/extractor.go`: an 8-byte little-endian header length, then Go's
/// `json.Marshal` of a map (keys sorted) of `{"dtype","shape","data_offsets"}` in that order,
/// padded with spaces to a multiple of 8; no `__metadata__`; data in key order, unconverted.
fn encode_blob(tensors: &[Tensor]) -> Vec<u8> {
    let mut sorted: Vec<&Tensor> = tensors.iter().collect();
    sorted.sort_by(|a, b| a.name.cmp(&b.name));
    let mut header = String::from("{");
    let mut offset = 0usize;
    for (i, t) in sorted.iter().enumerate() {
        if i > 0 {
            header.push(',');
        }
        let end = offset + t.data.len();
        header.push_str(&format!(
            "{}:{{\"dtype\":{},\"shape\":{},\"data_offsets\":[{offset},{end}]}}",
            serde_json::to_string(&t.name).unwrap(),
            serde_json::to_string(&t.dtype).unwrap(),
            serde_json::to_string(&t.shape).unwrap(),
        ));
        offset = end;
    }
    header.push('}');
    while header.len() % 8 != 0 {
        header.push(' ');
    }
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header.as_bytes());
    for t in sorted {
        out.extend_from_slice(&t.data);
    }
    out
}

/// `manifest/layer.go`: a blob is stored once, as `blobs/sha256-<hex>`.
fn write_blob(root: &Path, media_type: &str, bytes: &[u8], name: Option<&str>) -> Value {
    let hex: String = Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    std::fs::create_dir_all(root.join("blobs")).unwrap();
    std::fs::write(root.join(format!("blobs/sha256-{hex}")), bytes).unwrap();
    let mut l =
        json!({"mediaType": media_type, "digest": format!("sha256:{hex}"), "size": bytes.len()});
    if let Some(n) = name {
        l["name"] = json!(n);
    }
    l
}

const TENSOR: &str = "application/vnd.ollama.image.tensor";
const JSON: &str = "application/vnd.ollama.image.json";

/// `x/create/pipeline.go` and `x/create/draft.go`: the tensor blobs of a checkpoint, then
/// every `*.json` of it sorted by name, byte for byte; a draft's blob and tensor names carry
/// `draft.` and its JSON layers `draft/`.
fn checkpoint_layers(root: &Path, dir: &Path, draft: bool, quantize: Option<&str>) -> Vec<Value> {
    let prefix = if draft { "draft." } else { "" };
    let policy = Policy::of(dir, draft);
    let mut layers = Vec::new();
    for (blob, mut tensors) in plan(inventory(dir)) {
        // The policy sees the checkpoint's names; the draft's prefix comes after planning.
        let kinds: Vec<Option<&str>> = tensors
            .iter()
            .map(|t| quantize.and_then(|q| policy.quant(&t.name, &t.shape, q)))
            .collect();
        for t in &mut tensors {
            t.name = format!("{prefix}{}", t.name);
        }
        if kinds.iter().all(Option::is_none) {
            let name = format!("{prefix}{blob}");
            layers.push(write_blob(
                root,
                TENSOR,
                &encode_blob(&tensors),
                Some(&name),
            ));
        } else if kinds.iter().all(|k| *k == kinds[0]) {
            // One quantization for the whole group: one blob named by it.
            let name = format!("{prefix}{blob}");
            let bytes = quantized_blob(&tensors, kinds[0].unwrap_or_default());
            layers.push(write_blob(root, TENSOR, &bytes, Some(&name)));
        } else {
            // Otherwise one blob per tensor, named by the tensor.
            for (t, k) in tensors.iter().zip(&kinds) {
                let bytes = match k {
                    Some(k) => quantized_blob(std::slice::from_ref(t), k),
                    None => encode_blob(std::slice::from_ref(t)),
                };
                layers.push(write_blob(root, TENSOR, &bytes, Some(&t.name)));
            }
        }
    }
    let mut jsons: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|f| f.ends_with(".json") && f != "model.safetensors.index.json")
        .collect();
    jsons.sort();
    for f in jsons {
        let bytes = std::fs::read(dir.join(&f)).unwrap();
        let name = if draft { format!("draft/{f}") } else { f };
        layers.push(write_blob(root, JSON, &bytes, Some(&name)));
    }
    layers
}

/// The quantization policy of one checkpoint: `GetTensorQuantization` (`x/create/create.go`,
/// `x/create/quantpolicy.go`), gemma4's (`x/create/gemma4.go`, registered for the gemma4
/// architectures in `tensorImportTransformRegistry`) and the draft's (`x/create/draft.go`).
struct Policy {
    gemma4: Option<(u64, u64)>,
    draft: bool,
}

impl Policy {
    fn of(dir: &Path, draft: bool) -> Policy {
        let cfg: Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap())
                .unwrap();
        let field = |k: &str| {
            cfg[k]
                .as_u64()
                .filter(|n| *n > 0)
                .or(cfg["text_config"][k].as_u64())
                .unwrap_or(0)
        };
        let gemma4 = architecture(dir)
            .starts_with("Gemma4")
            .then(|| (field("num_hidden_layers"), field("num_experts")));
        Policy { gemma4, draft }
    }

    fn quant(&self, name: &str, shape: &[u64], requested: &str) -> Option<&'static str> {
        let requested: &'static str = canonical(requested);
        // `eightBit`: int8 for the affine family, mxfp8 for the FP4 types.
        let eight: &'static str = if requested.starts_with("int") {
            "int8"
        } else {
            "mxfp8"
        };
        let fits = |t: &'static str| is_aligned(shape, t).then_some(t);
        let embed_tokens = name.ends_with("embed_tokens.weight") && !name.contains("per_layer");
        // draftPolicy: the draft's head takes the requested type.
        if self.draft && (embed_tokens || name.ends_with("lm_head.weight")) {
            return fits(requested);
        }
        let sensitive =
            name.contains(".v_proj") || name.contains(".k_proj") || name.contains("down_proj");
        if let Some((layers, experts)) = self.gemma4 {
            if embed_tokens {
                // promoteEmbedding, else the base type.
                return fits(eight).or_else(|| fits(requested));
            }
            let tower = name.contains("vision")
                || name.contains("visual")
                || name.contains("audio_tower")
                || name.contains("embed_audio");
            if sensitive && !tower && eight != requested {
                let promote = layers > 0
                    && if experts == 8 && (name.contains(".v_proj") || name.contains(".k_proj")) {
                        true
                    } else if name.contains(".k_proj") {
                        false
                    } else {
                        layer_of(name).is_some_and(|l| {
                            let (first, last) = (layers / 8, 7 * layers / 8);
                            l < first || l >= last || (l - first) % 3 == 2
                        })
                    };
                // sensitiveType.
                return promote
                    .then(|| fits(eight))
                    .flatten()
                    .or_else(|| fits(requested));
            }
        }
        // GetTensorQuantization.
        let stacked = [
            ".experts.",
            ".mlp.switch_mlp.",
            ".mlp.shared_experts.",
            ".mixer.shared_experts.",
        ]
        .iter()
        .any(|m| name.contains(m));
        let should = name.ends_with(".weight")
            && !["audio_tower", "embed_audio", "embed", "norm", "ln_"]
                .iter()
                .any(|m| name.contains(m));
        if !stacked && !should {
            return None;
        }
        if shape.len() != 2 && !(shape.len() == 3 && stacked) {
            return None;
        }
        let gate = [
            ".mlp.gate.weight",
            ".mixer.gate.weight",
            ".shared_expert_gate.weight",
            ".router.proj.weight",
        ]
        .iter()
        .any(|g| name.ends_with(g));
        if shape.iter().product::<u64>() < 1024 || gate {
            return None;
        }
        if name.ends_with("lm_head.weight") {
            return fits(eight);
        }
        if name.contains("vision") || name.contains("visual") || !is_aligned(shape, requested) {
            return None;
        }
        let promotes =
            requested == "int4" || ((requested == "nvfp4" || requested == "mxfp4") && !stacked);
        if promotes && sensitive {
            if let Some(e) = fits(eight) {
                return Some(e);
            }
        }
        Some(requested)
    }
}

/// `quant.Canonical`: the canonical name of a type or alias.
fn canonical(t: &str) -> &'static str {
    match t.to_ascii_uppercase().as_str() {
        "NVFP4" => "nvfp4",
        "MXFP4" => "mxfp4",
        "MXFP8" => "mxfp8",
        "INT4" | "FP4" | "Q4" => "int4",
        _ => "int8",
    }
}

/// `quant.Params`: (group size, bits, MLX mode) of a canonical type.
fn quant_params(t: &str) -> (i32, i32, mlx::QuantMode) {
    match t {
        "nvfp4" => (16, 4, mlx::QuantMode::Nvfp4),
        "mxfp4" => (32, 4, mlx::QuantMode::Mxfp4),
        "mxfp8" => (32, 8, mlx::QuantMode::Mxfp8),
        "int4" => (64, 4, mlx::QuantMode::Affine),
        _ => (64, 8, mlx::QuantMode::Affine),
    }
}

/// `isAligned`: the last dimension a whole number of the type's groups.
fn is_aligned(shape: &[u64], t: &str) -> bool {
    shape
        .last()
        .is_some_and(|d| d % quant_params(t).0 as u64 == 0)
}

/// `layerIndex`: the N of `.layers.N.`.
fn layer_of(name: &str) -> Option<u64> {
    let rest = name.split_once(".layers.")?.1;
    rest.split_once('.')?.0.parse().ok()
}

fn array(t: &Tensor) -> mlx::Array {
    assert_eq!(t.dtype, "F32", "the float fixtures are float32");
    let shape: Vec<i32> = t.shape.iter().map(|&d| d as i32).collect();
    mlx::Array::from_bytes(&t.data, &shape, mlx::Dtype::F32).unwrap()
}

/// `x/create/quantize.go`: MLX's quantization in the type's mode and group, each weight `<t>`
/// stored as packed `<t>` with `<t>.scale` (and `<t>.bias` for int4/int8),
/// `{"quant_type","group_size"}` in the blob's metadata. (ollama saves it with
/// `mlx_save_safetensors`; the safetensors crate writes the same tensors and metadata, with
/// another header order, which readers do not see.)
fn quantized_blob(tensors: &[Tensor], kind: &str) -> Vec<u8> {
    let (group, bits, mode) = quant_params(kind);
    let mut parts: Vec<(String, mlx::Array)> = Vec::new();
    for t in tensors {
        let q = array(t).quantize_as(mode, group, bits).unwrap();
        parts.push((t.name.clone(), q.weight));
        parts.push((format!("{}.scale", t.name), q.scales));
        if let Some(b) = q.biases {
            parts.push((format!("{}.bias", t.name), b));
        }
    }
    let refs: Vec<(&str, &mlx::Array)> = parts.iter().map(|(n, a)| (n.as_str(), a)).collect();
    let meta = [
        ("quant_type", kind.to_string()),
        ("group_size", group.to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    mlx::io::serialize_safetensors(&refs, Some(meta)).unwrap()
}

/// The same quantization as an mlx-lm checkpoint folder (packed `<m>.weight`, `<m>.scales`,
/// `<m>.biases`, and config.json's `quantization` block with the int8 modules listed), the
/// layout whose loading is checked against mlx-lm itself (`crates/models/tests/golden.rs`).
fn mlx_lm_twin(dir: &Path, out: &Path, requested: &str) {
    let policy = Policy::of(dir, false);
    let mut parts: Vec<(String, mlx::Array)> = Vec::new();
    let mut overrides = serde_json::Map::new();
    for (_, tensors) in plan(inventory(dir)) {
        for t in tensors {
            match policy.quant(&t.name, &t.shape, requested) {
                Some(k) => {
                    let (group, bits, mode) = quant_params(k);
                    let q = array(&t).quantize_as(mode, group, bits).unwrap();
                    let m = t.name.trim_end_matches(".weight").to_string();
                    overrides.insert(
                        m.clone(),
                        json!({"group_size": group, "bits": bits, "mode": mode.name()}),
                    );
                    parts.push((format!("{m}.weight"), q.weight));
                    parts.push((format!("{m}.scales"), q.scales));
                    if let Some(b) = q.biases {
                        parts.push((format!("{m}.biases"), b));
                    }
                }
                None => parts.push((t.name.clone(), array(&t))),
            }
        }
    }
    std::fs::create_dir_all(out).unwrap();
    for f in std::fs::read_dir(dir).unwrap() {
        let p = f.unwrap().path();
        let name = p.file_name().unwrap().to_string_lossy().into_owned();
        if name.ends_with(".json") && name != "config.json" {
            std::fs::copy(&p, out.join(&name)).unwrap();
        }
    }
    let mut cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let (group, bits, mode) = quant_params(canonical(requested));
    let mut q = json!({"group_size": group, "bits": bits, "mode": mode.name()});
    q.as_object_mut().unwrap().extend(overrides);
    cfg["quantization"] = q;
    std::fs::write(out.join("config.json"), cfg.to_string()).unwrap();
    let refs: Vec<(&str, &mlx::Array)> = parts.iter().map(|(n, a)| (n.as_str(), a)).collect();
    mlx::io::save_safetensors(out.join("model.safetensors"), &refs).unwrap();
}

/// The checkpoint itself with every tensor the policy quantizes replaced by what its
/// quantization stands for (`dequantize(quantize(w))`), read by the float path that is checked
/// against transformers: a reference for the quantized model that shares none of the quantized
/// loading code.
fn dequantized_twin(dir: &Path, out: &Path, requested: &str) {
    let policy = Policy::of(dir, false);
    let mut parts: Vec<(String, mlx::Array)> = Vec::new();
    for t in inventory(dir) {
        let a = array(&t);
        let a = match policy.quant(&t.name, &t.shape, requested) {
            Some(k) => {
                let (group, bits, mode) = quant_params(k);
                a.quantize_as(mode, group, bits)
                    .unwrap()
                    .dequantize()
                    .unwrap()
                    .astype(mlx::Dtype::F32)
                    .unwrap()
            }
            None => a,
        };
        parts.push((t.name.clone(), a));
    }
    std::fs::create_dir_all(out).unwrap();
    for f in std::fs::read_dir(dir).unwrap() {
        let p = f.unwrap().path();
        let name = p.file_name().unwrap().to_string_lossy().into_owned();
        if name.ends_with(".json") {
            std::fs::copy(&p, out.join(&name)).unwrap();
        }
    }
    let refs: Vec<(&str, &mlx::Array)> = parts.iter().map(|(n, a)| (n.as_str(), a)).collect();
    mlx::io::save_safetensors(out.join("model.safetensors"), &refs).unwrap();
}

fn architecture(dir: &Path) -> String {
    let v: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    v["architectures"][0]
        .as_str()
        .or(v["model_type"].as_str())
        .unwrap()
        .to_string()
}

/// `x/create/client/create.go` and `manifest/manifest.go`: the layers in order (target tensors,
/// target JSON, draft tensors, draft JSON, then the Modelfile's params), the config blob
/// (`json.Marshal` of `model.ConfigV2`: `architecture` left empty, `file_type` "" for float,
/// renderer and parser by family (`getParserName`), `capabilities` from
/// `inferSafetensorsCapabilities`, the `draft` section), and the manifest, encoded by
/// `json.NewEncoder` (Go's field order, a trailing newline) at
/// `manifests/registry.ollama.ai/library/<m>/<tag>`.
fn ollama_create(
    root: &Path,
    model: &str,
    target: &Path,
    draft: Option<&Path>,
    quantize: Option<&str>,
    draft_quantize: Option<&str>,
) {
    let mut layers = checkpoint_layers(root, target, false, quantize);
    if let Some(d) = draft {
        // `--quantize` never touches the draft; `--draft-quantize` does.
        layers.extend(checkpoint_layers(root, d, true, draft_quantize));
    }
    let params = b"{\"temperature\":0.5}\n";
    layers.push(write_blob(
        root,
        "application/vnd.ollama.image.params",
        params,
        None,
    ));
    let draft_section = draft.map(|d| {
        format!(
            ",\"draft\":{{\"model_format\":\"safetensors\",\"architecture\":{},\"tensor_prefix\":\"draft.\",\"config\":\"draft/config.json\"}}",
            serde_json::to_string(&architecture(d)).unwrap()
        )
    });
    let arch = architecture(target).to_lowercase();
    let family = if arch.contains("gemma4") {
        "gemma4"
    } else if arch.contains("glm4") {
        "glm-4.7"
    } else {
        panic!("no family for {arch}")
    };
    let config = format!(
        "{{\"model_format\":\"safetensors\",\"model_family\":\"\",\"model_families\":null,\"model_type\":\"\",\"file_type\":{},\"renderer\":\"{family}\",\"parser\":\"{family}\",\"requires\":\"0.19.0\",\"capabilities\":[\"completion\",\"tools\",\"thinking\"]{},\"architecture\":\"\",\"os\":\"\"}}",
        serde_json::to_string(quantize.unwrap_or_default()).unwrap(),
        draft_section.unwrap_or_default()
    );
    let config_layer = write_blob(
        root,
        "application/vnd.docker.container.image.v1+json",
        config.as_bytes(),
        None,
    );
    let layer = |l: &Value| {
        let name = l
            .get("name")
            .map(|n| format!(",\"name\":{n}"))
            .unwrap_or_default();
        format!(
            "{{\"mediaType\":{},\"digest\":{},\"size\":{}{name}}}",
            l["mediaType"], l["digest"], l["size"]
        )
    };
    let manifest = format!(
        "{{\"schemaVersion\":2,\"mediaType\":\"application/vnd.docker.distribution.manifest.v2+json\",\"config\":{},\"layers\":[{}]}}\n",
        layer(&config_layer),
        layers.iter().map(layer).collect::<Vec<_>>().join(",")
    );
    let (name, tag) = model.split_once(':').unwrap_or((model, "latest"));
    let dir = root.join("manifests/registry.ollama.ai/library").join(name);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join(tag), manifest).unwrap();
}

fn greedy(r: &Runner) -> String {
    let lines = r.complete(&json!({
        "Prompt": "The quick brown fox jumps over the lazy dog.",
        "Options": {"num_predict": 24}
    }));
    text_of(&lines)
}

/// The runner finds each model by name in ollama's store (ours empty) and serves exactly what
/// the checkpoint folder serves: gemma4 with the assistant drafting, gemma4's MoE form (fused
/// experts kept fused), GLM (per-expert weights stacked by the importer).
#[test]
fn models_ollama_created_load_by_name_and_serve_what_their_checkpoints_serve() {
    let ollama = tempfile::tempdir().unwrap();
    let ours = tempfile::tempdir().unwrap();
    let cases = [
        (
            "gemma4-e2b:latest",
            "gemma4_e2b_like",
            Some("gemma4_assistant"),
        ),
        ("gemma4-moe:test", "gemma4_26b_a4b_like", None),
        ("glm-flash", "glm4_moe_lite", None),
    ];
    for (name, target, draft) in cases {
        ollama_create(
            ollama.path(),
            name,
            &fixture(target),
            draft.map(fixture).as_deref(),
            None,
            None,
        );
    }
    for (name, target, draft) in cases {
        let env = [
            ("OLLAMA_MODELS", ollama.path().as_os_str()),
            ("MLX_RUNNER_MODELS", ours.path().as_os_str()),
        ];
        let stored = Runner::start_with(OsStr::new(name), &[], &env);
        let mut extra = Vec::new();
        let draft_dir = draft.map(fixture);
        if let Some(d) = &draft_dir {
            extra = vec!["--draft", d.to_str().unwrap()];
        }
        let direct = Runner::start(target, &extra);
        assert_eq!(greedy(&stored), greedy(&direct), "{name}");
        // The stored draft is the one that drafts.
        if draft.is_some() {
            let lines =
                stored.complete(&json!({"Prompt": "Hello", "Options": {"num_predict": 16}}));
            assert!(
                done_of(&lines)["DraftTokens"].as_u64().unwrap() > 0,
                "{name}"
            );
        }
    }
}

/// A gemma4 with vision and audio towers that ollama created (every `*.json` of the checkpoint
/// kept, `processor_config.json` among them; with `--quantize int4` the towers stay in float,
/// as ollama's policy keeps them) loads from ollama's store and takes a clip and an image: the
/// unquantized one answers exactly as the checkpoint folder does.
#[test]
fn multimodal_models_ollama_created_take_images_and_audio() {
    use base64::Engine;
    let ollama = tempfile::tempdir().unwrap();
    let ours = tempfile::tempdir().unwrap();
    let dir = fixture("gemma4_audio_like");
    ollama_create(ollama.path(), "gemma4-av:latest", &dir, None, None, None);
    ollama_create(
        ollama.path(),
        "gemma4-av:int4",
        &dir,
        None,
        Some("int4"),
        None,
    );
    let b64 = |f: &str| {
        base64::engine::general_purpose::STANDARD
            .encode(std::fs::read(dir.join("audio").join(f)).unwrap())
    };
    let body = json!({
        "Prompt": "Hear [img-0] and see [img-1] now.",
        "Media": [{"data": b64("speechlike.wav"), "id": 0}, {"data": b64("wide.png"), "id": 1}],
        "Options": {"num_predict": 8, "temperature": 0},
        "Logprobs": true,
    });
    let answer = |r: &Runner| {
        let lines = r.complete(&body);
        let tokens: Vec<String> = lines
            .iter()
            .filter_map(|l| l["Logprobs"].as_array())
            .flatten()
            .map(|e| e["token"].as_str().unwrap_or_default().to_string())
            .collect();
        (tokens, done_of(&lines)["PromptEvalCount"].as_u64().unwrap())
    };
    let env = [
        ("OLLAMA_MODELS", ollama.path().as_os_str()),
        ("MLX_RUNNER_MODELS", ours.path().as_os_str()),
    ];
    let direct = answer(&Runner::start("gemma4_audio_like", &[]));
    let stored = answer(&Runner::start_with(
        OsStr::new("gemma4-av:latest"),
        &[],
        &env,
    ));
    assert_eq!(stored, direct);
    let (tokens, prompt) = answer(&Runner::start_with(OsStr::new("gemma4-av:int4"), &[], &env));
    assert_eq!((tokens.len(), prompt), (8, direct.1));
}

/// A name in neither store is an error naming both.
#[test]
fn a_missing_model_names_both_stores() {
    let ollama = tempfile::tempdir().unwrap();
    let ours = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(ollama.path().join("manifests")).unwrap();
    let out = binary()
        .args(["generate", "--model", "nothing:here", "--prompt", "x"])
        .env("OLLAMA_MODELS", ollama.path())
        .env("MLX_RUNNER_MODELS", ours.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&ours.path().display().to_string())
            && err.contains(&ollama.path().display().to_string()),
        "{err}"
    );
}

fn greedy_with_logprobs(r: &Runner) -> (String, Vec<f64>) {
    let lines = r.complete(&json!({
        "Prompt": "The quick brown fox jumps over the lazy dog.",
        "Options": {"num_predict": 16},
        "Logprobs": true,
    }));
    outcome(&lines)
}

/// int4 and int8 models as ollama's importer writes them (mixed precision: an int4 model holds
/// int8 tensors and float ones, the quantization in each blob's metadata, per-expert weights
/// stacked and quantized as groups) serve what the same quantization does in mlx-lm's layout.
#[test]
fn quantized_models_ollama_created_serve_what_mlx_lm_layout_serves() {
    let ollama = tempfile::tempdir().unwrap();
    let ours = tempfile::tempdir().unwrap();
    let twins = tempfile::tempdir().unwrap();
    for (target, q) in [
        ("gemma4_e2b_like", "int4"),
        ("gemma4_e2b_like", "int8"),
        ("gemma4_26b_a4b_like", "int4"),
        ("glm4_moe_lite", "int4"),
        ("glm4_moe_lite", "nvfp4"),
        ("gemma4_26b_a4b_like", "mxfp4"),
        ("gemma4_e2b_like", "mxfp8"),
    ] {
        let name = format!("{}-{q}", target.replace('_', "-"));
        ollama_create(ollama.path(), &name, &fixture(target), None, Some(q), None);
        let twin = twins.path().join(&name);
        mlx_lm_twin(&fixture(target), &twin, q);
        let env = [
            ("OLLAMA_MODELS", ollama.path().as_os_str()),
            ("MLX_RUNNER_MODELS", ours.path().as_os_str()),
        ];
        let stored = Runner::start_with(OsStr::new(&name), &["--no-draft"], &env);
        let direct = Runner::start_with(twin.as_os_str(), &["--no-draft"], &[]);
        let (a, la) = greedy_with_logprobs(&stored);
        let (b, lb) = greedy_with_logprobs(&direct);
        assert_eq!(a, b, "{name}");
        assert_eq!(la.len(), lb.len());
        for (x, y) in la.iter().zip(&lb) {
            assert!((x - y).abs() < 1e-4, "{name}: {x} vs {y}");
        }
        // Within float error of the float model holding the dequantized weights.
        let deq = twins.path().join(format!("{name}-dequantized"));
        dequantized_twin(&fixture(target), &deq, q);
        let reference = Runner::start_with(deq.as_os_str(), &["--no-draft"], &[]);
        let (c, lc) = greedy_with_logprobs(&reference);
        assert_eq!(a, c, "{name}: vs the dequantized float model");
        for (x, y) in la.iter().zip(&lc) {
            assert!((x - y).abs() < 1e-3, "{name}: {x} vs dequantized {y}");
        }
        // And it is really quantized: not what the float checkpoint gives.
        let float = Runner::start(target, &["--no-draft"]);
        let (_, lf) = greedy_with_logprobs(&float);
        assert!(
            la.iter().zip(&lf).any(|(x, y)| (x - y).abs() > 1e-4),
            "{name}: the logprobs are the float model's"
        );
    }
}

/// `show` reports the precision of each tensor of a mixed model, for ollama's layout and ours.
#[test]
fn show_reports_per_tensor_precision() {
    let ollama = tempfile::tempdir().unwrap();
    let ours = tempfile::tempdir().unwrap();
    ollama_create(
        ollama.path(),
        "mixed",
        &fixture("gemma4_e2b_like"),
        None,
        Some("int4"),
        None,
    );
    // A command against both stores; its standard output.
    let run = |args: &[&str]| {
        let out = binary()
            .args(args)
            .env("OLLAMA_MODELS", ollama.path())
            .env("MLX_RUNNER_MODELS", ours.path())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    let show = |args: &[&str]| run(&[&["show"], args].concat());
    // `list` shows ollama's safetensors models beside ours, marked; a GGUF model it holds is
    // not one the runner loads, and is not listed.
    let gguf_config = write_blob(
        ollama.path(),
        "application/vnd.docker.container.image.v1+json",
        br#"{"model_format":"gguf","model_family":"llama"}"#,
        None,
    );
    let dir = ollama
        .path()
        .join("manifests/registry.ollama.ai/library/llama3");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("latest"),
        json!({"schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
               "config": gguf_config, "layers": []})
        .to_string(),
    )
    .unwrap();
    let listed = run(&["list"]);
    assert!(
        listed
            .lines()
            .any(|l| l.starts_with("mixed:latest") && l.ends_with("(ollama)")),
        "{listed}"
    );
    assert!(!listed.contains("llama3"), "{listed}");
    let text = show(&["mixed"]);
    assert!(text.contains("Precision (mixed)"), "{text}");
    for p in ["int4", "int8", "F32"] {
        assert!(
            text.lines().any(|l| l.trim_start().starts_with(p)),
            "{p}: {text}"
        );
    }
    let verbose = show(&["mixed", "--verbose"]);
    let line = |name: &str| {
        verbose
            .lines()
            .find(|l| l.trim_end().ends_with(name))
            .unwrap_or_else(|| panic!("{name} not listed: {verbose}"))
            .split_whitespace()
            .next()
            .unwrap()
            .to_string()
    };
    // gemma4's policy over 6 layers: the embedding at int8; values and downs at int8 on every
    // third layer and the last eighth (2 and 5), keys at int4.
    assert_eq!(line("model.embed_tokens.weight"), "int8");
    assert_eq!(line("model.layers.0.self_attn.q_proj.weight"), "int4");
    assert_eq!(line("model.layers.0.self_attn.k_proj.weight"), "int4");
    assert_eq!(line("model.layers.0.self_attn.v_proj.weight"), "int4");
    assert_eq!(line("model.layers.2.self_attn.v_proj.weight"), "int8");
    assert_eq!(line("model.layers.5.mlp.down_proj.weight"), "int8");
    assert_eq!(line("model.norm.weight"), "F32");
    // A model of ours, quantized by `create --quantize q4`: the same layout.
    let mf = ours.path().join("Modelfile");
    std::fs::write(
        &mf,
        format!("FROM {}\n", fixture("gemma4_e2b_like").display()),
    )
    .unwrap();
    run(&[
        "create",
        "q",
        "-f",
        mf.to_str().unwrap(),
        "--quantize",
        "q4",
    ]);
    let text = show(&["q", "-v"]);
    assert!(text.contains("int4"), "{text}");
    assert!(
        text.lines()
            .any(|l| l.trim_end().ends_with("self_attn.q_proj.weight") && l.contains("int4")),
        "{text}"
    );
}

/// `mlx-runner create` into the store at `root`, from a Modelfile with FROM, DRAFT and the
/// parameter `ollama_create` writes.
fn our_create(
    root: &Path,
    model: &str,
    target: &str,
    draft: Option<&str>,
    quantize: Option<&str>,
    draft_quantize: Option<&str>,
) {
    let dir = tempfile::tempdir().unwrap();
    let mf = dir.path().join("Modelfile");
    let mut text = format!("FROM {}\n", fixture(target).display());
    if let Some(d) = draft {
        text += &format!("DRAFT {}\n", fixture(d).display());
    }
    text += "PARAMETER temperature 0.5\n";
    std::fs::write(&mf, text).unwrap();
    let mut cmd = binary();
    cmd.args(["create", model, "-f", mf.to_str().unwrap()])
        .env("MLX_RUNNER_MODELS", root);
    if let Some(q) = quantize {
        cmd.args(["--quantize", q]);
    }
    if let Some(q) = draft_quantize {
        cmd.args(["--quantize-draft", q]);
    }
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn manifest_bytes(root: &Path, model: &str) -> Vec<u8> {
    std::fs::read(
        root.join("manifests/registry.ollama.ai/library")
            .join(model)
            .join("latest"),
    )
    .unwrap()
}

fn blob(root: &Path, digest: &Value) -> std::path::PathBuf {
    root.join("blobs")
        .join(digest.as_str().unwrap().replace(':', "-"))
}

/// A safetensors blob's `__metadata__` (empty when it has none).
fn blob_metadata(path: &Path) -> serde_json::Map<String, Value> {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    header["__metadata__"]
        .as_object()
        .cloned()
        .unwrap_or_default()
}

/// `create` writes what `ollama create --experimental` writes, layer for layer: the same
/// manifest byte for byte for float models (so the same model id), and for quantized ones the
/// same layers in the same order with the same tensors, values and quantization metadata in
/// each blob (ollama serializes quantized blobs with MLX's writer, whose header order follows a
/// hash map; the tensors are what a reader sees).
#[test]
fn create_writes_what_ollama_create_writes() {
    let ours = tempfile::tempdir().unwrap();
    let theirs = tempfile::tempdir().unwrap();
    type Case<'a> = (
        &'a str,
        &'a str,
        Option<&'a str>,
        Option<&'a str>,
        Option<&'a str>,
    );
    let cases: [Case; 9] = [
        (
            "e2b",
            "gemma4_e2b_like",
            Some("gemma4_assistant"),
            None,
            None,
        ),
        ("glm", "glm4_moe_lite", None, None, None),
        ("moe-int4", "gemma4_26b_a4b_like", None, Some("int4"), None),
        ("glm-int4", "glm4_moe_lite", None, Some("int4"), None),
        ("glm-int8", "glm4_moe_lite", None, Some("int8"), None),
        (
            "e2b-int4",
            "gemma4_e2b_like",
            Some("gemma4_assistant"),
            Some("int4"),
            Some("int8"),
        ),
        ("glm-nvfp4", "glm4_moe_lite", None, Some("nvfp4"), None),
        (
            "moe-mxfp4",
            "gemma4_26b_a4b_like",
            None,
            Some("mxfp4"),
            None,
        ),
        (
            "e2b-mxfp8",
            "gemma4_e2b_like",
            Some("gemma4_assistant"),
            Some("mxfp8"),
            Some("nvfp4"),
        ),
    ];
    for (model, target, draft, q, dq) in cases {
        our_create(ours.path(), model, target, draft, q, dq);
        ollama_create(
            theirs.path(),
            model,
            &fixture(target),
            draft.map(fixture).as_deref(),
            q,
            dq,
        );
        let (a, b) = (
            manifest_bytes(ours.path(), model),
            manifest_bytes(theirs.path(), model),
        );
        if q.is_none() && dq.is_none() {
            assert_eq!(
                String::from_utf8_lossy(&a),
                String::from_utf8_lossy(&b),
                "{model}: the manifests differ"
            );
            continue;
        }
        let (ma, mb): (Value, Value) = (
            serde_json::from_slice(&a).unwrap(),
            serde_json::from_slice(&b).unwrap(),
        );
        assert_eq!(ma["config"], mb["config"], "{model}: config blobs");
        let (la, lb) = (
            ma["layers"].as_array().unwrap(),
            mb["layers"].as_array().unwrap(),
        );
        let names = |l: &[Value]| -> Vec<String> {
            l.iter()
                .map(|x| format!("{} {}", x["mediaType"], x["name"]))
                .collect()
        };
        assert_eq!(names(la), names(lb), "{model}: layers");
        for (x, y) in la.iter().zip(lb) {
            if x["mediaType"] != TENSOR {
                assert_eq!(x["digest"], y["digest"], "{model}: {}", x["name"]);
                continue;
            }
            let (px, py) = (
                blob(ours.path(), &x["digest"]),
                blob(theirs.path(), &y["digest"]),
            );
            assert_eq!(
                blob_metadata(&px),
                blob_metadata(&py),
                "{model}: {}",
                x["name"]
            );
            let tensors = |p: &Path| -> Vec<(String, String, Vec<u64>, Vec<u8>)> {
                let mut v: Vec<_> = read_safetensors(p)
                    .into_iter()
                    .map(|t| (t.name, t.dtype, t.shape, t.data))
                    .collect();
                v.sort();
                v
            };
            let (tx, ty) = (tensors(&px), tensors(&py));
            let heads = |t: &[(String, String, Vec<u64>, Vec<u8>)]| -> Vec<String> {
                t.iter()
                    .map(|(n, d, s, _)| format!("{n} {d} {s:?}"))
                    .collect()
            };
            assert_eq!(heads(&tx), heads(&ty), "{model}: {}", x["name"]);
            for (u, v) in tx.iter().zip(&ty) {
                assert!(u.3 == v.3, "{model}: the values of {} differ", u.0);
            }
        }
    }
}

/// What ollama's runner makes of a blob (`x/mlxrunner/model/root.go`
/// `readBlobTensorQuantInfo`): each tensor with a `.scale` beside it and the quantization its
/// metadata says (per tensor, then for the blob), checked against what its shapes imply
/// (`inferQuantTypeFromShapes`); and the tensor names after `loadTensorsFromManifest`
/// (`.scale` → `_scale`, `.bias` → `_qbias` where a `.scale` exists).
fn ollama_reads(path: &Path) -> (Vec<String>, Vec<(String, String, u64)>) {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Map<String, Value> = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let meta = header
        .get("__metadata__")
        .and_then(Value::as_object)
        .cloned()
        .unwrap_or_default();
    let text = |k: &str| meta.get(k).and_then(Value::as_str).map(str::to_uppercase);
    let mut quant = Vec::new();
    for name in header.keys() {
        if name == "__metadata__" || name.ends_with(".scale") || name.ends_with(".bias") {
            continue;
        }
        let Some(scale) = header.get(&format!("{name}.scale")) else {
            continue;
        };
        let kind = text(&format!("{name}.quant_type"))
            .or_else(|| text("quant_type"))
            .expect("a quantized tensor's type is in the metadata");
        let group: u64 = text(&format!("{name}.group_size"))
            .or_else(|| text("group_size"))
            .map_or(0, |g| g.parse().unwrap());
        let cols = header[name]["shape"]
            .as_array()
            .unwrap()
            .last()
            .unwrap()
            .as_u64()
            .unwrap();
        let groups = scale["shape"]
            .as_array()
            .unwrap()
            .last()
            .unwrap()
            .as_u64()
            .unwrap();
        let (inferred, inferred_group) = match (cols * 8 / groups, cols * 4 / groups) {
            (32, _) => ("INT4", 32),
            (_, 64) => ("INT8", 64),
            (64, 32) => (
                if kind.contains('8') { "INT8" } else { "INT4" },
                if kind.contains('8') { 32 } else { 64 },
            ),
            (g4, _) => ("INT4", g4),
        };
        assert_eq!((kind.as_str(), group), (inferred, inferred_group), "{name}");
        assert!(
            header.contains_key(&format!("{name}.bias")),
            "{name}: no bias"
        );
        quant.push((name.clone(), kind, group));
    }
    let names = header
        .keys()
        .filter(|k| *k != "__metadata__")
        .map(|k| {
            for (suffix, to) in [(".scale", "_scale"), (".bias", "_qbias")] {
                if let Some(base) = k.strip_suffix(suffix) {
                    if header.contains_key(&format!("{base}.scale")) {
                        return format!("{base}{to}");
                    }
                }
            }
            k.clone()
        })
        .collect();
    (names, quant)
}

/// A model `create` wrote, read the way ollama's runner reads it (`x/mlxrunner/model/root.go`,
/// `x/mlxrunner/runner.go`) rather than with our loader: every name ollama's GLM4-MoE-Lite
/// (`x/models/glm4_moe_lite/glm4_moe_lite.go` `LoadWeights`) and gemma4 models look up is
/// there, each quantized one with `_scale`, `_qbias` and its type; the config blob is the
/// `ConfigV2` ollama's server reads, with the draft where `readDraftConfig` finds it.
#[test]
fn an_ollama_reader_reads_what_create_writes() {
    let ours = tempfile::tempdir().unwrap();
    our_create(
        ours.path(),
        "glm",
        "glm4_moe_lite",
        None,
        Some("int4"),
        None,
    );
    our_create(
        ours.path(),
        "e2b",
        "gemma4_e2b_like",
        Some("gemma4_assistant"),
        Some("int4"),
        None,
    );
    let read = |model: &str| {
        let m: Value = serde_json::from_slice(&manifest_bytes(ours.path(), model)).unwrap();
        let config: Value = serde_json::from_slice(
            &std::fs::read(blob(ours.path(), &m["config"]["digest"])).unwrap(),
        )
        .unwrap();
        let mut names = std::collections::BTreeSet::new();
        let mut quant = Vec::new();
        for l in m["layers"].as_array().unwrap() {
            if l["mediaType"] == TENSOR {
                let (n, q) = ollama_reads(&blob(ours.path(), &l["digest"]));
                names.extend(n);
                quant.extend(q);
            }
        }
        (m, config, names, quant)
    };

    let (_, config, names, quant) = read("glm");
    assert_eq!(config["model_format"], "safetensors");
    assert_eq!(config["file_type"], "int4");
    assert_eq!(
        config["architecture"], "",
        "ollama takes it from config.json"
    );
    assert_eq!(config["parser"], "glm-4.7");
    assert!(config.get("draft").is_none());
    let mut want = vec![
        "model.embed_tokens.weight".to_string(),
        "model.norm.weight".into(),
        "lm_head.weight".into(),
    ];
    for i in 0..3 {
        let p = format!("model.layers.{i}");
        for n in [
            "self_attn.q_a_proj",
            "self_attn.q_a_layernorm",
            "self_attn.q_b_proj",
            "self_attn.kv_a_proj_with_mqa",
            "self_attn.kv_a_layernorm",
            "self_attn.kv_b_proj",
            "self_attn.o_proj",
            "input_layernorm",
            "post_attention_layernorm",
        ] {
            want.push(format!("{p}.{n}.weight"));
        }
        // first_k_dense_replace = 1: layer 0 is dense, the others are MoE.
        let mlp: &[&str] = if i == 0 {
            &["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
        } else {
            &[
                "mlp.experts.gate_proj",
                "mlp.experts.up_proj",
                "mlp.experts.down_proj",
                "mlp.gate",
                "mlp.shared_experts.gate_proj",
                "mlp.shared_experts.up_proj",
                "mlp.shared_experts.down_proj",
            ]
        };
        want.extend(mlp.iter().map(|n| format!("{p}.{n}.weight")));
        if i > 0 {
            want.push(format!("{p}.mlp.gate.e_score_correction_bias"));
        }
    }
    for n in &want {
        assert!(names.contains(n), "ollama's GLM model looks up {n}");
    }
    assert!(quant.iter().any(|q| q.1 == "INT4") && quant.iter().any(|q| q.1 == "INT8"));
    for (n, _, _) in &quant {
        assert!(names.contains(&format!("{n}_scale")) && names.contains(&format!("{n}_qbias")));
    }
    assert_eq!(
        quant
            .iter()
            .find(|q| q.0 == "lm_head.weight")
            .map(|q| q.1.as_str()),
        Some("INT8")
    );

    let (m, config, names, quant) = read("e2b");
    assert_eq!(config["parser"], "gemma4");
    assert_eq!(
        config["draft"],
        json!({"model_format": "safetensors", "architecture": "Gemma4AssistantForCausalLM",
               "tensor_prefix": "draft.", "config": "draft/config.json"})
    );
    assert!(m["layers"]
        .as_array()
        .unwrap()
        .iter()
        .any(|l| l["mediaType"] == JSON && l["name"] == "draft/config.json"));
    assert!(names.iter().any(|n| n.starts_with("draft.")));
    // gemma4's policy: the token embedding (also the output head) at int8.
    assert_eq!(
        quant
            .iter()
            .find(|q| q.0 == "model.embed_tokens.weight")
            .map(|q| q.1.as_str()),
        Some("INT8")
    );
    // `--quantize` never touches the draft.
    assert!(quant.iter().all(|q| !q.0.starts_with("draft.")));
}
