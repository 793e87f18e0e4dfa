"""The 2023-24 families <-> maxpipe: Llama 2/3/3.1, Mistral, Qwen3, Gemma 1/2/3, Mixtral, Qwen3-MoE.

They are one decoder with switches and one checkpoint layout with a few names changed, so their adapters
(`Classic(family)`, one per family, with the attributes of the later families' adapter modules) share the
tables here: the features each fixes, config.json's keys both ways, and the tensors of a block.
HF stores torch Linear weights as [out, in]; ours are [in, out] with the head axis split out. A Mixture of
Experts' expert weights are one tensor per expert on disk; transformers 5 holds each layer's experts in memory
as one tensor (gate and up fused), which ingest also reads (TensorSpec.memory_name).
"""

from __future__ import annotations

from typing import Any

from configs import ModelConfig, UserError
from trainer.hf.common import FEATURES_OFF, ROUTER_PLAIN, hf_base, hf_rope, layer_pattern, rope_fields
from trainer.hf.tensor_spec import TensorSpec, heads_in, heads_out, same, t
from trainer.model.layers import LayerKind, layer_is_global

# model.family -> (HF architecture, HF model_type)
FAMILIES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "gemma": ("GemmaForCausalLM", "gemma"),
    "gemma2": ("Gemma2ForCausalLM", "gemma2"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
    "mixtral": ("MixtralForCausalLM", "mixtral"),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
}
_MOE_FAMILIES = ("mixtral", "qwen3_moe")  # every layer's MLP a Mixture of Experts
_PLAIN = dict(
    FEATURES_OFF,
    activation="silu", norm_plus_one=False, scale_embeddings=False, qk_norm=False, post_norms=False,
    query_pre_attn_scalar=0.0, attn_softcap=0.0, final_softcap=0.0, sliding_window=0, global_every=0,
    rope_local_theta=0.0,
)
_GEMMA = dict(_PLAIN, activation="gelu_tanh", norm_plus_one=True, scale_embeddings=True)
_MISTRAL = {k: v for k, v in _PLAIN.items() if k != "sliding_window"}
_DENSE: dict[str, dict[str, Any]] = {
    "llama": _PLAIN,
    "mistral": _MISTRAL,
    "qwen3": dict(_PLAIN, qk_norm=True),
    "gemma": _GEMMA,
    "gemma2": {k: v for k, v in dict(_GEMMA, post_norms=True).items()
               if k not in ("query_pre_attn_scalar", "attn_softcap", "final_softcap", "sliding_window", "global_every")},
    "gemma3": {k: v for k, v in dict(_GEMMA, post_norms=True, qk_norm=True).items()
               if k not in ("query_pre_attn_scalar", "attn_softcap", "final_softcap", "sliding_window", "global_every",
                            "rope_local_theta")},
}
# The model features each family fixes; the ones left out are read from (and written to) config.json.
FIXED = {family: fixed | {"num_experts": 0} for family, fixed in _DENSE.items()} | {
    "mixtral": _MISTRAL | ROUTER_PLAIN | dict(router_renormalize=True, moe_every=1),  # every layer, renormalised
    "qwen3_moe": _PLAIN | ROUTER_PLAIN | dict(qk_norm=True),
}
# A dense model's MoE fields (base.yml's defaults).
_NO_MOE = ROUTER_PLAIN | dict(num_experts=0, experts_per_token=2, expert_mlp_dim=0, router_renormalize=True,
                              load_balance_weight=0.0, capacity_factor=0.0, moe_every=1)


def config_fields(hf: dict, family: str) -> dict[str, Any]:
    """Our model fields from a config.json of one of these families (all but the sizes every family shares)."""
    _check_supported(hf, family)
    sliding_window, global_every = _layer_pattern(hf, family)
    return dict(
        query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar") or 0.0),
        attn_softcap=float(hf.get("attn_logit_softcapping") or 0.0),
        final_softcap=float(hf.get("final_logit_softcapping") or 0.0),
        sliding_window=sliding_window,
        global_every=global_every,
        rope_local_theta=0.0,
    ) | FIXED[family] | _rope_fields(hf, family) | _moe_fields(hf, family)


