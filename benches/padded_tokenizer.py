"""The benchmark models' tokenizer: a fixture model's, padded with unused special tokens to the
model's vocabulary so that every id a random model emits decodes (real gemma and GLM
vocabularies are large too)."""
import os
import shutil

from tokenizers import AddedToken, Tokenizer


def write_padded_tokenizer(fixture, out, vocab_size):
    """Writes fixture's tokenizer, padded to vocab_size, and its tokenizer and generation
    configs into out."""
    for f in ("tokenizer_config.json", "generation_config.json"):
        shutil.copy(os.path.join(fixture, f), os.path.join(out, f))
    tok = Tokenizer.from_file(os.path.join(fixture, "tokenizer.json"))
    pad = [AddedToken(f"<unused{i}>", special=True) for i in range(vocab_size - tok.get_vocab_size())]
    tok.add_special_tokens(pad)
    assert tok.get_vocab_size() == vocab_size
    tok.save(os.path.join(out, "tokenizer.json"))
