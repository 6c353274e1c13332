//! Which tensors `create` quantizes, and to what: ollama's mixed-precision policy
//! (`x/create/create.go` `GetTensorQuantization`, `x/create/quantpolicy.go`, the per-architecture
//! `x/create/gemma4.go`, and the draft's `x/create/draft.go`), so that a model we import holds
//! the same precisions, tensor for tensor, as `ollama create --experimental --quantize` gives.
//!
//! The types are ollama's (`x/quant/quant.go`): `int4` and `int8` are MLX's affine
//! quantization in groups of 64; `nvfp4` (groups of 16), `mxfp4` and `mxfp8` (groups of 32)
//! MLX's microscaling modes of those names. A 4-bit type's "8-bit type" (where the policy
//! promotes a sensitive tensor) is int8 for int4 and mxfp8 for the FP4 types.

use serde_json::Value;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum QuantType {
    Q4,
    Q8,
    Nvfp4,
    Mxfp4,
    Mxfp8,
}

impl QuantType {
    pub fn bits(self) -> i32 {
        match self {
            QuantType::Q4 | QuantType::Nvfp4 | QuantType::Mxfp4 => 4,
            QuantType::Q8 | QuantType::Mxfp8 => 8,
        }
    }

    /// Values per scale: the group MLX quantizes this type in, as ollama runs it.
    pub fn group_size(self) -> i32 {
        match self {
            QuantType::Q4 | QuantType::Q8 => 64,
            QuantType::Nvfp4 => 16,
            QuantType::Mxfp4 | QuantType::Mxfp8 => 32,
        }
    }

    /// MLX's name of the mode (`affine` for int4 and int8).
    pub fn mode(self) -> &'static str {
        match self {
            QuantType::Q4 | QuantType::Q8 => "affine",
            other => other.name(),
        }
    }

    /// ollama's name: what `file_type` and each blob's `quant_type` say.
    pub fn name(self) -> &'static str {
        match self {
            QuantType::Q4 => "int4",
            QuantType::Q8 => "int8",
            QuantType::Nvfp4 => "nvfp4",
            QuantType::Mxfp4 => "mxfp4",
            QuantType::Mxfp8 => "mxfp8",
        }
    }

    /// The type MLX's `mode` at `bits` and `group` is, where ollama has one.
    pub fn from_format(mode: &str, bits: i32, group: i32) -> Option<QuantType> {
        [
            QuantType::Q4,
            QuantType::Q8,
            QuantType::Nvfp4,
            QuantType::Mxfp4,
            QuantType::Mxfp8,
        ]
        .into_iter()
        .find(|q| q.mode() == mode && q.bits() == bits && q.group_size() == group)
    }

    /// `eightBit`: the 8-bit type of this type's family.
    pub fn eight_bit(self) -> QuantType {
        match self {
            QuantType::Q4 | QuantType::Q8 => QuantType::Q8,
            _ => QuantType::Mxfp8,
        }
    }
}

impl std::str::FromStr for QuantType {
    type Err = String;
    fn from_str(s: &str) -> Result<QuantType, String> {
        // ollama's names and aliases (`quant.Canonical`): fp4/fp8 name the affine types too.
        match s.trim().to_ascii_lowercase().as_str() {
            "q4" | "int4" | "fp4" => Ok(QuantType::Q4),
            "q8" | "int8" | "fp8" => Ok(QuantType::Q8),
            "nvfp4" => Ok(QuantType::Nvfp4),
            "mxfp4" => Ok(QuantType::Mxfp4),
            "mxfp8" => Ok(QuantType::Mxfp8),
            _ => Err(format!(
                "unknown quantization {s:?} (expected int4, int8, nvfp4, mxfp4 or mxfp8; q4 and q8 \
                 are aliases)"
            )),
        }
    }
}

/// ollama's name of a checkpoint's quantization: its type where ollama has one (`int4`,
/// `nvfp4`, ...), else `int<bits>` for an affine width ollama does not write, else the mode.
pub fn type_name(mode: &str, bits: i32, group: i32) -> String {
    match QuantType::from_format(mode, bits, group) {
        Some(q) => q.name().into(),
        None if mode == "affine" => format!("int{bits}"),
        None => mode.to_string(),
    }
}

/// The quantization policy of one model (its architecture), as ollama picks it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policy {
    kind: Kind,
    /// A draft's output head (tied embedding or `lm_head`) takes the requested type directly:
    /// draft quality only moves acceptance, so the target's 8-bit promotion buys nothing.
    draft: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Generic,
    Gemma4 { layers: usize, experts: usize },
}

