"""HF config.json <-> ModelConfig: reading, checking, writing, for every family.

The 2023-24 families (Llama, Mistral, Qwen3, Gemma 1/2/3, Mixtral, Qwen3-MoE: one decoder with switches) are
tables here; each later family has an adapter module of its own (gpt_oss.py, gemma4.py) with the same three
parts: FIXED (the features it fixes), config_fields (config.json -> our fields) and hf_config (ours -> config.json).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from configs import ModelConfig, UserError
from trainer.hf import gemma4, gpt_oss
from trainer.hf.common import FEATURES_OFF, ROUTER_PLAIN, hf_base, hf_rope, layer_pattern, rope_fields
from trainer.hf.safetensors_io import CheckpointDir
from trainer.model.layers import layer_is_global

ADAPTERS = {"gpt_oss": gpt_oss, "gemma4": gemma4}  # family -> its adapter module

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
} | {family: (adapter.ARCHITECTURE, adapter.MODEL_TYPE) for family, adapter in ADAPTERS.items()}
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
_FIXED = {family: fixed | {"num_experts": 0} for family, fixed in _DENSE.items()} | {
    "mixtral": _MISTRAL | ROUTER_PLAIN | dict(router_renormalize=True, moe_every=1),  # every layer, renormalised
    "qwen3_moe": _PLAIN | ROUTER_PLAIN | dict(qk_norm=True),
} | {family: adapter.FIXED for family, adapter in ADAPTERS.items()}
# A dense model's MoE fields (base.yml's defaults).
_NO_MOE = ROUTER_PLAIN | dict(num_experts=0, experts_per_token=2, expert_mlp_dim=0, router_renormalize=True,
               load_balance_weight=0.0, capacity_factor=0.0, moe_every=1)
_MOE_ONLY = ("experts_per_token", "expert_mlp_dim", "router_renormalize", "moe_every", *ROUTER_PLAIN)  # dense ignores
# ModelConfig field -> the HF config.json key it comes from (for error messages).
_HF_KEYS = {
    "family": "model_type",
    "vocab_size": "vocab_size",
    "emb_dim": "hidden_size",
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "mlp_dim": "intermediate_size",
    "rope_theta": "rope_theta",
    "norm_eps": "rms_norm_eps",
    "tie_embeddings": "tie_word_embeddings",
    "sliding_window": "sliding_window",
    "query_pre_attn_scalar": "query_pre_attn_scalar",
    "attn_softcap": "attn_logit_softcapping",
    "final_softcap": "final_logit_softcapping",
    "num_experts": "num_local_experts / num_experts",
    "experts_per_token": "num_experts_per_tok",
    "expert_mlp_dim": "moe_intermediate_size",
    "router_renormalize": "norm_topk_prob",
    "moe_every": "decoder_sparse_step",
}
# Fields that do not change what the weights compute, so a checkpoint need not match them.
_FREE_FIELDS = ("name", "max_seq_len", "init_std", "dtype", "param_dtype", "attention", "load_balance_weight",
                "capacity_factor")


def read_hf_config(hf_dir: str | Path) -> dict:
    """The checkpoint's config.json as a dict; `hf_dir` is a directory or any fsspec URL (gs://...)."""
    src = CheckpointDir(hf_dir)
    if not src.isfile("config.json"):
        raise UserError(f"no HF config at {src.show('config.json')}: expected a directory written by save_pretrained")
    hf = src.read_json("config.json")
    if not isinstance(hf, dict):
        raise UserError(f"{src.show('config.json')}: expected a JSON object")
    return hf


def hf_family(hf: dict) -> str:
    """Our model.family for a HF config.json, from its model_type and architectures."""
    hf = text_config(hf)
    model_type = hf.get("model_type", "llama")
    family = next((f for f, (_, mt) in FAMILIES.items() if mt == model_type), None)
    family = family or next((f for f, a in ADAPTERS.items() if model_type in a.MODEL_TYPES), None)
    archs = hf.get("architectures") or []
    known = ADAPTERS[family].ARCHITECTURES if family in ADAPTERS else (FAMILIES[family][0],) if family else ()
    if family is None or any(a not in known for a in archs):
        what = ", ".join(archs) or f"model_type {model_type!r}"
        known = ", ".join(arch for arch, _ in FAMILIES.values())
        raise UserError(f"HF checkpoint is {what}; maxpipe converts {known}")
    return family


def text_config(hf: dict) -> dict:
    """The language model's config of a HF config.json: a multimodal wrapper's text_config (Gemma 4), else itself."""
    family = next((f for f, a in ADAPTERS.items() if hf.get("model_type") in a.WRAPPER_TYPES), None)
    return ADAPTERS[family].unwrap(hf) if family else hf


