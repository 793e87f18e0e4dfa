"""HF <-> maxpipe conversion for Llama, Mistral, Qwen3 and Gemma 1/2/3: config mapping, safetensors ingest, HF export.

HF stores torch Linear weights as [out, in]; ours are [in, out] with the head axis split out
(see `trainer/model.py`). Both sides use the half-rotation RoPE layout, so q/k need no permutation.
Safetensors are read and written here one tensor at a time: the `safetensors` package's numpy API
cannot return bfloat16 (and its torch API needs torch, a test-only dependency), nor read part of a
gs:// file. Each tensor is read through fsspec (the source may be any URL) straight into its slot of
the stacked output, or through a small block buffer when it is transposed or cast; ingest converts a
layer (or a block of vocabulary rows) at a time, two at once, and writes each as soon as it is
converted, so it holds four such parts at a time.
PyTorch pickles are read only with allow_pickle=True, and only from a local directory.
"""

from __future__ import annotations

import json
import math
import mmap
import shutil
import struct
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import ValidationError

from configs import ModelConfig, UserError
from trainer.checkpoint import LazyParam, ReadOnce, abstract_params, check_shapes, save_lazy_params, split
from trainer.model import layer_is_global, param_count
from trainer.tokenizer import FILES as TOKENIZER_FILES
from trainer.tokenizer import SPECIAL_TOKENS

Log = Callable[[str], None]

# model.family -> (HF architecture, HF model_type)
FAMILIES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "gemma": ("GemmaForCausalLM", "gemma"),
    "gemma2": ("Gemma2ForCausalLM", "gemma2"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
}
_PLAIN = dict(
    activation="silu", norm_plus_one=False, scale_embeddings=False, qk_norm=False, post_norms=False,
    query_pre_attn_scalar=0.0, attn_softcap=0.0, final_softcap=0.0, sliding_window=0, global_every=0,
    rope_local_theta=0.0,
)
_GEMMA = dict(_PLAIN, activation="gelu_tanh", norm_plus_one=True, scale_embeddings=True)
# The model features each family fixes; the ones left out are read from (and written to) config.json.
_FIXED: dict[str, dict[str, Any]] = {
    "llama": _PLAIN,
    "mistral": {k: v for k, v in _PLAIN.items() if k != "sliding_window"},
    "qwen3": dict(_PLAIN, qk_norm=True),
    "gemma": _GEMMA,
    "gemma2": {k: v for k, v in dict(_GEMMA, post_norms=True).items()
               if k not in ("query_pre_attn_scalar", "attn_softcap", "final_softcap", "sliding_window", "global_every")},
    "gemma3": {k: v for k, v in dict(_GEMMA, post_norms=True, qk_norm=True).items()
               if k not in ("query_pre_attn_scalar", "attn_softcap", "final_softcap", "sliding_window", "global_every",
                            "rope_local_theta")},
}
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
}
# Fields that do not change what the weights compute, so a checkpoint need not match them.
_FREE_FIELDS = ("name", "max_seq_len", "init_std", "dtype", "param_dtype", "attention")
_SUMMARY_KEYS = (
    "architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps",
    "rope_theta", "rope_parameters", "rope_scaling", "sliding_window", "layer_types", "tie_word_embeddings",
    "bos_token_id", "eos_token_id", "dtype", "torch_dtype", "transformers_version",
)
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_ST_TO_NP = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}
_NP_TO_ST = {v: k for k, v in _ST_TO_NP.items()}
_ROPE_DEFAULTS = dict(rope_scaling="none", rope_factor=1.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                      rope_original_max_len=8192)


# ---------------------------------------------------------------------------------------- config


def read_hf_config(hf_dir: str | Path) -> dict:
    """The checkpoint's config.json as a dict; `hf_dir` is a directory or any fsspec URL (gs://...)."""
    src = _Source(hf_dir)
    if not src.isfile("config.json"):
        raise UserError(f"no HF config at {src.show('config.json')}: expected a directory written by save_pretrained")
    hf = src.read_json("config.json")
    if not isinstance(hf, dict):
        raise UserError(f"{src.show('config.json')}: expected a JSON object")
    return hf


def hf_family(hf: dict) -> str:
    """Our model.family for a HF config.json, from its model_type and architectures."""
    model_type = hf.get("model_type", "llama")
    family = next((f for f, (_, mt) in FAMILIES.items() if mt == model_type), None)
    archs = hf.get("architectures") or []
    if family is None or any(a != FAMILIES[family][0] for a in archs):
        what = ", ".join(archs) or f"model_type {model_type!r}"
        known = ", ".join(arch for arch, _ in FAMILIES.values())
        raise UserError(f"HF checkpoint is {what}; maxpipe converts {known}")
    return family


