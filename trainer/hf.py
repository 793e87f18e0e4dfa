"""HF <-> maxpipe conversion for Llama models: config inference, safetensors ingest, HF export.

HF stores torch Linear weights as [out, in]; ours are [in, out] with the head axis split out
(see `trainer/model.py`). Both sides use the half-rotation RoPE layout, so q/k need no permutation.
Safetensors are read and written here one tensor at a time: numpy cannot read bfloat16 through the
`safetensors` package, and streaming keeps a single copy of the model in memory.
"""

from __future__ import annotations

import json
import math
import shutil
import struct
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import ValidationError

from configs import ModelConfig, UserError
from trainer.checkpoint import abstract_params, check_shapes, save_params
from trainer.model import param_count
from trainer.tokenizer import FILES as TOKENIZER_FILES
from trainer.tokenizer import SPECIAL_TOKENS

Log = Callable[[str], None]

# ModelConfig field -> the HF config.json key it comes from (for error messages and checks).
_HF_KEYS = {
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
}
_SUMMARY_KEYS = (
    "architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps",
    "rope_theta", "rope_parameters", "tie_word_embeddings", "bos_token_id", "eos_token_id", "dtype",
    "torch_dtype", "transformers_version",
)
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_ST_TO_NP = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}
_NP_TO_ST = {v: k for k, v in _ST_TO_NP.items()}


# ---------------------------------------------------------------------------------------- config


def read_hf_config(hf_dir: str | Path) -> dict:
    """The checkpoint's config.json as a dict."""
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise UserError(f"no HF config at {path}: expected a directory written by save_pretrained")
    hf = _read_json(path)
    if not isinstance(hf, dict):
        raise UserError(f"{path}: expected a JSON object")
    return hf


def model_config_from_hf(hf: dict, name: str = "hf") -> ModelConfig:
    """Our ModelConfig for a HF Llama config.json (float32 compute and weights)."""
    _check_supported(hf)
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if key not in hf:
            raise UserError(f"HF config lacks {key!r}")
    hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
    try:
        return ModelConfig(
            name=name,
            vocab_size=hf["vocab_size"],
            emb_dim=hidden,
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hidden // heads,
            mlp_dim=hf["intermediate_size"],
            rope_theta=_rope_theta(hf),
            # Defaults below are HF LlamaConfig's, for keys a config.json leaves out.
            norm_eps=hf.get("rms_norm_eps", 1e-6),
            tie_embeddings=hf.get("tie_word_embeddings", False),
            max_seq_len=hf.get("max_position_embeddings", 2048),
            init_std=hf.get("initializer_range", 0.02),
            dtype="float32",
            param_dtype="float32",
        )
    except ValidationError as err:
        first = err.errors()[0]
        where = f"model.{first['loc'][0]}: " if first["loc"] else ""
        msg = first["msg"].removeprefix("Value error, ")
        raise UserError(f"HF config gives an invalid model config: {where}{msg}") from None


def check_hf_config(hf: dict, cfg: ModelConfig) -> None:
    """Raise a UserError naming the first model field where `cfg` and the HF config differ."""
    theirs = model_config_from_hf(hf, cfg.name)
    for field, hf_key in _HF_KEYS.items():
        a, b = getattr(cfg, field), getattr(theirs, field)
        same = math.isclose(a, b, rel_tol=1e-9) if isinstance(a, float) else a == b
        if not same:
            raise UserError(
                f"HF checkpoint does not fit the model config: model.{field} is {a!r} "
                f"but the checkpoint's {hf_key} is {b!r}"
            )


def _check_supported(hf: dict) -> None:
    archs = hf.get("architectures") or []
    model_type = hf.get("model_type", "llama")
    if model_type != "llama" or any(a != "LlamaForCausalLM" for a in archs):
        what = ", ".join(archs) or f"model_type {model_type!r}"
        raise UserError(f"HF checkpoint is {what}; maxpipe converts Llama models only (LlamaForCausalLM)")
    if hf.get("rope_scaling"):
        raise UserError(f"HF config sets rope_scaling {hf['rope_scaling']}; maxpipe supports plain RoPE only")
    rope = hf.get("rope_parameters") or {}
    if not isinstance(rope, dict) or any(isinstance(v, dict) for v in rope.values()):
        raise UserError(f"HF config has per-layer rope_parameters {rope}; maxpipe supports one plain RoPE")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise UserError(f"HF config uses RoPE type {rope_type!r} ({rope}); maxpipe supports plain RoPE only")
    rotary = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if rotary != 1.0:
        raise UserError(f"HF config sets partial_rotary_factor {rotary}; maxpipe rotates the whole head")
    if hf.get("hidden_act", "silu") not in ("silu", "swish"):
        raise UserError(f"HF config uses hidden_act {hf['hidden_act']!r}; maxpipe's MLP is SwiGLU (silu)")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise UserError(f"HF config sets {key}: true; maxpipe's projections have no bias")


