"""mlx-vlm as the tower benchmarks' peer (benches/vision.rs, benches/audio.rs): the same
checkpoints (written by benches/vision_peer.py and benches/audio_peer.py), preprocessed and
encoded by mlx-vlm's gemma4 on the same MLX build's CPU backend, float32.

`vision DIR RUNS`: mlx-vlm's `Gemma4ImageProcessor` on DIR/image.png, then `encode_image`
(vision tower and embedder).
`audio DIR RUNS`: mlx-vlm's `Gemma4AudioFeatureExtractor` on DIR/clip.wav (or the first
`--seconds` of it), then its audio tower and embedder.

Prints one line per run in seconds, then `peak BYTES`: how much resident memory the first run
grew. There is no warm-up run: the weights are evaluated at load and MLX compiles nothing for
the CPU here, so the first run takes what the later ones take (272, 275 and 272 s measured for
the vision tower), and one run of the vision tower is four and a half minutes. Needs .venv-peer (benches/peer-venv.sh).
"""
import json
import os
import sys
import time
import types
import wave
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tower_peer import rss_peak, rss_reset  # noqa: E402


def runs_timed(runs, once):
    """`once()` run `runs` times, each evaluated, its seconds printed; the first run's growth of
    resident memory printed last."""
    peak = 0
    for i in range(runs):
        base = rss_reset() if i == 0 else 0
        t0 = time.perf_counter()
        mx.eval(once())
        print(time.perf_counter() - t0, flush=True)
        if i == 0:
            peak = rss_peak() - base
    print(f"peak {peak}", flush=True)


def tower_alone(out, tower, embedder, prefix, embed_prefix):
    """`tower` and `embedder` loaded strictly from DIR's checkpoint, sanitized as mlx-vlm's
    gemma4 sanitizes it. mlx-vlm's text model does not read this checkpoint's tiny text config
    (it assumes the released sizes' global head width), and the tower is what is measured."""
    from mlx_vlm.models.gemma4.gemma4 import Model

    weights = mx.load(os.path.join(out, "model.safetensors"))
    audio = tower if prefix == "audio_tower." else None
    as_model = types.SimpleNamespace(
        config=types.SimpleNamespace(text_config=None, vision_config=None,
                                     audio_config=getattr(audio, "config", None)),
        audio_tower=audio)
    weights = Model.sanitize(as_model, weights)
    for part, p in ((tower, prefix), (embedder, embed_prefix)):
        part.load_weights([(k[len(p):], v) for k, v in weights.items() if k.startswith(p)],
                          strict=True)
        mx.eval(part.parameters())


def vision(out, runs):
    from PIL import Image
    from mlx_vlm.models.gemma4.config import VisionConfig
    from mlx_vlm.models.gemma4.gemma4 import MultimodalEmbedder
    from mlx_vlm.models.gemma4.processing_gemma4 import Gemma4ImageProcessor
    from mlx_vlm.models.gemma4.vision import VisionModel

    config = json.load(open(os.path.join(out, "config.json")))
    vc = VisionConfig.from_dict(config["vision_config"])
    tower = VisionModel(vc)
    embed = MultimodalEmbedder(vc.hidden_size, config["text_config"]["hidden_size"],
                               vc.rms_norm_eps)
    tower_alone(out, tower, embed, "vision_tower.", "embed_vision.")
    pre = json.load(open(os.path.join(out, "preprocessor_config.json")))
    proc = Gemma4ImageProcessor(
        patch_size=pre.get("patch_size", 16),
        max_soft_tokens=pre.get("max_soft_tokens", 280),
        pooling_kernel_size=pre.get("pooling_kernel_size", 3),
    )
    img = Image.open(os.path.join(out, "image.png"))

    def once():
        data, _ = proc([img])
        return embed(tower(mx.array(data["pixel_values"])))

    runs_timed(runs, once)


def audio(out, runs, seconds):
    from mlx_vlm.models.gemma4.audio import AudioEncoder
    from mlx_vlm.models.gemma4.audio_feature_extractor import Gemma4AudioFeatureExtractor
    from mlx_vlm.models.gemma4.config import AudioConfig
    from mlx_vlm.models.gemma4.gemma4 import MultimodalEmbedder

    config = json.load(open(os.path.join(out, "config.json")))
    ac = AudioConfig.from_dict(config["audio_config"])
    tower = AudioEncoder(ac)
    tower.config = ac
    embed = MultimodalEmbedder(ac.output_proj_dims or ac.hidden_size,
                               config["text_config"]["hidden_size"], ac.rms_norm_eps)
    tower_alone(out, tower, embed, "audio_tower.", "embed_audio.")

    fe_config = json.load(open(os.path.join(out, "processor_config.json")))["feature_extractor"]
    keep = Gemma4AudioFeatureExtractor.__init__.__code__.co_varnames
    fe = Gemma4AudioFeatureExtractor(**{k: v for k, v in fe_config.items() if k in keep})
    with wave.open(os.path.join(out, "clip.wav"), "rb") as w:
        pcm = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
    pcm = pcm[: int(seconds * 16000)]

    def once():
        wav = pcm.astype(np.float32) / 32768.0
        b = fe([wav])
        feats = mx.array(np.stack(b["input_features"]))
        mask = ~mx.array(np.stack(b["input_features_mask"])).astype(mx.bool_)
        enc, _ = tower(feats, mask)
        return embed(enc)

    runs_timed(runs, once)


if __name__ == "__main__":
    mx.set_default_device(mx.cpu)
    if sys.argv[1] == "vision":
        vision(sys.argv[2], int(sys.argv[3]))
    else:
        audio(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]) if len(sys.argv) > 4 else 30)