def model_config_from_hf(hf: dict, name: str = "hf") -> ModelConfig:
    """Our ModelConfig for a HF config.json of a supported family (float32 compute and weights)."""
    family = hf_family(hf)
    _check_supported(hf, family)
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if key not in hf:
            raise UserError(f"HF config lacks {key!r}")
    hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
    sliding_window, global_every = _layer_pattern(hf, family)
    gemma = family.startswith("gemma")
    features = dict(
        query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar") or 0.0),
        attn_softcap=float(hf.get("attn_logit_softcapping") or 0.0),
        final_softcap=float(hf.get("final_logit_softcapping") or 0.0),
        sliding_window=sliding_window,
        global_every=global_every,
        rope_local_theta=0.0,
    ) | _FIXED[family] | _rope_fields(hf, family)
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
        if field in _FREE_FIELDS:
            continue
        a, b = getattr(cfg, field), getattr(theirs, field)
        same = math.isclose(a, b, rel_tol=1e-9) if isinstance(a, float) else a == b
        if not same:
            where = f"the checkpoint's {_HF_KEYS[field]}" if field in _HF_KEYS else "the checkpoint"
            raise UserError(f"HF checkpoint does not fit the model config: model.{field} is {a!r} but {where} gives {b!r}")


def _check_supported(hf: dict, family: str) -> None:
    act = hf.get("hidden_activation") or hf.get("hidden_act") or ("gelu_pytorch_tanh" if family.startswith("gemma") else "silu")
    ok = ("gelu_pytorch_tanh", "gelu_tanh", "gelu") if family.startswith("gemma") else ("silu", "swish")
    if act not in ok:  # Gemma 1 configs say "gelu" and mean the tanh approximation, as transformers does
        raise UserError(f"HF config uses activation {act!r}; maxpipe's {family} MLP is {_FIXED[family]['activation']}")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise UserError(f"HF config sets {key}: true; maxpipe's projections have no bias")
    if family == "qwen3" and hf.get("use_sliding_window"):
        raise UserError("HF Qwen3 config sets use_sliding_window: true; maxpipe supports Qwen3 with full attention only")
    if hf.get("use_bidirectional_attention"):
        raise UserError("HF config sets use_bidirectional_attention; maxpipe's decoder is causal")


def _layer_pattern(hf: dict, family: str) -> tuple[int, int]:
    """(sliding_window, global_every) from a config's sliding_window and layer types."""
    window = hf.get("sliding_window") or 0
    if family not in ("mistral", "gemma2", "gemma3") or not window:
        return 0, 0
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is None:
        every = {"mistral": 0, "gemma2": 2}.get(family, hf.get("sliding_window_pattern", 6))
        types = ["full_attention" if every and (i + 1) % every == 0 else "sliding_attention" for i in range(n)]
    is_global = [t == "full_attention" for t in types]
    if all(is_global):
        return 0, 0
    every = is_global.index(True) + 1 if any(is_global) else 0
    if is_global != [bool(every) and (i + 1) % every == 0 for i in range(n)] or len(types) != n:
        raise UserError(f"HF config has layer_types {types}; maxpipe supports every Nth layer global, the rest sliding")
    return window, every


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
        glob = {"rope_theta": hf.get("rope_theta", 10000.0), **(hf.get("rope_scaling") or {}), **params}
    rope_type = glob.get("rope_type", glob.get("type", "default"))
    rotary = glob.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if rotary != 1.0:
        raise UserError(f"HF config sets partial_rotary_factor {rotary}; maxpipe rotates the whole head")
    fields["rope_theta"] = float(glob.get("rope_theta", 10000.0))
    if rope_type == "default":
        return fields | _ROPE_DEFAULTS
    if rope_type == "linear":
        return fields | _ROPE_DEFAULTS | {"rope_scaling": "linear", "rope_factor": float(glob["factor"])}
    if rope_type == "llama3":
        return fields | {
            "rope_scaling": "llama3", "rope_factor": float(glob["factor"]),
            "rope_low_freq_factor": float(glob["low_freq_factor"]),
            "rope_high_freq_factor": float(glob["high_freq_factor"]),
            "rope_original_max_len": int(glob["original_max_position_embeddings"]),
        }
    raise UserError(f"HF config uses RoPE type {rope_type!r} ({glob}); maxpipe supports default, linear and llama3")


def check_exportable(cfg: ModelConfig) -> None:
    """Raise a UserError when the model has a feature its model.family has no place for in HF."""
    for field, value in _FIXED[cfg.family].items():
        if getattr(cfg, field) != value:
            raise UserError(
                f"model.family {cfg.family} fixes model.{field} to {value!r} (the config has {getattr(cfg, field)!r}); "
                f"pick the family whose HF architecture has this feature"
            )


# ---------------------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class _Tensor:
    """One parameter: where it lives in our tree and in the HF checkpoint, and how to convert it."""

    path: tuple[str, ...]  # our param path; under "layers" it is stacked over a leading layer axis
    hf_name: str  # "{i}" stands for the layer index
    hf_shape: tuple[int, ...]
    to_ours: Callable[[np.ndarray], np.ndarray]
    to_hf: Callable[[np.ndarray], np.ndarray]

    @property
    def stacked(self) -> bool:
        return self.path[0] == "layers"


