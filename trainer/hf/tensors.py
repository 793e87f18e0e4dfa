"""Every parameter's place in a HF checkpoint, per family: the decoder's layout (embedding, blocks, norm, head)
and the 2023-24 families' blocks; a later family's blocks come from its adapter (gpt_oss.py, gemma4.py).

Both sides pair RoPE dimensions by halves (rotate_half), so q/k need no permutation. A Mixture of Experts'
expert weights are stacked over [layers, experts] here and one tensor per expert on disk; transformers 5 holds
each layer's experts in memory as one tensor (gate and up fused), which ingest also reads.
"""

from __future__ import annotations

from dataclasses import replace

from configs import ModelConfig
from trainer.hf.config import ADAPTERS
from trainer.hf.tensor_spec import TensorSpec, heads_in, heads_out, same, t
from trainer.model.layers import LayerKind, unit_kinds


def tensor_specs(cfg: ModelConfig) -> list[TensorSpec]:
    """Every parameter of the model, in the order the HF export writes them."""
    d, v = cfg.emb_dim, cfg.vocab_size
    adapter = ADAPTERS.get(cfg.family)
    blocks, prefix = (adapter.block_specs, adapter.PREFIX) if adapter else (_block_specs, "model.")
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


def _block_specs(cfg: ModelConfig, kind: LayerKind) -> list[TensorSpec]:
    """One transformer block's parameters (stacked under `layers`), with an MoE MLP when kind.sparse."""
    d, m, hd = cfg.emb_dim, cfg.mlp_dim, cfg.head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    layer = "model.layers.{i}."
    specs = [
        TensorSpec(("layers", "attn_norm", "scale"), layer + "input_layernorm.weight", (d,), same, same),
        TensorSpec(("layers", "attn", "q_proj", "kernel"), layer + "self_attn.q_proj.weight", (q, d),
                *heads_in(d, cfg.num_heads, hd)),
        TensorSpec(("layers", "attn", "k_proj", "kernel"), layer + "self_attn.k_proj.weight", (kv, d),
                *heads_in(d, cfg.num_kv_heads, hd)),
        TensorSpec(("layers", "attn", "v_proj", "kernel"), layer + "self_attn.v_proj.weight", (kv, d),
                *heads_in(d, cfg.num_kv_heads, hd)),
        TensorSpec(("layers", "attn", "o_proj", "kernel"), layer + "self_attn.o_proj.weight", (d, q),
                *heads_out(d, cfg.num_heads, hd)),
    ]
    if cfg.qk_norm:
        specs += [
            TensorSpec(("layers", "attn", "q_norm", "scale"), layer + "self_attn.q_norm.weight", (hd,), same, same),
            TensorSpec(("layers", "attn", "k_norm", "scale"), layer + "self_attn.k_norm.weight", (hd,), same, same),
        ]
    if cfg.post_norms:  # Gemma 2/3 name the norm after attention post_attention_layernorm, unlike Llama
        specs += [
            TensorSpec(("layers", "attn_post_norm", "scale"), layer + "post_attention_layernorm.weight", (d,), same, same),
            TensorSpec(("layers", "mlp_norm", "scale"), layer + "pre_feedforward_layernorm.weight", (d,), same, same),
            TensorSpec(("layers", "mlp_post_norm", "scale"), layer + "post_feedforward_layernorm.weight", (d,), same, same),
        ]
    else:
        specs.append(TensorSpec(("layers", "mlp_norm", "scale"), layer + "post_attention_layernorm.weight", (d,), same, same))
    return specs + (_moe_specs(cfg, layer) if kind.sparse else [
        TensorSpec(("layers", "mlp", "gate_proj", "kernel"), layer + "mlp.gate_proj.weight", (m, d), t, t),
        TensorSpec(("layers", "mlp", "up_proj", "kernel"), layer + "mlp.up_proj.weight", (m, d), t, t),
        TensorSpec(("layers", "mlp", "down_proj", "kernel"), layer + "mlp.down_proj.weight", (d, m), t, t),
    ])


def _moe_specs(cfg: ModelConfig, layer: str) -> list[TensorSpec]:
    """The router and experts: Mixtral's block_sparse_moe (renamed mlp in memory) or Qwen3-MoE's mlp on disk."""
    d, f, n = cfg.emb_dim, cfg.expert_width, cfg.num_experts
    on_disk, in_memory = layer + ("block_sparse_moe." if cfg.family == "mixtral" else "mlp."), layer + "mlp."
    gate, up, down = ("w1", "w3", "w2") if cfg.family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    expert = on_disk + "experts.{e}."
    return [
        TensorSpec(("layers", "moe", "router", "kernel"), on_disk + "gate.weight", (n, d), t, t,
                   memory_name=in_memory + "gate.weight"),
        TensorSpec(("layers", "moe", "gate_proj"), expert + gate + ".weight", (f, d), t, t,
                   memory_name=in_memory + "experts.gate_up_proj", fused=(0, 2)),
        TensorSpec(("layers", "moe", "up_proj"), expert + up + ".weight", (f, d), t, t,
                   memory_name=in_memory + "experts.gate_up_proj", fused=(1, 2)),
        TensorSpec(("layers", "moe", "down_proj"), expert + down + ".weight", (d, f), t, t,
                   memory_name=in_memory + "experts.down_proj"),
    ]
