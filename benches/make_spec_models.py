"""Models for the speculative-decoding benchmark, from the benchmark model (benches/generate.rs):

  target/      the benchmark model with layers 2.. made identities (o_proj and down_proj zero):
               the same cost per token as the original, but its output is that of layers 0..1;
               its head is untied and random (a random model with a tied head mostly predicts
               the token it was given, which any drafter with a tied head would guess too)
  draft-good/  layers 0..1 of it as a separate 2-layer model: it predicts the target exactly
  draft-bad/   the same shape with random weights: its drafts are (almost) always rejected

Usage: python benches/make_spec_models.py BENCH_MODEL_DIR OUT_DIR
"""
import json
import os
import shutil
import sys

import mlx.core as mx


def main():
    src, out = sys.argv[1], sys.argv[2]
    cfg = json.load(open(os.path.join(src, "config.json")))
    w = mx.load(os.path.join(src, "model.safetensors"))
    keep = 2
    for name in ("target", "draft-good", "draft-bad"):
        os.makedirs(os.path.join(out, name), exist_ok=True)
        for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            shutil.copy(os.path.join(src, f), os.path.join(out, name, f))
    mx.random.seed(3)
    head = mx.random.normal((cfg["vocab_size"], cfg["hidden_size"])) * cfg["hidden_size"] ** -0.5 * 2.0
    cfg = dict(cfg, tie_word_embeddings=False)
    w = dict(w, **{"lm_head.weight": head})
    target = dict(w)
    for k in list(target):
        if ".layers." in k:
            i = int(k.split(".layers.")[1].split(".")[0])
            if i >= keep and (k.endswith("o_proj.weight") or k.endswith("down_proj.weight")):
                target[k] = mx.zeros_like(target[k])
            if i >= keep and k.endswith("layer_scalar"):
                target[k] = mx.ones_like(target[k])
    mx.save_safetensors(os.path.join(out, "target", "model.safetensors"), target, metadata={"format": "mlx"})
    json.dump(cfg, open(os.path.join(out, "target", "config.json"), "w"), indent=2)

    dcfg = dict(cfg, num_hidden_layers=keep, layer_types=cfg["layer_types"][:keep])
    good = {k: v for k, v in w.items() if ".layers." not in k or int(k.split(".layers.")[1].split(".")[0]) < keep}
    mx.save_safetensors(os.path.join(out, "draft-good", "model.safetensors"), good, metadata={"format": "mlx"})
    json.dump(dcfg, open(os.path.join(out, "draft-good", "config.json"), "w"), indent=2)
    mx.random.seed(7)
    bad = {k: (mx.random.normal(v.shape) * v.std() + (1.0 if v.ndim == 1 else 0.0)).astype(v.dtype) for k, v in good.items()}
    bad["lm_head.weight"] = mx.random.normal(head.shape) * cfg["hidden_size"] ** -0.5 * 2.0
    mx.save_safetensors(os.path.join(out, "draft-bad", "model.safetensors"), bad, metadata={"format": "mlx"})
    json.dump(dcfg, open(os.path.join(out, "draft-bad", "config.json"), "w"), indent=2)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