def _layout(cfg: ModelConfig) -> list[_Tensor]:
    """Every parameter of the model, in the order the HF export writes them."""
    d, v, m, hd = cfg.emb_dim, cfg.vocab_size, cfg.mlp_dim, cfg.head_dim
    same = lambda w: w  # noqa: E731
    t = lambda w: w.T  # noqa: E731

    def heads_in(n: int) -> tuple[Callable, Callable]:  # [n*hd, d] <-> [d, n, hd]
        return lambda w: w.T.reshape(d, n, hd), lambda k: k.reshape(d, n * hd).T

    heads_out = (  # [d, h*hd] <-> [h, hd, d]
        lambda w: w.T.reshape(cfg.num_heads, hd, d),
        lambda k: k.reshape(cfg.num_heads * hd, d).T,
    )
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    layer = "model.layers.{i}."
    specs = [
        _Tensor(("embed", "embedding"), "model.embed_tokens.weight", (v, d), same, same),
        _Tensor(("layers", "attn_norm", "scale"), layer + "input_layernorm.weight", (d,), same, same),
        _Tensor(("layers", "attn", "q_proj", "kernel"), layer + "self_attn.q_proj.weight", (q, d),
                *heads_in(cfg.num_heads)),
        _Tensor(("layers", "attn", "k_proj", "kernel"), layer + "self_attn.k_proj.weight", (kv, d),
                *heads_in(cfg.num_kv_heads)),
        _Tensor(("layers", "attn", "v_proj", "kernel"), layer + "self_attn.v_proj.weight", (kv, d),
                *heads_in(cfg.num_kv_heads)),
        _Tensor(("layers", "attn", "o_proj", "kernel"), layer + "self_attn.o_proj.weight", (d, q), *heads_out),
    ]
    if cfg.qk_norm:
        specs += [
            _Tensor(("layers", "attn", "q_norm", "scale"), layer + "self_attn.q_norm.weight", (hd,), same, same),
            _Tensor(("layers", "attn", "k_norm", "scale"), layer + "self_attn.k_norm.weight", (hd,), same, same),
        ]
    if cfg.post_norms:  # Gemma 2/3 name the norm after attention post_attention_layernorm, unlike Llama
        specs += [
            _Tensor(("layers", "attn_post_norm", "scale"), layer + "post_attention_layernorm.weight", (d,), same, same),
            _Tensor(("layers", "mlp_norm", "scale"), layer + "pre_feedforward_layernorm.weight", (d,), same, same),
            _Tensor(("layers", "mlp_post_norm", "scale"), layer + "post_feedforward_layernorm.weight", (d,), same, same),
        ]
    else:
        specs.append(_Tensor(("layers", "mlp_norm", "scale"), layer + "post_attention_layernorm.weight", (d,), same, same))
    specs += [
        _Tensor(("layers", "mlp", "gate_proj", "kernel"), layer + "mlp.gate_proj.weight", (m, d), t, t),
        _Tensor(("layers", "mlp", "up_proj", "kernel"), layer + "mlp.up_proj.weight", (m, d), t, t),
        _Tensor(("layers", "mlp", "down_proj", "kernel"), layer + "mlp.down_proj.weight", (d, m), t, t),
        _Tensor(("final_norm", "scale"), "model.norm.weight", (d,), same, same),
    ]
    if not cfg.tie_embeddings:
        specs.append(_Tensor(("lm_head", "kernel"), "lm_head.weight", (v, d), t, t))
    return specs


def _as_bits(x: np.ndarray) -> np.ndarray:
    """The same memory viewed as unsigned ints of the item size."""
    return x.view(np.dtype(f"u{x.dtype.itemsize}"))


def _is_transpose(spec: _Tensor) -> bool:
    """Whether to_ours is w.T reshaped (else it is w reshaped: the same bytes in the same order)."""
    probe = np.empty(spec.hf_shape, np.uint8)
    return len(spec.hf_shape) == 2 and not spec.to_ours(probe).flags.c_contiguous


def _ours_shape(spec: _Tensor) -> tuple[int, ...]:
    return spec.to_ours(np.empty(spec.hf_shape, np.uint8)).shape


def _stacked_shape(spec: _Tensor, cfg: ModelConfig) -> tuple[int, ...]:
    """Our parameter's shape: with a leading layer axis when scanned."""
    return (cfg.num_layers, *_ours_shape(spec)) if spec.stacked else _ours_shape(spec)


def _hf_names(spec: _Tensor, cfg: ModelConfig) -> list[str]:
    return [spec.hf_name.format(i=i) for i in range(cfg.num_layers)] if spec.stacked else [spec.hf_name]


# ---------------------------------------------------------------------------------------- safetensors


