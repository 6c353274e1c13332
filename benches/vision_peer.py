"""The vision benchmark's model and peer (benches/vision.rs).

`make DIR`: a gemma4 checkpoint whose vision tower has gemma4 E2B's shape (hidden 768,
intermediate 3072, 16 layers, 12 heads of 64, 16-pixel patches, 3x3 pooling, 280 soft tokens)
with random weights, a tiny text model (the tower is what is measured), the image processor's
config and a 640x480 test image (DIR/image.png).

`time DIR RUNS`: transformers' float32 CPU time to preprocess and encode the image
(`Gemma4ImageProcessorPil` then `get_image_features`), a `warmup SECONDS` line, then one line
per run in seconds, then `peak BYTES`: how much resident memory the warm-up run grew.

Needs torch, transformers and Pillow (tests/fixtures/requirements.txt: .venv-golden).
"""
import os
import sys
import time

import numpy as np
import torch
from PIL import Image
from transformers import Gemma4ForConditionalGeneration, Gemma4VisionConfig
from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tower_peer import rss_peak, rss_reset, save_random_model  # noqa: E402

torch.set_grad_enabled(False)
torch.set_num_threads(os.cpu_count() or 1)


def processor():
    return Gemma4ImageProcessorPil(patch_size=16, pooling_kernel_size=3, max_soft_tokens=280)


def make(out):
    vision = Gemma4VisionConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=16,
                                num_attention_heads=12, num_key_value_heads=12, head_dim=64,
                                patch_size=16, pooling_kernel_size=3)
    save_random_model(out, vision_config=vision, audio_config=None, boi_token_id=509,
                      eoi_token_id=510, image_token_id=511)
    processor().save_pretrained(out)
    g = np.random.default_rng(0)
    img = g.integers(0, 256, (480, 640, 3), dtype=np.uint8)
    Image.fromarray(img, "RGB").save(os.path.join(out, "image.png"))


def timing(out, runs):
    m = Gemma4ForConditionalGeneration.from_pretrained(out).eval()
    # Every weight read in before measuring (from_pretrained maps them lazily), as ours are.
    for p in m.parameters():
        p.sum()
    proc = processor()
    img = Image.open(os.path.join(out, "image.png"))
    peak = 0
    for i in range(runs + 1):
        base = rss_reset() if i == 0 else 0
        t0 = time.perf_counter()
        b = proc(images=[img], return_tensors="pt")
        m.model.get_image_features(b["pixel_values"], b["image_position_ids"], return_dict=True)
        dt = time.perf_counter() - t0
        print(f"warmup {dt}" if i == 0 else dt, flush=True)
        if i == 0:
            peak = rss_peak() - base
    print(f"peak {peak}", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "make":
        make(sys.argv[2])
    else:
        timing(sys.argv[2], int(sys.argv[3]))
