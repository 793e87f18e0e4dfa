"""Small real inputs for the tests: a corpus of standard-library modules, a tiny HF Llama with a tokenizer."""

from __future__ import annotations

import json
import shutil
import sysconfig
from pathlib import Path
from typing import Any


def small_corpus(dest: Path, limit_bytes: int = 400_000) -> Path:
    """Copies of real standard-library modules (in a fixed order) up to about `limit_bytes`."""
    dest.mkdir(parents=True)
    total = 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        if total > limit_bytes:
            break
        shutil.copy(path, dest / path.name)
        total += path.stat().st_size
    return dest


def tiny_hf_llama(dest: Path, corpus: Path, mlp_dim: int = 128, seed: int = 0) -> Path:
    """A random LlamaForCausalLM shaped like configs/models/tiny.yml, saved with a BPE tokenizer trained on `corpus`."""
    import tokenizers
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=mlp_dim, max_position_embeddings=512, rope_theta=10000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=None, eos_token_id=0,
    )
    transformers.LlamaForCausalLM(config).to(torch.float32).save_pretrained(dest)
    return tiny_tokenizer(dest, corpus)


def tiny_tokenizer(dest: Path, corpus: Path) -> Path:
    """A byte-level BPE tokenizer of 512 ids trained on `corpus`, saved into the HF checkpoint directory `dest`."""
    import tokenizers

    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=512, special_tokens=["<|endoftext|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train([str(p) for p in sorted(corpus.glob("*.py"))], trainer)
    tok.save(str(dest / "tokenizer.json"))
    (dest / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return dest


def prepare(cfg: Any, vocab_size: int, out: Any, **kwargs: Any) -> dict:
    """`data_prep.prepare` with the config's own beam_args, as the prep step passes them."""
    import data_prep

    return data_prep.prepare(cfg, vocab_size, out, beam_args=cfg.beam_args, **kwargs)