class _Source:
    """A checkpoint directory: a local path or any fsspec URL (gs://, memory://, ...), read through fsspec."""

    def __init__(self, hf_dir: str | Path):
        import fsspec
        from fsspec.implementations.local import LocalFileSystem

        self.given = str(hf_dir)
        self.fs, self.root = fsspec.core.url_to_fs(self.given)
        self.local = isinstance(self.fs, LocalFileSystem)

    def path(self, name: str) -> str:
        return f"{self.root.rstrip('/')}/{name}"

    def show(self, name: str = "") -> str:
        """How to name a file in messages: as the user gave the directory."""
        return f"{self.given.rstrip('/')}/{name}" if name else self.given

    def isfile(self, name: str) -> bool:
        return self.fs.isfile(self.path(name))

    def glob(self, pattern: str) -> list[str]:
        return [p.rsplit("/", 1)[-1] for p in self.fs.glob(self.path(pattern))]

    def read_json(self, name: str) -> Any:
        try:
            return json.loads(self.fs.cat_file(self.path(name)))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise UserError(f"{self.show(name)}: not valid JSON ({err})") from None


_BLOCK_BYTES = 8 << 20  # how much of a tensor is read at once when it must be converted on the way
_SPLIT_BYTES = 1 << 20  # a stacked parameter whose layers are this big is converted and written layer by layer


class _SafetensorsFile:
    """Reads tensors, or blocks of their rows, from a .safetensors file (header: u64 length, JSON; then raw data).

    A tensor kept as it is is read straight into its place in the output. One that is transposed or cast
    goes a block of rows at a time: a memory map of just those rows for a local file (no copy before the
    transpose, and RSS holds one block of the input), a ranged read into a reused buffer for a URL.
    """

    def __init__(self, src: _Source, name: str):
        self.name, self.shown, self.local = name, src.show(name), src.local
        self.file = src.fs.open(src.path(name), "rb")
        try:
            (n,) = struct.unpack("<Q", self.file.read(8))
            header = json.loads(self.file.read(n))
        except (struct.error, json.JSONDecodeError, UnicodeDecodeError, MemoryError, OverflowError, ValueError):
            raise UserError(f"{self.shown}: not a safetensors file") from None
        self.data_start = 8 + n
        self.size = src.fs.size(src.path(name))
        self.lock = threading.Lock()  # one seek and read at a time: parts are converted in parallel
        self.tensors: dict[str, dict] = {k: v for k, v in header.items() if k != "__metadata__"}

    def dtype(self, name: str) -> np.dtype:
        info = self.tensors[name]
        if info["dtype"] not in _ST_TO_NP:
            raise UserError(f"{self.shown}: tensor {name} has dtype {info['dtype']}; expected a float dtype")
        return np.dtype(_ST_TO_NP[info["dtype"]])

    def _offset(self, name: str, row: int) -> int:
        """Where row `row` of the tensor starts in the file (checking the tensor lies within it)."""
        info = self.tensors[name]
        begin, end = info["data_offsets"]
        itemsize = self.dtype(name).itemsize
        if (end - begin) != math.prod(info["shape"]) * itemsize or self.data_start + end > self.size:
            raise UserError(f"{self.shown}: file is truncated or corrupt (tensor {name})")
        return self.data_start + begin + row * math.prod(info["shape"][1:]) * itemsize

    def rows(self, name: str, start: int, out: np.ndarray) -> np.ndarray:
        """Rows start.. of the tensor as `out`'s shape: a map of the file when local, else read into `out`."""
        if not self.local:
            self.read_into(name, out, start)
            return out
        offset = self._offset(name, start)
        aligned = offset - offset % mmap.ALLOCATIONGRANULARITY
        mapped = mmap.mmap(self.file.fileno(), offset - aligned + out.nbytes, offset=aligned, access=mmap.ACCESS_READ)
        return np.frombuffer(mapped, out.dtype, out.size, offset=offset - aligned).reshape(out.shape)

    def read_into(self, name: str, out: np.ndarray, start: int = 0) -> None:
        """Fill `out` (contiguous, the tensor's dtype) with the tensor's bytes from row `start` on."""
        if not out.flags.c_contiguous:
            raise ValueError("read_into needs a contiguous output")
        offset = self._offset(name, start)
        view = memoryview(_as_bits(out).reshape(-1)).cast("B")
        got = 0
        with self.lock:
            self.file.seek(offset)
            while got < len(view):  # a raw or remote read may return fewer bytes than asked
                n = self.file.readinto(view[got:])
                if not n:
                    raise UserError(f"{self.shown}: file is truncated or corrupt (tensor {name})")
                got += n


