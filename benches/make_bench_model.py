"""Writes the benchmark model: a randomly initialised gemma4-shaped text model of about 120M
parameters in float32, built and saved by mlx-lm itself (so the peer loads it natively), with
the fixture tokenizer. Usage: python benches/make_bench_model.py OUT_DIR [--global]

`--global`: every layer attends globally (no sliding window), the one gemma4 form whose cache
mlx-lm can quantize (the KV cache benchmark compares against it there).
"""
import json
import os
import sys

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models import gemma4_text
from padded_tokenizer import write_padded_tokenizer

CONFIG = {
    "model_type": "gemma4_text",
    "vocab_size": 32768,
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 10,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "global_head_dim": 256,
    "sliding_window": 512,
    "layer_types": (["sliding_attention"] * 4 + ["full_attention"]) * 2,
    "num_kv_shared_layers": 0,
    "hidden_size_per_layer_input": 0,
    "vocab_size_per_layer_input": 0,
    "use_double_wide_mlp": False,
    "attention_k_eq_v": False,
    "enable_moe_block": False,
    "final_logit_softcapping": 30.0,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": True,
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
    },
    "bos_token_id": 2,
    "eos_token_id": 1,
    "pad_token_id": 0,
    "torch_dtype": "float32",
}


def main():
    out = sys.argv[1]
    config = dict(CONFIG)
    if "--global" in sys.argv[2:]:
        config["layer_types"] = ["full_attention"] * config["num_hidden_layers"]
    os.makedirs(out, exist_ok=True)
    mx.random.seed(0)
    model = gemma4_text.Model(gemma4_text.ModelArgs.from_dict(config))
    params = dict(tree_flatten(model.parameters()))
    # Norm weights near 1 and small matrices keep activations sane through 10 layers.
    for k, v in params.items():
        if v.ndim == 1:
            params[k] = mx.ones_like(v) + 0.05 * mx.random.normal(v.shape)
        else:
            params[k] = mx.random.normal(v.shape) * (v.shape[-1] ** -0.5)
    mx.save_safetensors(os.path.join(out, "model.safetensors"), params, metadata={"format": "mlx"})
    json.dump(config, open(os.path.join(out, "config.json"), "w"), indent=2)
    fixture = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "models", "gemma4_31b_like")
    write_padded_tokenizer(fixture, out, config["vocab_size"])
    n = sum(v.size for v in params.values())
    print(f"wrote {out}: {n / 1e6:.1f}M parameters")


if __name__ == "__main__":
    main()