def model_config_from_hf(hf: dict, name: str = "hf") -> ModelConfig:
    """Our ModelConfig for a HF config.json of a supported family (float32 compute and weights)."""
    family = hf_family(hf)
    _check_quantization(hf, family)
    hf = text_config(hf)
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if key not in hf:
            raise UserError(f"HF config lacks {key!r}")
    hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
    if family in ADAPTERS:
        features = ADAPTERS[family].config_fields(hf) | _FIXED[family]
    else:
        _check_supported(hf, family)
        sliding_window, global_every = _layer_pattern(hf, family)
        features = dict(
            query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar") or 0.0),
            attn_softcap=float(hf.get("attn_logit_softcapping") or 0.0),
            final_softcap=float(hf.get("final_logit_softcapping") or 0.0),
            sliding_window=sliding_window,
            global_every=global_every,
            rope_local_theta=0.0,
        ) | _FIXED[family] | _rope_fields(hf, family) | _moe_fields(hf, family)
    gemma = family.startswith("gemma")
    try:
        return ModelConfig(
            name=name,
            family=family,
            vocab_size=hf["vocab_size"],
            emb_dim=hidden,
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hidden // heads,
            mlp_dim=hf["intermediate_size"],
            # Defaults below are HF's own, for keys a config.json leaves out.
            norm_eps=hf.get("rms_norm_eps", 1e-6),
            tie_embeddings=hf.get("tie_word_embeddings", gemma or family == "qwen3"),
            max_seq_len=hf.get("max_position_embeddings", 2048),
            init_std=hf.get("initializer_range", 0.02),
            dtype="float32",
            param_dtype="float32",
            attention="auto",
            **features,
        )
    except ValidationError as err:
        first = err.errors()[0]
        where = f"model.{first['loc'][0]}: " if first["loc"] else ""
        msg = first["msg"].removeprefix("Value error, ")
        raise UserError(f"HF config gives an invalid model config: {where}{msg}") from None


def check_hf_config(hf: dict, cfg: ModelConfig) -> None:
    """Raise a UserError naming the first model field where `cfg` and the HF config differ."""
    theirs = model_config_from_hf(hf, cfg.name)
    for field in ModelConfig.model_fields:
        if field in _FREE_FIELDS or (field in _MOE_ONLY and not cfg.moe and not theirs.moe):
            continue
        attr = "expert_width" if field == "expert_mlp_dim" else field  # an expert_mlp_dim of 0 means mlp_dim
        a, b = getattr(cfg, attr), getattr(theirs, attr)
        same = math.isclose(a, b, rel_tol=1e-9) if isinstance(a, float) else a == b
        if not same:
            where = f"the checkpoint's {_HF_KEYS[field]}" if field in _HF_KEYS else "the checkpoint"
            raise UserError(f"HF checkpoint does not fit the model config: model.{field} is {a!r} but {where} gives {b!r}")


def _check_quantization(hf: dict, family: str) -> None:
    """Refuse a quantized checkpoint whose format ingest cannot dequantize."""
    method = (hf.get("quantization_config") or {}).get("quant_method")
    readable = ADAPTERS[family].QUANTIZATIONS if family in ADAPTERS else ()
    if method and method not in readable:
        can = f"maxpipe reads {', '.join(readable)} for {family}" if readable else f"maxpipe reads {family} unquantized"
        raise UserError(f"HF checkpoint is quantized with {method!r} (quantization_config); {can}")


def _check_supported(hf: dict, family: str) -> None:
    act = hf.get("hidden_activation") or hf.get("hidden_act") or ("gelu_pytorch_tanh" if family.startswith("gemma") else "silu")
    ok = ("gelu_pytorch_tanh", "gelu_tanh", "gelu") if family.startswith("gemma") else ("silu", "swish")
    if act not in ok:  # Gemma 1 configs say "gelu" and mean the tanh approximation, as transformers does
        raise UserError(f"HF config uses activation {act!r}; maxpipe's {family} MLP is {_FIXED[family]['activation']}")
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
    """Raise a UserError when the model has a feature its model.family has no place for in HF."""
    if cfg.family in _MOE_FAMILIES and not cfg.moe:
        raise UserError(f"model.family {cfg.family} is a Mixture of Experts but model.num_experts is 0")
    if cfg.family == "mixtral" and cfg.expert_width != cfg.mlp_dim:
        raise UserError(
            f"model.family mixtral has experts model.mlp_dim wide (HF intermediate_size), but model.expert_mlp_dim is "
            f"{cfg.expert_mlp_dim}: set it to 0"
        )
    if cfg.family in ADAPTERS:
        ADAPTERS[cfg.family].check_exportable(cfg)
    for field, value in _FIXED[cfg.family].items():
        if getattr(cfg, field) != value:
            raise UserError(
                f"model.family {cfg.family} fixes model.{field} to {value!r} (the config has {getattr(cfg, field)!r}); "
                f"pick the family whose HF architecture has this feature"
            )


def hf_config_from_model(cfg: ModelConfig, bos_id: int | None, eos_id: int | None) -> dict:
    """The config.json of a HF model of model.family's architecture for `cfg`, with the tokenizer's BOS and EOS ids."""
    if cfg.family in ADAPTERS:
        return ADAPTERS[cfg.family].hf_config(cfg, bos_id, eos_id)
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