def _check_supported(hf: dict, family: str) -> None:
    act = hf.get("hidden_activation") or hf.get("hidden_act") or ("gelu_pytorch_tanh" if family.startswith("gemma") else "silu")
    ok = ("gelu_pytorch_tanh", "gelu_tanh", "gelu") if family.startswith("gemma") else ("silu", "swish")
    if act not in ok:  # Gemma 1 configs say "gelu" and mean the tanh approximation, as transformers does
        raise UserError(f"HF config uses activation {act!r}; maxpipe's {family} MLP is {FIXED[family]['activation']}")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise UserError(f"HF config sets {key}: true; maxpipe's projections have no bias")
    if family in ("qwen3", "qwen3_moe") and hf.get("use_sliding_window"):
        raise UserError(f"HF {family} config sets use_sliding_window: true; maxpipe supports it with full attention only")
    shared = next((k for k, v in hf.items() if "shared_expert" in k and v), None)
    if shared:
        raise UserError(f"HF config sets {shared}: {hf[shared]!r}; maxpipe's Mixtures of Experts have no shared expert")
    if hf.get("mlp_only_layers"):
        raise UserError(
            f"HF config has mlp_only_layers {hf['mlp_only_layers']}; maxpipe's MoE layers are every "
            f"decoder_sparse_step-th layer, with no others made dense"
        )
    if hf.get("use_bidirectional_attention"):
        raise UserError("HF config sets use_bidirectional_attention; maxpipe's decoder is causal")


def _layer_pattern(hf: dict, family: str) -> tuple[int, int]:
    """(sliding_window, global_every) from a config's sliding_window and layer types."""
    window = hf.get("sliding_window") or 0
    if family not in ("mistral", "mixtral", "gemma2", "gemma3") or not window:
        return 0, 0
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is None:
        every = {"mistral": 0, "mixtral": 0, "gemma2": 2}.get(family, hf.get("sliding_window_pattern", 6))
        types = ["full_attention" if every and (i + 1) % every == 0 else "sliding_attention" for i in range(n)]
    return layer_pattern(types, n, window)


def _rope_fields(hf: dict, family: str) -> dict:
    """RoPE base, scaling and (Gemma 3) local base from rope_parameters (transformers 5) or rope_theta/rope_scaling."""
    params = hf.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise UserError(f"HF config has rope_parameters {params!r}; expected a JSON object")
    fields: dict[str, Any] = {}
    if family == "gemma3":
        glob = params.get("full_attention") or {"rope_theta": hf.get("rope_theta", 1e6), **(hf.get("rope_scaling") or {})}
        local = params.get("sliding_attention") or {"rope_theta": hf.get("rope_local_base_freq", 1e4)}
        if local.get("rope_type", "default") != "default":
            raise UserError(f"HF config scales local RoPE ({local}); maxpipe supports plain RoPE on local layers")
        fields["rope_local_theta"] = float(local.get("rope_theta", 1e4))
    else:
        if any(isinstance(v, dict) for v in params.values()):
            raise UserError(f"HF config has per-layer rope_parameters {params}; maxpipe supports one RoPE for {family}")
        default = 1e6 if family == "mixtral" else 10000.0  # transformers' default base
        glob = {"rope_theta": hf.get("rope_theta", default), **(hf.get("rope_scaling") or {}), **params}
    rotary = glob.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if rotary != 1.0:
        raise UserError(f"HF config sets partial_rotary_factor {rotary}; maxpipe rotates the whole head")
    return fields | rope_fields(glob, ("default", "linear", "llama3"))


def _moe_fields(hf: dict, family: str) -> dict:
    """The Mixture-of-Experts fields (dense families: none); keys left out take transformers' defaults."""
    if family not in _MOE_FAMILIES:
        return _NO_MOE
    mixtral = family == "mixtral"
    # transformers 5 writes num_local_experts for both; Qwen3-MoE files of 4.x say num_experts.
    experts = hf.get("num_local_experts", hf.get("num_experts", 8 if mixtral else 128))
    if not experts:
        raise UserError(f"HF {family} config has num_local_experts {experts!r}; expected a Mixture of Experts")
    return dict(
        num_experts=experts,
        experts_per_token=hf.get("num_experts_per_tok", 2 if mixtral else 8),
        expert_mlp_dim=0 if mixtral else hf.get("moe_intermediate_size", 768),  # Mixtral's experts: intermediate_size
        router_renormalize=mixtral or bool(hf.get("norm_topk_prob", False)),
        load_balance_weight=float(hf.get("router_aux_loss_coef", 0.001)),
        capacity_factor=0.0,
        moe_every=1 if mixtral else hf.get("decoder_sparse_step", 1),
    )