def _rope_theta(hf: dict) -> float:
    rope = hf.get("rope_parameters") or {}
    return float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))


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
        _Tensor(("layers", "mlp_norm", "scale"), layer + "post_attention_layernorm.weight", (d,), same, same),
        _Tensor(("layers", "mlp", "gate_proj", "kernel"), layer + "mlp.gate_proj.weight", (m, d), t, t),
        _Tensor(("layers", "mlp", "up_proj", "kernel"), layer + "mlp.up_proj.weight", (m, d), t, t),
        _Tensor(("layers", "mlp", "down_proj", "kernel"), layer + "mlp.down_proj.weight", (d, m), t, t),
        _Tensor(("final_norm", "scale"), "model.norm.weight", (d,), same, same),
    ]
    if not cfg.tie_embeddings:
        specs.append(_Tensor(("lm_head", "kernel"), "lm_head.weight", (v, d), t, t))
    return specs


def _hf_names(spec: _Tensor, cfg: ModelConfig) -> list[str]:
    return [spec.hf_name.format(i=i) for i in range(cfg.num_layers)] if spec.stacked else [spec.hf_name]


# ---------------------------------------------------------------------------------------- safetensors


class _SafetensorsFile:
    """Reads single tensors from a .safetensors file (header: u64 length, JSON; then raw data)."""

    def __init__(self, path: Path):
        self.path = path
        try:
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
        except (struct.error, json.JSONDecodeError, UnicodeDecodeError, MemoryError, OverflowError):
            raise UserError(f"{path}: not a safetensors file") from None
        self.data_start = 8 + n
        self.tensors: dict[str, dict] = {k: v for k, v in header.items() if k != "__metadata__"}

    def read(self, name: str) -> np.ndarray:
        info = self.tensors[name]
        if info["dtype"] not in _ST_TO_NP:
            raise UserError(f"{self.path}: tensor {name} has dtype {info['dtype']}; expected a float dtype")
        begin, end = info["data_offsets"]
        with open(self.path, "rb") as f:
            f.seek(self.data_start + begin)
            data = f.read(end - begin)
        if len(data) != end - begin:
            raise UserError(f"{self.path}: file is truncated (tensor {name})")
        return np.frombuffer(data, np.dtype(_ST_TO_NP[info["dtype"]])).reshape(info["shape"])


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


def _open_checkpoint(hf_dir: Path) -> dict[str, _SafetensorsFile]:
    """Map every tensor name in the checkpoint to the file holding it."""
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map", {})
        paths = sorted({hf_dir / f for f in weight_map.values()})
        missing = [p.name for p in paths if not p.is_file()]
        if missing:
            raise UserError(f"{index} lists {missing[0]}, which is missing from {hf_dir}")
    elif (hf_dir / "model.safetensors").is_file():
        paths = [hf_dir / "model.safetensors"]
    else:
        paths = sorted(hf_dir.glob("*.safetensors"))
    if not paths:
        pickles = sorted(p.name for p in hf_dir.iterdir() if p.suffix in _PICKLE_SUFFIXES) if hf_dir.is_dir() else []
        if pickles:
            raise UserError(
                f"{hf_dir} holds only PyTorch pickle weights ({', '.join(pickles)}); maxpipe reads safetensors only, "
                f"since unpickling can run arbitrary code: convert them to safetensors in a trusted environment"
            )
        raise UserError(f"no safetensors weights in {hf_dir}")
    files: dict[str, _SafetensorsFile] = {}
    for path in paths:
        st = _SafetensorsFile(path)
        for name in st.tensors:
            if name in files:
                raise UserError(f"tensor {name} appears in both {files[name].path.name} and {path.name}")
            files[name] = st
    return files