class _PickleFile:
    """Tensors of a PyTorch state-dict file, read with torch's restricted (weights_only) unpickler, memory-mapped."""

    def __init__(self, src: _Source, name: str):
        try:
            import torch
        except ImportError:
            raise UserError(f"{src.show(name)}: reading PyTorch pickle weights needs torch installed") from None
        self.name, self.shown = name, src.show(name)
        if not src.local:
            raise UserError(f"{self.shown}: PyTorch pickle weights are read from a local directory only")
        try:
            state = torch.load(src.path(name), map_location="cpu", weights_only=True, mmap=True)
        except Exception as err:  # noqa: BLE001 - torch raises many kinds for a bad or unsafe file
            why = f"{type(err).__name__}: {err}"
            raise UserError(f"{self.shown}: cannot read as a PyTorch state dict ({why})") from None
        self._state = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
        self.tensors = {k: {"shape": list(v.shape)} for k, v in self._state.items()}

    def _array(self, name: str) -> np.ndarray:
        import torch

        t = self._state[name]
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(np.dtype("bfloat16"))
        if not t.dtype.is_floating_point:
            raise UserError(f"{self.shown}: tensor {name} has dtype {t.dtype}; expected a float dtype")
        return t.numpy()

    def dtype(self, name: str) -> np.dtype:
        return self._array(name).dtype

    def rows(self, name: str, start: int, out: np.ndarray) -> np.ndarray:
        return self._array(name)[start : start + len(out)].reshape(out.shape)

    def read_into(self, name: str, out: np.ndarray, start: int = 0) -> None:
        np.copyto(out, self.rows(name, start, out))


def _write_safetensors(path: Path, entries: list[tuple[str, tuple[int, ...], Callable[[], np.ndarray]]],
                       dtype: np.dtype) -> int:
    """Write tensors (name, shape, fetch) one at a time; returns the data size in bytes."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, _ in entries:
        size = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": _NP_TO_ST[dtype.name], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # keep the data 8-byte aligned, as the safetensors library does
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, shape, fetch in entries:
            x = np.ascontiguousarray(fetch(), dtype=dtype)
            assert x.shape == shape, (name, x.shape, shape)
            x.tofile(f)
    return offset


def _open_checkpoint(src: _Source, allow_pickle: bool = False) -> dict[str, _SafetensorsFile | _PickleFile]:
    """Map every tensor name in the checkpoint to the file holding it (safetensors; pickles only when allowed)."""
    names = _weight_files(src, "model.safetensors", ("*.safetensors",))
    reader: type[_SafetensorsFile | _PickleFile] = _SafetensorsFile
    if not names:
        pickles = _weight_files(src, "pytorch_model.bin", tuple(f"*{s}" for s in _PICKLE_SUFFIXES))
        if pickles and not allow_pickle:
            raise UserError(
                f"{src.show()} holds only PyTorch pickle weights ({', '.join(pickles)}); maxpipe reads "
                f"safetensors only, since unpickling can run arbitrary code: convert them to safetensors in a trusted "
                f"environment, or set pipeline.hf_allow_pickle=true for a checkpoint you trust"
            )
        if not pickles:
            raise UserError(f"no safetensors weights in {src.show()}")
        names, reader = pickles, _PickleFile
    files: dict[str, _SafetensorsFile | _PickleFile] = {}
    for name in names:
        st = reader(src, name)
        for tensor in st.tensors:
            if tensor in files:
                raise UserError(f"tensor {tensor} appears in both {files[tensor].name} and {name}")
            files[tensor] = st
    return files


def _weight_files(src: _Source, single: str, patterns: tuple[str, ...]) -> list[str]:
    """The files of a sharded checkpoint's `{single}.index.json`, else `single`, else every file matching patterns."""
    index = f"{single}.index.json"
    if src.isfile(index):
        names = sorted(set(src.read_json(index).get("weight_map", {}).values()))
        missing = [n for n in names if not src.isfile(n)]
        if missing:
            raise UserError(f"{src.show(index)} lists {missing[0]}, which is missing from {src.show()}")
        return names
    if src.isfile(single):
        return [single]
    return sorted({n for pattern in patterns for n in src.glob(pattern)})


# ---------------------------------------------------------------------------------------- ingest


def load_hf_params(hf_dir: str | Path, cfg: ModelConfig, allow_pickle: bool = False) -> dict:
    """Read a HF safetensors checkpoint into our (scanned, numpy, cfg.param_dtype) param tree."""
    params: dict = {}
    for spec, value in _converted_params(hf_dir, cfg, allow_pickle):
        _put(params, spec.path, value)
    return params


def _converted_params(hf_dir: str | Path, cfg: ModelConfig, allow_pickle: bool) -> Iterator[tuple[_Tensor, np.ndarray]]:
    """Each parameter of the layout in turn, converted (stacked over layers where scanned); checks names and shapes."""
    fill = _converter(hf_dir, cfg, allow_pickle)
    for spec in _layout(cfg):
        value = np.empty(_stacked_shape(spec, cfg), np.dtype(cfg.param_dtype))
        fill(spec, value)
        yield spec, value