/// `architectures[0]`, else `model_type`, else `text_config.model_type` (ollama's
/// `sourceModelConfig.Architecture`).
pub fn architecture(cfg: &Value) -> String {
    fn text(v: Option<&Value>) -> Option<&str> {
        v.and_then(Value::as_str).filter(|s| !s.is_empty())
    }
    text(cfg.get("architectures").and_then(|a| a.get(0)))
        .or_else(|| text(cfg.get("model_type")))
        .or_else(|| text(cfg.get("text_config").and_then(|t| t.get("model_type"))))
        .unwrap_or_default()
        .to_string()
}

/// The architectures ollama registers gemma4's policy for (`tensorImportTransformRegistry`).
const GEMMA4: &[&str] = &[
    "Gemma4ForCausalLM",
    "Gemma4ForConditionalGeneration",
    "Gemma4UnifiedForCausalLM",
    "Gemma4UnifiedForConditionalGeneration",
    "gemma4_unified",
    "gemma4_unified_text",
    "Gemma4AssistantForCausalLM",
    "Gemma4UnifiedAssistantForCausalLM",
    "gemma4_unified_assistant",
];

impl Policy {
    /// The policy for a checkpoint with this `config.json`.
    pub fn for_config(cfg: &Value, draft: bool) -> Policy {
        let field = |key: &str| {
            cfg.get(key)
                .and_then(Value::as_u64)
                .filter(|n| *n > 0)
                .or_else(|| cfg.get("text_config")?.get(key)?.as_u64())
                .unwrap_or(0) as usize
        };
        let kind = if GEMMA4.contains(&architecture(cfg).as_str()) {
            Kind::Gemma4 {
                layers: field("num_hidden_layers"),
                experts: field("num_experts"),
            }
        } else {
            Kind::Generic
        };
        Policy { kind, draft }
    }

    /// The type `name` (as the checkpoint names it, unprefixed) is stored as, or `None` to keep
    /// its source precision.
    pub fn quant_type(&self, name: &str, shape: &[i32], requested: QuantType) -> Option<QuantType> {
        if self.draft && (is_embed_tokens(name) || name.ends_with("lm_head.weight")) {
            return aligned(shape, requested).then_some(requested);
        }
        match self.kind {
            Kind::Generic => generic(name, shape, requested),
            Kind::Gemma4 { layers, experts } => gemma4(name, shape, requested, layers, experts),
        }
    }
}

/// `isAligned`: quantized matrices need a last dimension that is a multiple of the type's group.
fn aligned(shape: &[i32], q: QuantType) -> bool {
    shape.last().is_some_and(|d| d % q.group_size() == 0)
}

/// `q` where it fits the shape.
fn fitting(shape: &[i32], q: QuantType) -> Option<QuantType> {
    aligned(shape, q).then_some(q)
}

fn is_embed_tokens(name: &str) -> bool {
    name.ends_with("embed_tokens.weight") && !name.contains("per_layer")
}

fn is_vision(name: &str) -> bool {
    name.contains("vision") || name.contains("visual")
}

fn is_audio(name: &str) -> bool {
    name.contains("audio_tower") || name.contains("embed_audio")
}

fn is_stacked_expert(name: &str) -> bool {
    if [".bias", ".scale", ".qbias"]
        .iter()
        .any(|s| name.ends_with(s))
    {
        return false;
    }
    [
        ".experts.",
        ".mlp.switch_mlp.",
        ".mlp.shared_experts.",
        ".mixer.shared_experts.",
    ]
    .iter()
    .any(|m| name.contains(m))
}

/// Tiny, selection-sensitive MoE routers stay at source precision.
fn is_routing_gate(name: &str) -> bool {
    [
        ".mlp.gate.weight",
        ".mixer.gate.weight",
        ".shared_expert_gate.weight",
        ".router.proj.weight",
    ]
    .iter()
    .any(|s| name.ends_with(s))
}

/// `ShouldQuantize`: weights only; never embeddings, norms, biases, audio towers.
fn should_quantize(name: &str) -> bool {
    !(is_audio(name)
        || name.contains("embed")
        || name.contains("norm")
        || name.contains("ln_")
        || name.ends_with(".bias"))
        && name.ends_with(".weight")
}

fn is_sensitive(name: &str) -> bool {
    name.contains(".v_proj") || name.contains(".k_proj") || name.contains("down_proj")
}

/// `GetTensorQuantization`: 2-D weights (3-D stacked experts) of at least 1024 elements whose
/// last dimension fits the group; `lm_head` at the 8-bit type of the family; at int4, and at
/// the FP4 types outside expert stacks, the value, key and down projections promoted to it.
fn generic(name: &str, shape: &[i32], requested: QuantType) -> Option<QuantType> {
    let stacked = is_stacked_expert(name);
    if !stacked && !should_quantize(name) {
        return None;
    }
    if shape.len() != 2 && !(shape.len() == 3 && stacked) {
        return None;
    }
    let elements: i64 = shape.iter().map(|&d| d as i64).product();
    if elements < 1024 || is_routing_gate(name) {
        return None;
    }
    if name.ends_with("lm_head.weight") {
        return fitting(shape, requested.eight_bit());
    }
    if is_vision(name) || !aligned(shape, requested) {
        return None;
    }
    // An expert stack's kernel takes one mode, so FP4 stacks are not promoted.
    let promotes = match requested {
        QuantType::Q4 => true,
        QuantType::Nvfp4 | QuantType::Mxfp4 => !stacked,
        _ => false,
    };
    if promotes && is_sensitive(name) {
        if let Some(e) = fitting(shape, requested.eight_bit()) {
            return Some(e);
        }
    }
    Some(requested)
}

