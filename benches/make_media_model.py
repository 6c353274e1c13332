"""Writes the media benchmark's model (benches/media.rs): the 4-bit benchmark text model
(target/bench-model-q4-g64, mlx-lm's conversion) with gemma4 E2B's vision and audio towers in
float32 (the tower benchmarks' random checkpoints, target/bench-vision and target/bench-audio),
embedders of random weights into the text model's width, one processor_config.json holding the
image processor and the feature extractor as gemma4's releases do, and the media the benchmark
sends: five different 640x480 images and four different 10 s clips (no two alike, so that
neither the prefix cache nor anything else can spare an encoding between runs).

Usage: python benches/make_media_model.py OUT TEXT_DIR VISION_DIR AUDIO_DIR
Needs mlx, numpy and Pillow (.venv-peer: benches/peer-venv.sh).
"""
import json
import os
import shutil
import sys
import wave

import mlx.core as mx
import numpy as np
from PIL import Image

IMAGES = 5
CLIPS = 4
SECONDS = 10


def main(out, text_dir, vision_dir, audio_dir):
    os.makedirs(out, exist_ok=True)
    text = json.load(open(os.path.join(text_dir, "config.json")))
    vision = json.load(open(os.path.join(vision_dir, "config.json")))
    audio = json.load(open(os.path.join(audio_dir, "config.json")))
    vocab = text["vocab_size"]
    quant = text.pop("quantization")
    text.pop("quantization_config", None)
    text["model_type"] = "gemma4_text"
    text["use_bidirectional_attention"] = "vision"
    # The media tokens: the last six ids of the padded tokenizer's vocabulary (the runner
    # places them by id; the text never spells them).
    ids = dict(zip(["boa_token_id", "eoa_token_id", "audio_token_id", "boi_token_id",
                    "eoi_token_id", "image_token_id"], range(vocab - 6, vocab)))
    config = {
        "architectures": ["Gemma4ForConditionalGeneration"],
        "model_type": "gemma4",
        "text_config": text,
        "vision_config": vision["vision_config"],
        "audio_config": audio["audio_config"],
        "quantization": quant,
        "tie_word_embeddings": True,
        **ids,
        "eoa_token_index": ids["eoa_token_id"],
    }
    json.dump(config, open(os.path.join(out, "config.json"), "w"), indent=2)

    weights = {}
    for k, v in mx.load(os.path.join(text_dir, "model.safetensors")).items():
        weights["model.language_model." + k[len("model."):]] = v
    g = np.random.default_rng(0)
    for src, tower, embed, width in (
        (vision_dir, "vision_tower", "embed_vision", vision["vision_config"]["hidden_size"]),
        (audio_dir, "audio_tower", "embed_audio", audio["audio_config"]["output_proj_dims"]),
    ):
        for k, v in mx.load(os.path.join(src, "model.safetensors")).items():
            if k.startswith(f"model.{tower}."):
                weights[k] = v
        proj = g.standard_normal((text["hidden_size"], width)).astype(np.float32) / width**0.5
        weights[f"model.{embed}.embedding_projection.weight"] = mx.array(proj)
    mx.save_safetensors(os.path.join(out, "model.safetensors"), weights,
                        metadata={"format": "mlx"})

    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(text_dir, name), os.path.join(out, name))
    image = json.load(open(os.path.join(vision_dir, "preprocessor_config.json")))
    audio_proc = json.load(open(os.path.join(audio_dir, "processor_config.json")))
    json.dump({"processor_class": "Gemma4Processor", "image_processor": image,
               "feature_extractor": audio_proc["feature_extractor"],
               "image_seq_length": image["max_soft_tokens"],
               "audio_seq_length": audio_proc["audio_seq_length"]},
              open(os.path.join(out, "processor_config.json"), "w"), indent=2)

    for i in range(IMAGES):
        img = g.integers(0, 256, (480, 640, 3), dtype=np.uint8)
        Image.fromarray(img, "RGB").save(os.path.join(out, f"image{i}.png"))
    for i in range(CLIPS):
        t = np.arange(SECONDS * 16000) / 16000
        x = 0.3 * np.sin(2 * np.pi * (150 + 40 * i) * t) + g.normal(0, 0.05, t.shape)
        pcm = np.clip(np.round(x * 20000), -32768, 32767).astype("<i2")
        with wave.open(os.path.join(out, f"clip{i}.wav"), "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(16000)
            w.writeframes(pcm.tobytes())


if __name__ == "__main__":
    main(*sys.argv[1:5])
