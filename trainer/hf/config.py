"""HF config.json <-> ModelConfig, for every family through its adapter: reading, checking, writing.

An adapter (classic.py's `Classic(family)` for the 2023-24 families; gpt_oss.py, gemma4.py) has: ARCHITECTURE,
MODEL_TYPE (what export writes), ARCHITECTURES, MODEL_TYPES (what ingest accepts), WRAPPER_TYPES and unwrap (a
multimodal config.json around it), FIXED (the features the family fixes), config_fields (config.json -> our
fields), hf_config (ours -> config.json), check_exportable, and for the tensors PREFIX, IGNORED, QUANTIZATIONS and
block_specs (tensors.py).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from configs import ModelConfig, UserError
from trainer.hf import classic, gemma4, gpt_oss
from trainer.hf.common import ROUTER_PLAIN
from trainer.hf.safetensors_io import CheckpointDir

ADAPTERS: dict[str, Any] = classic.ADAPTERS | {"gpt_oss": gpt_oss, "gemma4": gemma4}  # family -> its adapter
FAMILIES = {family: (adapter.ARCHITECTURE, adapter.MODEL_TYPE) for family, adapter in ADAPTERS.items()}

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
                "capacity_factor", "expert_buffer_factor")


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
    family = next((f for f, a in ADAPTERS.items() if model_type in a.MODEL_TYPES), None)
    archs = hf.get("architectures") or []
    if family is None or any(a not in ADAPTERS[family].ARCHITECTURES for a in archs):
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
    features = ADAPTERS[family].config_fields(hf) | ADAPTERS[family].FIXED
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
            expert_buffer_factor=0.0,
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
    readable = ADAPTERS[family].QUANTIZATIONS
    if method and method not in readable:
        can = f"maxpipe reads {', '.join(readable)} for {family}" if readable else f"maxpipe reads {family} unquantized"
        raise UserError(f"HF checkpoint is quantized with {method!r} (quantization_config); {can}")


def check_exportable(cfg: ModelConfig) -> None:
    """Raise a UserError when the model has a feature its model.family has no place for in HF."""
    ADAPTERS[cfg.family].check_exportable(cfg)
    for field, value in ADAPTERS[cfg.family].FIXED.items():
        if getattr(cfg, field) != value:
            raise UserError(
                f"model.family {cfg.family} fixes model.{field} to {value!r} (the config has {getattr(cfg, field)!r}); "
                f"pick the family whose HF architecture has this feature"
            )


def hf_config_from_model(cfg: ModelConfig, bos_id: int | None, eos_id: int | None) -> dict:
    """The config.json of a HF model of model.family's architecture for `cfg`, with the tokenizer's BOS and EOS ids."""
    return ADAPTERS[cfg.family].hf_config(cfg, bos_id, eos_id)