/// `x/create/gemma4.go`: the token embedding (which is also the output head) at the 8-bit type
/// of the family, else the requested type, where they fit; value and down projections at the
/// 8-bit type only on the first and last eighth of the layers and every third between; key
/// projections at the requested type (unless the model has 8 experts).
fn gemma4(
    name: &str,
    shape: &[i32],
    requested: QuantType,
    layers: usize,
    experts: usize,
) -> Option<QuantType> {
    if is_embed_tokens(name) {
        return fitting(shape, requested.eight_bit()).or_else(|| fitting(shape, requested));
    }
    if is_sensitive(name)
        && !is_vision(name)
        && !is_audio(name)
        && requested.eight_bit() != requested
    {
        let promote = layers > 0
            && if experts == 8 && (name.contains(".v_proj") || name.contains(".k_proj")) {
                true
            } else if name.contains(".k_proj") {
                false
            } else {
                layer_index(name).is_some_and(|l| more_bits(l, layers))
            };
        // `sensitiveType`: the 8-bit type where promoted and it fits, else the requested one.
        let eight = promote
            .then(|| fitting(shape, requested.eight_bit()))
            .flatten();
        return eight.or_else(|| fitting(shape, requested));
    }
    generic(name, shape, requested)
}

/// The `N` of the first `.layers.N.` in a name.
fn layer_index(name: &str) -> Option<usize> {
    let rest = &name[name.find(".layers.")? + ".layers.".len()..];
    let digits = &rest[..rest.find('.')?];
    digits.parse().ok()
}

