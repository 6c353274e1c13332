"""The audio benchmark's model and peer (benches/audio.rs).

`make DIR`: a gemma4 checkpoint whose audio tower has gemma4 E2B's shape (hidden 1024, 12
conformer layers, 8 heads, subsampling channels 128 and 32, output 1536) with random weights, a
tiny text model (the tower is what is measured), the feature extractor's config and a 30 s
16-bit WAV at 16 kHz (DIR/clip.wav: the longest clip one prompt item may hold, 750 soft tokens).

`time DIR RUNS [SECONDS]`: transformers' float32 CPU time to extract the log-mel features and
encode the clip or its first SECONDS (`Gemma4AudioFeatureExtractor` then `get_audio_features`),
a `warmup SECONDS` line, then one line per run in seconds, then `peak BYTES`: how much resident
memory the warm-up run grew.

Needs torch and transformers (tests/fixtures/requirements.txt: .venv-golden).
"""
import json
import os
import sys
import time
import wave

import numpy as np
import torch
from transformers import Gemma4AudioConfig, Gemma4ForConditionalGeneration
from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tower_peer import rss_peak, rss_reset, save_random_model  # noqa: E402

torch.set_grad_enabled(False)
torch.set_num_threads(os.cpu_count() or 1)
SECONDS = 30


def make(out):
    audio = Gemma4AudioConfig(hidden_size=1024, num_hidden_layers=12, num_attention_heads=8,
                              subsampling_conv_channels=[128, 32], output_proj_dims=1536)
    save_random_model(out, vision_config=None, audio_config=audio, boa_token_id=506,
                      eoa_token_index=507, audio_token_id=508)
    fe = Gemma4AudioFeatureExtractor()
    json.dump({"processor_class": "Gemma4Processor", "audio_seq_length": 750,
               "feature_extractor": json.loads(fe.to_json_string())},
              open(os.path.join(out, "processor_config.json"), "w"), indent=2)
    g = np.random.default_rng(0)
    t = np.arange(SECONDS * 16000) / 16000
    x = 0.3 * np.sin(2 * np.pi * 180 * t) + g.normal(0, 0.05, t.shape)
    pcm = np.clip(np.round(x * 20000), -32768, 32767).astype("<i2")
    with wave.open(os.path.join(out, "clip.wav"), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(pcm.tobytes())


def timing(out, runs, seconds):
    m = Gemma4ForConditionalGeneration.from_pretrained(out).eval()
    # Every weight read in before measuring (from_pretrained maps them lazily), as ours are.
    for p in m.parameters():
        p.sum()
    fe = Gemma4AudioFeatureExtractor()
    with wave.open(os.path.join(out, "clip.wav"), "rb") as w:
        pcm = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
    pcm = pcm[: int(seconds * 16000)]
    peak = 0
    for i in range(runs + 1):
        base = rss_reset() if i == 0 else 0
        t0 = time.perf_counter()
        wav = pcm.astype(np.float32) / 32768.0
        b = fe([wav], return_tensors="pt")
        m.model.get_audio_features(b["input_features"], b["input_features_mask"],
                                   return_dict=True)
        dt = time.perf_counter() - t0
        print(f"warmup {dt}" if i == 0 else dt, flush=True)
        if i == 0:
            peak = rss_peak() - base
    print(f"peak {peak}", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "make":
        make(sys.argv[2])
    else:
        seconds = float(sys.argv[4]) if len(sys.argv) > 4 else SECONDS
        timing(sys.argv[2], int(sys.argv[3]), seconds)
