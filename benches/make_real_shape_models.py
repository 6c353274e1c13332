"""Writes 4-bit models with the real dimensions of gemma4 E2B, of gemma4 31B (fewer layers) and of
GLM4-MoE-Lite (GLM-4.7-Flash, fewer layers) and random weights, for `cargo bench --bench
real_shapes` and `--bench distributed`.

Usage: python benches/make_real_shape_models.py e2b|g31|glm OUT_DIR [LAYERS]

The models are built by mlx-lm's own classes and quantized by mlx-lm's own `quantize_model`
(affine, 4 bits, group 64; the same modules `mlx_lm convert -q` quantizes), so both mlx-lm and
mlx-runner load them natively. Materializing float weights first would not fit: E2B's
per-layer embedding table alone is 262144 x 8960 (9.4 GB in float32). Instead, every quantized
matrix gets random packed 4-bit codes with a scale and bias per group that centre it (w = s(q - 8),
s = 1 / (4.6 sqrt(in))), written straight into the quantized layout; the float graph mlx-lm's
initialisation would have computed is dropped unevaluated. Norm scales are near 1 and the
remaining small float tensors are random; nothing here is trained, so the text is noise, but
every matrix a token touches is read, which is what decode speed depends on.
"""
import json
import os
import sys

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.utils import quantize_model
from padded_tokenizer import write_padded_tokenizer

GROUP, BITS = 64, 4

E2B = {
    "model_type": "gemma4_text",
    "vocab_size": 262144,
    "hidden_size": 1536,
    "intermediate_size": 6144,
    "num_hidden_layers": 35,
    "num_attention_heads": 8,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "global_head_dim": 512,
    "sliding_window": 512,
    "layer_types": (["sliding_attention"] * 4 + ["full_attention"]) * 7,
    "num_kv_shared_layers": 20,
    "hidden_size_per_layer_input": 256,
    "vocab_size_per_layer_input": 262144,
    "use_double_wide_mlp": True,
    "attention_k_eq_v": False,
    "enable_moe_block": False,
    "final_logit_softcapping": 30.0,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": True,
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {
            "rope_type": "proportional",
            "partial_rotary_factor": 0.25,
            "rope_theta": 1000000.0,
        },
    },
    "bos_token_id": 2,
    "eos_token_id": 1,
    "pad_token_id": 0,
    "torch_dtype": "float32",
}

# gemma4 31B's widths (k_eq_v full layers, 16 sliding and 4 global KV heads); 6 layers (5 sliding
# + 1 full) instead of 60.
G31 = dict(
    E2B,
    hidden_size=5376,
    intermediate_size=21504,
    num_hidden_layers=6,
    num_attention_heads=32,
    num_key_value_heads=16,
    num_global_key_value_heads=4,
    sliding_window=1024,
    layer_types=None,
    sliding_window_pattern=6,
    num_kv_shared_layers=0,
    hidden_size_per_layer_input=0,
    use_double_wide_mlp=False,
    attention_k_eq_v=True,
)

# GLM-4.7-Flash's widths and expert counts; 4 layers (1 dense + 3 MoE) instead of 47.
GLM = {
    "model_type": "glm4_moe_lite",
    "vocab_size": 154880,
    "hidden_size": 2048,
    "intermediate_size": 10240,
    "moe_intermediate_size": 1536,
    "num_hidden_layers": 4,
    "num_attention_heads": 20,
    "num_key_value_heads": 20,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 202752,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
    "partial_rotary_factor": 1.0,
    "q_lora_rank": 768,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 192,
    "qk_rope_head_dim": 64,
    "v_head_dim": 256,
    "n_routed_experts": 64,
    "n_shared_experts": 1,
    "num_experts_per_tok": 4,
    "routed_scaling_factor": 1.8,
    "norm_topk_prob": True,
    "n_group": 1,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "num_nextn_predict_layers": 0,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 0,
    "torch_dtype": "float32",
}


def random_codes(module, key):
    """Random packed codes, scales and biases of the module's quantized shapes."""
    k1, k2 = mx.random.split(key)
    shape = module.weight.shape
    inputs = shape[-1] * 32 // BITS
    hi = mx.random.randint(0, 1 << 16, shape, dtype=mx.uint32, key=k1)
    lo = mx.random.randint(0, 1 << 16, shape, dtype=mx.uint32, key=k2)
    module.weight = (hi << 16) | lo
    s = 1.0 / (4.6 * inputs**0.5)
    module.scales = mx.full(module.scales.shape, s, dtype=mx.float32)
    module.biases = mx.full(module.biases.shape, -8.0 * s, dtype=mx.float32)


def main():
    which, out = sys.argv[1], sys.argv[2]
    config = dict({"e2b": E2B, "g31": G31, "glm": GLM}[which])
    # An optional layer count: deeper models for the distributed bench, whose split by layers
    # needs enough of them to be even.
    if len(sys.argv) > 3:
        config["num_hidden_layers"] = int(sys.argv[3])
    if which == "g31":
        # Five sliding layers to one full, the last full.
        n = config["num_hidden_layers"]
        config["layer_types"] = [
            "full_attention" if (i + 1) % 6 == 0 or i == n - 1 else "sliding_attention"
            for i in range(n)
        ]
        del config["sliding_window_pattern"]
    if which in ("e2b", "g31"):
        from mlx_lm.models import gemma4_text as arch
    else:
        from mlx_lm.models import glm4_moe_lite as arch
    os.makedirs(out, exist_ok=True)
    mx.random.seed(0)
    model = arch.Model(arch.ModelArgs.from_dict(config))
    model, qconfig = quantize_model(model, config, GROUP, BITS)
    for i, (path, module) in enumerate(model.named_modules()):
        if hasattr(module, "scales") and hasattr(module, "biases"):
            random_codes(module, mx.random.key(i + 2))
    params = dict(tree_flatten(model.parameters()))
    for k, v in list(params.items()):
        if v.dtype == mx.uint32 or k.endswith(".scales") or k.endswith(".biases"):
            continue
        if v.ndim == 1 and "norm" in k:
            params[k] = mx.ones(v.shape) + 0.05 * mx.random.normal(v.shape)
        elif v.ndim >= 1:
            params[k] = mx.random.normal(v.shape) * (v.shape[-1] ** -0.5)
    # Shards of about 1 GB, as published checkpoints come (the loaders read the index).
    shards, cur, size = [], {}, 0
    for k in sorted(params):
        cur[k] = params[k]
        size += params[k].nbytes
        if size > 1 << 30:
            shards.append(cur)
            cur, size = {}, 0
    if cur:
        shards.append(cur)
    index = {}
    for n, shard in enumerate(shards):
        name = f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors"
        mx.eval(shard)
        mx.save_safetensors(os.path.join(out, name), shard, metadata={"format": "mlx"})
        index.update({k: name for k in shard})
    json.dump(
        {"metadata": {}, "weight_map": index},
        open(os.path.join(out, "model.safetensors.index.json"), "w"),
        indent=2,
    )
    json.dump(qconfig, open(os.path.join(out, "config.json"), "w"), indent=2)
    here = os.path.dirname(os.path.abspath(__file__))
    fixture = os.path.join(
        here, "..", "tests", "fixtures", "models", {"e2b": "gemma4_e2b_like", "g31": "gemma4_31b_like", "glm": "glm4_moe_lite"}[which]
    )
    write_padded_tokenizer(fixture, out, config["vocab_size"])
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