/// `useMoreBits`: the first and last eighth of the layers, and every third layer between.
fn more_bits(layer: usize, layers: usize) -> bool {
    let first = layers / 8;
    let last = 7 * layers / 8;
    layer < first || layer >= last || (layer - first) % 3 == 2
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn gemma(layers: usize, experts: usize) -> Policy {
        Policy::for_config(
            &json!({"architectures": ["Gemma4ForConditionalGeneration"],
                    "text_config": {"num_hidden_layers": layers, "num_experts": experts}}),
            false,
        )
    }

    #[test]
    fn generic_policy_follows_ollama() {
        let p = Policy::for_config(&json!({"architectures": ["Glm4MoeLiteForCausalLM"]}), false);
        let q4 = |n: &str, s: &[i32]| p.quant_type(n, s, QuantType::Q4);
        assert_eq!(
            q4("model.layers.1.self_attn.q_a_proj.weight", &[64, 64]),
            Some(QuantType::Q4)
        );
        assert_eq!(
            q4("model.layers.1.mlp.down_proj.weight", &[64, 128]),
            Some(QuantType::Q8)
        );
        assert_eq!(
            q4("model.layers.1.self_attn.kv_b_proj.weight", &[64, 32]),
            None,
            "misaligned"
        );
        assert_eq!(q4("model.embed_tokens.weight", &[256, 64]), None);
        assert_eq!(q4("lm_head.weight", &[256, 64]), Some(QuantType::Q8));
        assert_eq!(
            q4("model.layers.1.mlp.gate.weight", &[64, 64]),
            None,
            "router"
        );
        assert_eq!(q4("model.norm.weight", &[64]), None);
        assert_eq!(
            q4("model.layers.1.mlp.experts.up_proj.weight", &[8, 32, 64]),
            Some(QuantType::Q4)
        );
        assert_eq!(
            q4("model.layers.1.mlp.experts.down_proj.weight", &[8, 64, 32]),
            None
        );
        assert_eq!(
            q4("model.layers.1.self_attn.o_proj.weight", &[8, 64]),
            None,
            "< 1024"
        );
        assert_eq!(
            p.quant_type("lm_head.weight", &[256, 64], QuantType::Q8),
            Some(QuantType::Q8)
        );
    }

    #[test]
    fn gemma4_promotes_on_early_late_and_every_third_layer() {
        let p = gemma(16, 0);
        let v = |l: usize| {
            p.quant_type(
                &format!("model.language_model.layers.{l}.self_attn.v_proj.weight"),
                &[64, 64],
                QuantType::Q4,
            )
        };
        // first = 2, last = 14: layers 0, 1, 4, 7, 10, 13, 14, 15 at 8 bits.
        let promoted: Vec<usize> = (0..16).filter(|&l| v(l) == Some(QuantType::Q8)).collect();
        assert_eq!(promoted, vec![0, 1, 4, 7, 10, 13, 14, 15]);
        let k = p.quant_type(
            "model.language_model.layers.0.self_attn.k_proj.weight",
            &[64, 64],
            QuantType::Q4,
        );
        assert_eq!(k, Some(QuantType::Q4));
        let e = p.quant_type(
            "model.language_model.embed_tokens.weight",
            &[256, 64],
            QuantType::Q4,
        );
        assert_eq!(e, Some(QuantType::Q8));
        let ple = p.quant_type(
            "model.language_model.embed_tokens_per_layer.weight",
            &[256, 64],
            QuantType::Q4,
        );
        assert_eq!(ple, None);
        // Eight experts: keys and values always at 8 bits.
        let k8 = gemma(16, 8).quant_type(
            "model.layers.5.self_attn.k_proj.weight",
            &[64, 64],
            QuantType::Q4,
        );
        assert_eq!(k8, Some(QuantType::Q8));
    }

    #[test]
    fn a_draft_head_takes_the_requested_type() {
        let cfg = json!({"architectures": ["Gemma4AssistantForCausalLM"], "num_hidden_layers": 4});
        let d = Policy::for_config(&cfg, true);
        assert_eq!(
            d.quant_type("model.embed_tokens.weight", &[256, 64], QuantType::Q4),
            Some(QuantType::Q4)
        );
        let t = Policy::for_config(&cfg, false);
        assert_eq!(
            t.quant_type("model.embed_tokens.weight", &[256, 64], QuantType::Q4),
            Some(QuantType::Q8)
        );
    }

    #[test]
    fn quant_names() {
        assert_eq!("q4".parse::<QuantType>(), Ok(QuantType::Q4));
        assert_eq!("INT8".parse::<QuantType>(), Ok(QuantType::Q8));
        assert_eq!("NVFP4".parse::<QuantType>(), Ok(QuantType::Nvfp4));
        assert_eq!("mxfp8".parse::<QuantType>(), Ok(QuantType::Mxfp8));
        assert!("q5"
            .parse::<QuantType>()
            .unwrap_err()
            .contains("unknown quantization"));
        assert_eq!(QuantType::Q4.name(), "int4");
        assert_eq!(type_name("affine", 3, 64), "int3");
        assert_eq!(type_name("nvfp4", 4, 16), "nvfp4");
        assert_eq!(type_name("affine", 8, 64), "int8");
    }

    /// The FP4 family: 8-bit promotions go to mxfp8, groups are the type's own, and expert
    /// stacks keep the requested type.
    #[test]
    fn fp4_types_promote_within_their_family() {
        let p = Policy::for_config(&json!({"architectures": ["Glm4MoeLiteForCausalLM"]}), false);
        let nv = |n: &str, s: &[i32]| p.quant_type(n, s, QuantType::Nvfp4);
        assert_eq!(
            nv("model.layers.1.mlp.down_proj.weight", &[64, 128]),
            Some(QuantType::Mxfp8)
        );
        assert_eq!(
            nv("model.layers.1.mlp.experts.down_proj.weight", &[8, 64, 32]),
            Some(QuantType::Nvfp4),
            "stacked experts are not promoted"
        );
        assert_eq!(
            nv("model.layers.1.self_attn.q_a_proj.weight", &[64, 48]),
            Some(QuantType::Nvfp4),
            "48 is whole groups of 16"
        );
        assert_eq!(
            nv("model.layers.1.mlp.down_proj.weight", &[64, 48]),
            Some(QuantType::Nvfp4),
            "mxfp8 does not fit 48"
        );
        assert_eq!(nv("lm_head.weight", &[256, 64]), Some(QuantType::Mxfp8));
        assert_eq!(
            p.quant_type(
                "model.layers.1.mlp.down_proj.weight",
                &[64, 128],
                QuantType::Mxfp8
            ),
            Some(QuantType::Mxfp8)
        );
        let g = gemma(16, 0);
        assert_eq!(
            g.quant_type(
                "model.language_model.embed_tokens.weight",
                &[256, 64],
                QuantType::Mxfp4
            ),
            Some(QuantType::Mxfp8)
        );
        assert_eq!(
            g.quant_type(
                "model.language_model.layers.0.self_attn.v_proj.weight",
                &[64, 64],
                QuantType::Mxfp4
            ),
            Some(QuantType::Mxfp8)
        );
        assert_eq!(
            g.quant_type(
                "model.language_model.layers.2.self_attn.v_proj.weight",
                &[64, 64],
                QuantType::Mxfp4
            ),
            Some(QuantType::Mxfp4)
        );
    }
}