def _converter(hf_dir: str | Path, cfg: ModelConfig, allow_pickle: bool) -> Callable[..., None]:
    """Check the checkpoint's tensor names and shapes; return fill(spec, out, k=0, parts=1), converting one parameter."""
    files = _open_checkpoint(_Source(hf_dir), allow_pickle)
    dtype = np.dtype(cfg.param_dtype)
    expected = {name for spec in _layout(cfg) for name in _hf_names(spec, cfg)}
    if cfg.tie_embeddings:
        expected.add("lm_head.weight")  # HF ignores it too when the embeddings are tied
    extra = sorted(n for n in files if n not in expected and not n.endswith("rotary_emb.inv_freq"))
    if extra:
        raise UserError(
            f"HF checkpoint does not fit the model config: it has tensor {extra[0]} "
            f"(and {len(extra) - 1} more) that the model has no place for"
        )
    # Every name and shape is checked here, before anything is written.
    for spec in _layout(cfg):
        for name in _hf_names(spec, cfg):
            if name not in files:
                raise UserError(f"HF checkpoint lacks tensor {name} (the model expects {spec.hf_shape})")
            shape = tuple(files[name].tensors[name]["shape"])
            if shape != spec.hf_shape:
                raise UserError(
                    f"HF checkpoint does not fit the model config: parameter {name} is {shape} "
                    f"in the checkpoint but {spec.hf_shape} in the model"
                )
    local = threading.local()  # a read buffer per thread: parts are converted in parallel

    def copy(spec: _Tensor, name: str, out: np.ndarray, first: int = 0, count: int | None = None) -> None:
        """out[...] = to_ours(rows first.. first+count of the tensor, default all), reading them once."""
        file, transpose = files[name], _is_transpose(spec)
        src_dtype = file.dtype(name)
        count = (spec.hf_shape[0] if spec.hf_shape else 1) - first if count is None else count
        width = math.prod(spec.hf_shape[1:])  # elements in one row of the tensor
        rows_out = out.reshape((width, count) if transpose else (count, width))
        if src_dtype == dtype and not transpose:
            file.read_into(name, rows_out, first)  # the same bytes in the same order: straight into place
            return
        rows = max(1, min(count, _BLOCK_BYTES // max(1, width * src_dtype.itemsize)))
        scratch = getattr(local, "scratch", None)
        if scratch is None or scratch.nbytes < rows * width * src_dtype.itemsize:
            scratch = local.scratch = np.empty(rows * width * src_dtype.itemsize, np.uint8)
        for start in range(0, count, rows):
            n = min(rows, count - start)
            buffer = scratch[: n * width * src_dtype.itemsize].view(src_dtype).reshape(n, width)
            block = file.rows(name, first + start, buffer)
            if not transpose:
                rows_out[start : start + n] = block
                continue
            # A transpose copied 128 rows at a time is ~3x faster than numpy's strided copy of the whole
            # (32 or 64 rows win in isolation but lose here, reading from the mapped file); copying as
            # unsigned ints when the dtype stays is several times faster again for bfloat16.
            same = src_dtype == dtype
            dst, src = (_as_bits(rows_out), _as_bits(block)) if same else (rows_out, block)
            for i in range(0, n, 128):
                j = min(i + 128, n)
                dst[:, start + i : start + j] = src[i:j].T

    def fill(spec: _Tensor, out: np.ndarray, k: int = 0, parts: int = 1) -> None:
        """Convert part k of `parts` of the parameter into `out`: all of it, layer k, or block k of the tensor's rows."""
        names = _hf_names(spec, cfg)
        if parts == 1:
            for i, name in enumerate(names):
                copy(spec, name, out[i] if spec.stacked else out)
        elif spec.stacked:
            copy(spec, names[k], out[0])
        else:
            n = spec.hf_shape[0] // parts
            copy(spec, names[0], out, k * n, n)

    return fill


def _put(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


class _Progress:
    """Logs every tenth of `total` bytes converted, with the rate so far."""

    def __init__(self, total: int, log: Log) -> None:
        self.total, self.log, self.done, self.start = total, log, 0, time.perf_counter()
        self.lock = threading.Lock()

    def add(self, nbytes: int) -> None:
        with self.lock:
            tenth = self.done * 10 // max(1, self.total)
            self.done += nbytes
            done = self.done
        if done * 10 // max(1, self.total) > tenth and done < self.total:
            mib = done / 2**20
            self.log(f"ingest: {done / self.total:.0%} converted ({mib:,.1f} MiB, {mib / self.seconds():,.0f} MiB/s)")

    def seconds(self) -> float:
        return time.perf_counter() - self.start


def _lazy_param(spec: _Tensor, cfg: ModelConfig, fill: Callable[..., None], part_bytes: int) -> LazyParam:
    """The parameter as parts converted and written one by one: its layers, or blocks of the tensor's rows."""
    shape, dtype = _stacked_shape(spec, cfg), np.dtype(cfg.param_dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    if spec.stacked:  # layer by layer, unless the layers are tiny (norm scales)
        axis, parts = 0, (cfg.num_layers if nbytes // cfg.num_layers >= _SPLIT_BYTES else 1)
    else:  # the embedding and output head: blocks of vocabulary rows (our columns when transposed)
        parts = split(spec.hf_shape[0] if spec.hf_shape else 1, nbytes, part_bytes)
        axis = len(shape) - 1 if _is_transpose(spec) else 0
    return LazyParam(shape, dtype, partial(fill, spec, parts=parts), axis, parts)


def ingest(hf_dir: str | Path, out_dir: str | Path, cfg: ModelConfig, log: Log = print, allow_pickle: bool = False) -> dict:
    """Check a HF checkpoint against `cfg`, convert it and save it as param-only Orbax at out_dir/params."""
    hf = read_hf_config(hf_dir)
    check_hf_config(hf, cfg)
    hf_max = hf.get("max_position_embeddings")
    if hf_max and cfg.max_seq_len > hf_max:
        log(f"ingest: note: model.max_seq_len {cfg.max_seq_len} exceeds the checkpoint's "
            f"max_position_embeddings {hf_max}")
    specs = _layout(cfg)
    n = sum(math.prod(_stacked_shape(s, cfg)) for s in specs)
    size = n * np.dtype(cfg.param_dtype).itemsize
    log(f"ingest: converting {hf_dir} to {cfg.param_dtype} ({n:,} parameters, {size / 2**20:,.1f} MiB)")
    convert, progress = _converter(hf_dir, cfg, allow_pickle), _Progress(size, log)

    def fill(spec: _Tensor, out: np.ndarray, k: int = 0, parts: int = 1) -> None:
        convert(spec, out, k, parts)
        progress.add(out.nbytes)

    tree: dict = {}
    # Parts are converted while the last ones are written: memory holds four, so the embedding and output
    # head go in blocks of at most a 32nd of the model (and 256 MiB), about a layer's weight.
    for spec in specs:
        _put(tree, spec.path, _lazy_param(spec, cfg, fill, part_bytes=min(size // 32, 1 << 28)))
    path = save_lazy_params(out_dir, tree)
    log(f"ingest: {n:,} parameters written to {path} in {progress.seconds():.1f}s")
    return {
        "source": str(hf_dir),
        "family": cfg.family,
        "parameters": n,
        "hf_config": {k: hf[k] for k in _SUMMARY_KEYS if k in hf},
        "dtype": cfg.param_dtype,
    }


# ---------------------------------------------------------------------------------------- export


def _write_shards(out: Path, entries: list[tuple[str, tuple[int, ...], Callable[[], np.ndarray]]], dtype: np.dtype,
                  max_shard_bytes: int) -> int:
    """`model.safetensors`, or HF's `model-0000i-of-0000n.safetensors` + index when over `max_shard_bytes`."""
    shards: list[list] = [[]]
    filled = 0
    for entry in entries:
        size = math.prod(entry[1]) * dtype.itemsize
        if shards[-1] and filled + size > max_shard_bytes:
            shards.append([])
            filled = 0
        shards[-1].append(entry)
        filled += size
    if len(shards) == 1:
        return _write_safetensors(out / "model.safetensors", entries, dtype)
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    total = sum(_write_safetensors(out / name, shard, dtype) for name, shard in zip(names, shards))
    weight_map = {entry[0]: name for name, shard in zip(names, shards) for entry in shard}
    _write_json(out / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})
    return total


def export_hf(params: Any, cfg: ModelConfig, tokenizer_dir: str | Path | None, out_dir: str | Path,
              log: Log = print, dtype: str = "", max_shard_bytes: int = 5_000_000_000) -> dict:
    """Write `params` as a HF directory of model.family's architecture (config, safetensors, tokenizer), replacing out_dir whole.

    Weights are written in `dtype` ("" = cfg.param_dtype), split into shards of at most `max_shard_bytes`
    with a `model.safetensors.index.json` when they do not fit in one file.
    """
    check_exportable(cfg)
    check_shapes(params, abstract_params(cfg))
    cfg = cfg.model_copy(update={"param_dtype": dtype}) if dtype else cfg
    out = Path(out_dir).absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private
    try:
        special = _export_tokenizer(Path(tokenizer_dir), tmp, cfg) if tokenizer_dir else {}
        dtype = np.dtype(cfg.param_dtype)
        bos, eos = special.get("bos_id"), special.get("eos_id")
        _write_json(tmp / "config.json", _hf_config(cfg, bos, eos))
        _write_json(tmp / "generation_config.json", {
            "_from_model_config": True, "bos_token_id": bos, "eos_token_id": eos, "pad_token_id": eos,
        })
        size = _write_shards(tmp, _export_entries(params, cfg), dtype, max_shard_bytes)
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    n = param_count(params)
    log(f"export: {n:,} parameters ({cfg.param_dtype}, {size / 2**20:.1f} MiB) "
        f"{'and the tokenizer ' if special else ''}written to {out}")
    return {
        "parameters": n, "dtype": cfg.param_dtype, "bytes": size,
        "tokenizer": special.get("kind"), "files": sorted(p.name for p in out.iterdir()),
    }


def _export_entries(params: Any, cfg: ModelConfig) -> list[tuple[str, tuple[int, ...], Callable[[], np.ndarray]]]:
    """(HF name, HF shape, fetch) per tensor, in the order they are written; one parameter is on host at a time."""
    entries = []
    for spec in _layout(cfg):
        leaf = params
        for key in spec.path:
            leaf = leaf[key]
        names = _hf_names(spec, cfg)
        once = ReadOnce(leaf, len(names))
        for i, name in enumerate(names):
            entries.append((name, spec.hf_shape, partial(_fetch, once, i if spec.stacked else None, spec.to_hf)))
    return entries


def _fetch(once: ReadOnce, layer: int | None, to_hf: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    return to_hf(once.read(layer))


def _hf_config(cfg: ModelConfig, bos: int | None, eos: int | None) -> dict:
    arch, model_type = FAMILIES[cfg.family]
    config: dict[str, Any] = {
        "architectures": [arch],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.emb_dim,
        "intermediate_size": cfg.mlp_dim,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu" if cfg.activation == "silu" else "gelu_pytorch_tanh",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": cfg.init_std,
        "use_cache": True,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": None,
        # transformers 5 reads dtype, 4.x reads torch_dtype.
        "dtype": cfg.param_dtype,
        "torch_dtype": cfg.param_dtype,
    }
    # transformers 5 reads rope_parameters, 4.x reads rope_theta and rope_scaling.
    rope = _hf_rope(cfg)
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
    if cfg.family in ("mistral", "gemma2", "gemma3"):
        config["sliding_window"] = cfg.sliding_window or None
    if cfg.family in ("gemma2", "gemma3"):
        # HF needs a window even with every layer global; it is then unused.
        config["sliding_window"] = cfg.sliding_window or cfg.max_seq_len
        config["layer_types"] = ["full_attention" if g else "sliding_attention" for g in layer_is_global(cfg)]
    if cfg.family == "qwen3":
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.num_layers)
    return config


def _hf_rope(cfg: ModelConfig) -> dict:
    rope: dict[str, Any] = {"rope_type": "default" if cfg.rope_scaling == "none" else cfg.rope_scaling,
                            "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling != "none":
        rope["factor"] = cfg.rope_factor
    if cfg.rope_scaling == "llama3":
        rope.update(low_freq_factor=cfg.rope_low_freq_factor, high_freq_factor=cfg.rope_high_freq_factor,
                    original_max_position_embeddings=cfg.rope_original_max_len)
    return rope


def _export_tokenizer(tokenizer_dir: Path, dest: Path, cfg: ModelConfig) -> dict:
    """Copy the prep step's tokenizer into `dest` with a tokenizer_config.json; returns special_tokens.json."""
    src = tokenizer_dir / "tokenizer" if (tokenizer_dir / "tokenizer").is_dir() else tokenizer_dir
    special_path = src / SPECIAL_TOKENS
    if not special_path.is_file():
        raise UserError(f"no {SPECIAL_TOKENS} in {src}: expected the tokenizer directory written by prep")
    special = _read_json(special_path)
    kind = special.get("kind")
    if kind not in TOKENIZER_FILES:
        raise UserError(f"{special_path}: unknown tokenizer kind {kind!r} (expected {sorted(TOKENIZER_FILES)})")
    if not (src / TOKENIZER_FILES[kind]).is_file():
        raise UserError(f"no {TOKENIZER_FILES[kind]} in {src}")
    if special.get("vocab_size", 0) > cfg.vocab_size:
        raise UserError(
            f"tokenizer in {src} has {special['vocab_size']} tokens but model.vocab_size is {cfg.vocab_size}"
        )
    tok_config: dict[str, Any] = {
        "model_max_length": cfg.max_seq_len,
        "eos_token": special.get("eos_token"),
        "clean_up_tokenization_spaces": False,
    }
    if special.get("bos_token") is not None:
        tok_config["bos_token"] = special["bos_token"]
    file = TOKENIZER_FILES[kind]
    if kind == "hf":
        tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
        if special.get("bos_id") is not None and special.get("prepend_bos"):
            _copy_adding_bos(src / file, dest / file, special["bos_token"])
        else:
            shutil.copy2(src / file, dest / file)
    else:
        shutil.copy2(src / file, dest / file)
        tok_config.update(
            tokenizer_class="LlamaTokenizer", add_bos_token=special.get("bos_id") is not None, add_eos_token=False,
        )
    _write_json(dest / "tokenizer_config.json", tok_config)
    return special


def _copy_adding_bos(src: Path, dest: Path, bos: str) -> None:
    """Copy a tokenizer.json whose encode() lacks the BOS that prep prepends, making it add BOS.

    transformers ignores add_bos_token when a tokenizer.json is present: only its post-processor counts.
    """
    from tokenizers import Tokenizer, processors

    tok = Tokenizer.from_file(str(src))
    template = processors.TemplateProcessing(
        single=[bos, "$A"], pair=[bos, "$A", bos, "$B:1"], special_tokens=[(bos, tok.token_to_id(bos))],
    )
    tok.post_processor = processors.Sequence([tok.post_processor, template]) if tok.post_processor else template
    tok.save(str(dest))


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UserError(f"{path}: not valid JSON ({err})") from None


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def _replace_dir(new: Path, out: Path) -> None:
    """Move a finished directory into place, replacing whatever was at `out`."""
    if not out.exists():
        new.rename(out)
        return
    old = out.with_name(f".{out.name}.old-{uuid.uuid4().hex[:8]}")
    out.rename(old)
    new.rename(out)
    shutil.rmtree(old, ignore_errors=True)