# ---------------------------------------------------------------------------------------- ingest


def load_hf_params(hf_dir: str | Path, cfg: ModelConfig) -> dict:
    """Read a HF Llama safetensors checkpoint into our (scanned, numpy, cfg.param_dtype) param tree."""
    hf_dir = Path(hf_dir)
    files = _open_checkpoint(hf_dir)
    dtype = np.dtype(cfg.param_dtype)
    layout = _layout(cfg)
    expected = {name for spec in layout for name in _hf_names(spec, cfg)}
    if cfg.tie_embeddings:
        expected.add("lm_head.weight")  # HF ignores it too when the embeddings are tied
    extra = sorted(n for n in files if n not in expected and not n.endswith("rotary_emb.inv_freq"))
    if extra:
        raise UserError(
            f"HF checkpoint does not fit the model config: it has tensor {extra[0]} "
            f"(and {len(extra) - 1} more) that the model has no place for"
        )

    def read(spec: _Tensor, name: str) -> np.ndarray:
        if name not in files:
            raise UserError(f"HF checkpoint lacks tensor {name} (the model expects {spec.hf_shape})")
        w = files[name].read(name)
        if tuple(w.shape) != spec.hf_shape:
            raise UserError(
                f"HF checkpoint does not fit the model config: parameter {name} is {tuple(w.shape)} "
                f"in the checkpoint but {spec.hf_shape} in the model"
            )
        return np.array(spec.to_ours(w), dtype=dtype, order="C")

    params: dict = {}
    for spec in layout:
        names = _hf_names(spec, cfg)
        value = read(spec, names[0])
        if spec.stacked:  # fill one preallocated array, layer by layer
            first, value = value, np.empty((len(names), *value.shape), dtype)
            value[0] = first
            for i, name in enumerate(names[1:], 1):
                value[i] = read(spec, name)
        node = params
        for key in spec.path[:-1]:
            node = node.setdefault(key, {})
        node[spec.path[-1]] = value
    return params


def ingest(hf_dir: str | Path, out_dir: str | Path, cfg: ModelConfig, log: Log = print) -> dict:
    """Check a HF Llama checkpoint against `cfg`, convert it and save it as param-only Orbax at out_dir/params."""
    hf = read_hf_config(hf_dir)
    check_hf_config(hf, cfg)
    hf_max = hf.get("max_position_embeddings")
    if hf_max and cfg.max_seq_len > hf_max:
        log(f"ingest: note: model.max_seq_len {cfg.max_seq_len} exceeds the checkpoint's "
            f"max_position_embeddings {hf_max}")
    log(f"ingest: converting {hf_dir} to {cfg.param_dtype}")
    params = load_hf_params(hf_dir, cfg)
    n = param_count(params)
    path = save_params(out_dir, params)
    log(f"ingest: {n:,} parameters written to {path}")
    return {
        "source": str(hf_dir),
        "parameters": n,
        "hf_config": {k: hf[k] for k in _SUMMARY_KEYS if k in hf},
        "dtype": cfg.param_dtype,
    }


# ---------------------------------------------------------------------------------------- export


def export_hf(params: Any, cfg: ModelConfig, tokenizer_dir: str | Path | None, out_dir: str | Path,
              log: Log = print) -> dict:
    """Write `params` as a HF LlamaForCausalLM directory (config, safetensors, tokenizer), replacing out_dir whole."""
    check_shapes(params, abstract_params(cfg))
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
        size = _write_safetensors(tmp / "model.safetensors", _export_entries(params, cfg), dtype)
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
    """(HF name, HF shape, fetch) per tensor; fetch copies one layer's slice to host when it is written."""
    entries = []
    for spec in _layout(cfg):
        leaf = params
        for key in spec.path:
            leaf = leaf[key]
        for i, name in enumerate(_hf_names(spec, cfg)):
            entries.append((name, spec.hf_shape, partial(_fetch, leaf, i if spec.stacked else None, spec.to_hf)))
    return entries


def _fetch(leaf: Any, layer: int | None, to_hf: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    return to_hf(np.asarray(leaf if layer is None else leaf[layer]))


def _hf_config(cfg: ModelConfig, bos: int | None, eos: int | None) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.emb_dim,
        "intermediate_size": cfg.mlp_dim,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        # transformers 5 reads rope_parameters, 4.x reads rope_theta.
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
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