def check_exportable(cfg: ModelConfig) -> None:
    """Raise a UserError for an MoE setting the family's HF architecture has no place for."""
    if cfg.family in _MOE_FAMILIES and not cfg.moe:
        raise UserError(f"model.family {cfg.family} is a Mixture of Experts but model.num_experts is 0")
    if cfg.family == "mixtral" and cfg.expert_width != cfg.mlp_dim:
        raise UserError(
            f"model.family mixtral has experts model.mlp_dim wide (HF intermediate_size), but model.expert_mlp_dim is "
            f"{cfg.expert_mlp_dim}: set it to 0"
        )


def hf_config(cfg: ModelConfig, bos_id: int | None, eos_id: int | None) -> dict:
    """The config.json of model.family's HF architecture for `cfg`."""
    config = hf_base(cfg, *FAMILIES[cfg.family], bos_id, eos_id)
    # transformers 5 reads rope_parameters, 4.x reads rope_theta and rope_scaling.
    rope = hf_rope(cfg)
    config["rope_theta"] = cfg.rope_theta
    if rope["rope_type"] != "default":
        config["rope_scaling"] = rope
    config["rope_parameters"] = rope
    if cfg.family == "gemma3":
        local = {"rope_type": "default", "rope_theta": cfg.rope_local_theta or cfg.rope_theta}
        config["rope_parameters"] = {"full_attention": rope, "sliding_attention": local}
        config["rope_local_base_freq"] = local["rope_theta"]
    if cfg.family in ("gemma2", "gemma3"):
        config["hidden_activation"] = config["hidden_act"]
        scalar = cfg.query_pre_attn_scalar or cfg.head_dim
        config["query_pre_attn_scalar"] = int(scalar) if float(scalar).is_integer() else scalar  # HF checks the type
        config["attn_logit_softcapping"] = cfg.attn_softcap or None
        config["final_logit_softcapping"] = cfg.final_softcap or None
    if cfg.family in ("mistral", "mixtral", "gemma2", "gemma3"):
        config["sliding_window"] = cfg.sliding_window or None
    if cfg.family in ("gemma2", "gemma3"):
        # HF needs a window even with every layer global; it is then unused.
        config["sliding_window"] = cfg.sliding_window or cfg.max_seq_len
        config["layer_types"] = ["full_attention" if g else "sliding_attention" for g in layer_is_global(cfg)]
    if cfg.family in ("qwen3", "qwen3_moe"):
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.num_layers)
    if cfg.moe:
        config.update(num_experts_per_tok=cfg.experts_per_token, router_aux_loss_coef=cfg.load_balance_weight,
                      output_router_logits=False)
    if cfg.family == "mixtral":
        config.update(num_local_experts=cfg.num_experts, router_jitter_noise=0.0)
    if cfg.family == "qwen3_moe":
        config.update(num_experts=cfg.num_experts, moe_intermediate_size=cfg.expert_width,
                      norm_topk_prob=cfg.router_renormalize, decoder_sparse_step=cfg.moe_every, mlp_only_layers=[])
    return config


def block_specs(cfg: ModelConfig, kind: LayerKind) -> list[TensorSpec]:
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


class Classic:
    """One 2023-24 family's adapter: the tables above, for `family` (the attributes of an adapter module)."""

    PREFIX = "model."  # where the checkpoint holds the language model
    IGNORED: tuple[str, ...] = ()  # tensor name prefixes of a checkpoint that are not the language model
    QUANTIZATIONS: tuple[str, ...] = ()  # quantization_config.quant_method values ingest reads
    WRAPPER_TYPES: tuple[str, ...] = ()  # model_types of a multimodal config.json wrapping this family's

    def __init__(self, family: str) -> None:
        self.family = family
        self.ARCHITECTURE, self.MODEL_TYPE = FAMILIES[family]
        self.ARCHITECTURES, self.MODEL_TYPES = (self.ARCHITECTURE,), (self.MODEL_TYPE,)
        self.FIXED = FIXED[family]

    def unwrap(self, hf: dict) -> dict:
        return hf

    def config_fields(self, hf: dict) -> dict[str, Any]:
        return config_fields(hf, self.family)

    def hf_config(self, cfg: ModelConfig, bos_id: int | None, eos_id: int | None) -> dict:
        return hf_config(cfg, bos_id, eos_id)

    def check_exportable(self, cfg: ModelConfig) -> None:
        check_exportable(cfg)

    def block_specs(self, cfg: ModelConfig, kind: LayerKind) -> list[TensorSpec]:
        return block_specs(cfg, kind)


ADAPTERS = {family: Classic(family) for family in FAMILIES}
