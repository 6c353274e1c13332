"""mlx-lm's greedy generation with its own KV cache, float or quantized (`--kv-bits`), for the
KV cache benchmark's agreement table. Usage: python benches/kv_peer.py MODEL BITS N < IDS
(IDS: the prompt as our runner tokenized it, a JSON array; BITS 0: mlx-lm's float cache).
Prints one JSON object: per generated token its text (the tokenizer's decoding of that one
id) and logprob.

mlx-lm quantizes only its plain KVCache (`to_quantized`): a RotatingKVCache (gemma4's sliding
layers) raises NotImplementedError, and GLM4-MoE-Lite's MLA reads its cached rope keys as an
array, which a quantized cache hands back as a tuple. So the benchmark compares on a gemma4
whose layers all attend globally.
"""
import json
import sys

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step


def main():
    model_dir, bits, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    model, tokenizer = load(model_dir)
    ids = json.load(sys.stdin)
    steps = generate_step(
        mx.array(ids),
        model,
        max_tokens=n,
        kv_bits=bits or None,
        kv_group_size=64,
        quantized_kv_start=0,
    )
    out = []
    for token, logprobs in steps:
        t = int(token)
        if t in tokenizer.eos_token_ids:
            break
        out.append({"token": tokenizer.decode([t]), "logprob": float(logprobs[t])})
    print(json.dumps({"tokens": out}))


if __name__ == "__main__":
    main()
