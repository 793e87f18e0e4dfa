"""Every parameter's place in a HF checkpoint: the decoder's layout (embedding, blocks, final norm, output head),
each block's tensors from the family's adapter (hf/config.py ADAPTERS).

Both sides pair RoPE dimensions by halves (rotate_half), so q/k need no permutation.
"""

from __future__ import annotations

from dataclasses import replace

from configs import ModelConfig
from trainer.hf.config import ADAPTERS
from trainer.hf.tensor_spec import TensorSpec, same, t
from trainer.model.layers import unit_kinds


def tensor_specs(cfg: ModelConfig) -> list[TensorSpec]:
    """Every parameter of the model, in the order the HF export writes them."""
    d, v = cfg.emb_dim, cfg.vocab_size
    adapter = ADAPTERS[cfg.family]
    blocks, prefix = adapter.block_specs, adapter.PREFIX
    specs = [TensorSpec(("embed", "embedding"), prefix + "embed_tokens.weight", (v, d), same, same)]
    kinds = unit_kinds(cfg)
    if len(kinds) == 1:
        specs += blocks(cfg, kinds[0])
    else:  # blocks j, j + n, ... of a unit of n stacked under layers/block_{j} (see trainer/model/layers.py)
        for j, kind in enumerate(kinds):
            layers = tuple(range(j, cfg.num_layers, len(kinds)))
            specs += [replace(spec, path=("layers", f"block_{j}", *spec.path[1:]), layers=layers)
                      for spec in blocks(cfg, kind)]
    specs.append(TensorSpec(("final_norm", "scale"), prefix + "norm.weight", (d,), same, same))
    if not cfg.tie_embeddings:
        specs.append(TensorSpec(("lm_head", "kernel"), "lm_head.weight", (v, d), t, t))
    return specs
