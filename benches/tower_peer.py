"""What the tower benchmarks' Python peers share (benches/vision_peer.py, benches/audio_peer.py):
a checkpoint of random weights around the tower measured, and this process's resident memory
(Linux /proc). torch is imported only to write a checkpoint, so the mlx-vlm peer
(benches/vlm_peer.py) shares the memory readings without it."""


def save_random_model(out, **towers):
    """A gemma4 checkpoint in `out` with the given towers (`vision_config`, `audio_config` and
    their token ids) and a tiny text model (the tower is what is measured), random weights."""
    import torch
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration, Gemma4TextConfig

    text = Gemma4TextConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                            head_dim=32, global_head_dim=32, sliding_window=8,
                            layer_types=["sliding_attention", "full_attention"],
                            hidden_size_per_layer_input=0, vocab_size_per_layer_input=0)
    config = Gemma4Config(text_config=text, **towers)
    torch.manual_seed(0)
    m = Gemma4ForConditionalGeneration(config).eval()
    for name, p in m.named_parameters():
        if p.ndim >= 2:
            p.copy_(torch.randn(p.shape) / p.shape[-1] ** 0.5)
    m.save_pretrained(out)


def proc_status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def rss_reset():
    """Resident memory now, with the peak reset to it, in bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return proc_status("VmRSS")


def rss_peak():
    """The resident peak since `rss_reset`, in bytes."""
    return proc_status("VmHWM")
