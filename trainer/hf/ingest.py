"""HF checkpoint -> our param-only Orbax checkpoint (ingest), or -> an in-memory param tree (load_hf_params).

Each tensor is read through fsspec (the source may be any URL) straight into its slot of the stacked
output, or through a small block buffer when it is transposed or cast; ingest converts a layer (with all
its experts in a Mixture of Experts) or a block of vocabulary rows at a time, two at once, and writes each
as soon as it is converted, so it holds four such parts at a time. A layer's tensor of all experts (GPT-OSS,
Gemma 4) is read whole and converted in memory, dequantized first when the hub stores it in MXFP4.
A multimodal hub file's language model (Gemma 4: `model.language_model.`) is read under that prefix or under
transformers' text model's `model.`.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from configs import ModelConfig, UserError
from trainer.hf import mxfp4
from trainer.hf.config import ADAPTERS, check_hf_config, read_hf_config, text_config
from trainer.hf.tensor_spec import TensorSpec, hf_names, in_memory, is_transposed, stacked_layers, stacked_shape
from trainer.hf.tensors import tensor_specs
from trainer.params.writer import LazyParam, save_lazy_params, split
from trainer.hf.safetensors_io import CheckpointDir, as_bits, open_checkpoint

Log = Callable[[str], None]

_SUMMARY_KEYS = (  # the HF config.json keys ingest reports
    "architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps",
    "rope_theta", "rope_parameters", "rope_scaling", "sliding_window", "layer_types", "tie_word_embeddings",
    "num_local_experts", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
    "router_aux_loss_coef", "bos_token_id", "eos_token_id", "dtype", "torch_dtype", "transformers_version",
    "quantization_config", "global_head_dim", "num_global_key_value_heads", "attention_k_eq_v", "enable_moe_block",
    "top_k_experts", "final_logit_softcapping", "swiglu_limit",
)
_BLOCK_BYTES = 8 << 20  # how much of a tensor is read at once when it must be converted on the way
_SPLIT_BYTES = 1 << 20  # a stacked parameter whose layers are this big is converted and written layer by layer


def load_hf_params(hf_dir: str | Path, cfg: ModelConfig, allow_pickle: bool = False) -> dict:
    """Read a HF safetensors checkpoint into our (scanned, numpy, cfg.param_dtype) param tree."""
    params: dict = {}
    for spec, value in _converted_params(hf_dir, cfg, allow_pickle):
        _put(params, spec.path, value)
    return params


def _converted_params(hf_dir: str | Path, cfg: ModelConfig, allow_pickle: bool) -> Iterator[tuple[TensorSpec, np.ndarray]]:
    """Each parameter in turn, converted (stacked over layers, and experts, where scanned); checks names and shapes."""
    fill = _converter(hf_dir, cfg, allow_pickle)
    for spec in tensor_specs(cfg):
        value = np.empty(stacked_shape(spec, cfg), np.dtype(cfg.param_dtype))
        fill(spec, value)
        yield spec, value


def _converter(hf_dir: str | Path, cfg: ModelConfig, allow_pickle: bool) -> Callable[..., None]:
    """Check the checkpoint's tensor names and shapes; return fill(spec, out, k=0, parts=1), converting one parameter."""
    files = open_checkpoint(CheckpointDir(hf_dir), allow_pickle)
    dtype = np.dtype(cfg.param_dtype)
    adapter = ADAPTERS.get(cfg.family)
    ignored, prefix = (adapter.IGNORED, adapter.PREFIX) if adapter else ((), "model.")

    def text_name(name: str) -> str:  # a hub name (prefix) as transformers' text-only files have it (model.)
        return "model." + name.removeprefix(prefix)

    def locate(spec: TensorSpec, index: int, name: str) -> tuple[str, tuple[int, ...], int]:
        """(The checkpoint's tensor holding HF tensor `name`, that tensor's expected shape, the first row there):
        the tensor itself or, when the checkpoint has transformers' in-memory names, the one it is part of; its
        MXFP4 blocks when quantized."""
        if name not in files and text_name(name) in files:
            name = text_name(name)
        if name not in files and spec.memory_name:
            memory = in_memory(spec, cfg, index)
            if memory[0] in files:
                return memory
        if name not in files and name + mxfp4.BLOCKS in files:
            return name + mxfp4.BLOCKS, mxfp4.blocks_shape(spec.hf_shape), 0
        return name, spec.hf_shape, 0

    where = {name: locate(spec, i, name) for spec in tensor_specs(cfg) for i, name in enumerate(hf_names(spec, cfg))}
    expected = {tensor for tensor, _, _ in where.values()}
    expected |= {t.removesuffix(mxfp4.BLOCKS) + mxfp4.SCALES for t in expected if t.endswith(mxfp4.BLOCKS)}
    if cfg.tie_embeddings:
        expected.add("lm_head.weight")  # HF ignores it too when the embeddings are tied
    extra = sorted(n for n in files if n not in expected and not n.endswith("rotary_emb.inv_freq")
                   and not n.startswith(ignored))
    if extra:
        raise UserError(
            f"HF checkpoint does not fit the model config: it has tensor {extra[0]} "
            f"(and {len(extra) - 1} more) that the model has no place for"
        )
    # Every name and shape is checked here, before anything is written.
    for spec in tensor_specs(cfg):
        for name in hf_names(spec, cfg):
            tensor, expected_shape, _ = where[name]
            if tensor not in files:
                raise UserError(f"HF checkpoint lacks tensor {name} (the model expects {spec.hf_shape})")
            shape = tuple(files[tensor].tensors[tensor]["shape"])
            if shape != expected_shape:
                raise UserError(
                    f"HF checkpoint does not fit the model config: parameter {tensor} is {shape} "
                    f"in the checkpoint but {expected_shape} in the model"
                )
            if tensor.endswith(mxfp4.BLOCKS):
                scales = tensor.removesuffix(mxfp4.BLOCKS) + mxfp4.SCALES
                if scales not in files or tuple(files[scales].tensors[scales]["shape"]) != expected_shape[:-1]:
                    raise UserError(f"HF checkpoint has MXFP4 {tensor} {expected_shape} without {scales} "
                                    f"{expected_shape[:-1]}")
    local = threading.local()  # a read buffer per thread: parts are converted in parallel

    def read(tensor: str, packed: bool = False) -> np.ndarray:
        file = files[tensor]
        out = np.empty(file.tensors[tensor]["shape"], file.dtype(tensor, packed=True) if packed else file.dtype(tensor))
        file.read_into(tensor, out.reshape(out.shape[0] if out.ndim else 1, -1))
        return out

    def whole(spec: TensorSpec, name: str) -> np.ndarray:
        """spec.to_ours of HF tensor `name` read whole; when it is stored as MXFP4, only the output rows the
        parameter takes are dequantized (GPT-OSS's gate and up each take half of their fused tensor)."""
        tensor, _, _ = where[name]
        if not tensor.endswith(mxfp4.BLOCKS):
            return spec.to_ours(read(tensor))
        blocks, scales = read(tensor, packed=True), read(tensor.removesuffix(mxfp4.BLOCKS) + mxfp4.SCALES, packed=True)
        rows = _output_columns(spec)
        if rows is None:
            return spec.to_ours(mxfp4.dequantize(blocks, scales, dtype).swapaxes(-1, -2))
        if len(rows) < spec.hf_shape[-1]:
            blocks, scales = blocks[..., rows, :, :], scales[..., rows, :]
        return mxfp4.dequantize(blocks, scales, dtype).swapaxes(-1, -2)

    def copy(spec: TensorSpec, name: str, out: np.ndarray, first: int = 0, count: int | None = None) -> None:
        """out[...] = to_ours(rows first.. first+count of the tensor, default all), reading them once."""
        count = (spec.hf_shape[0] if spec.hf_shape else 1) - first if count is None else count
        tensor, _, offset = where[name]  # a row is hf_shape[1:] (of a fused tensor too)
        first += offset
        file, transpose = files[tensor], is_transposed(spec)
        src_dtype = file.dtype(tensor)
        width = math.prod(spec.hf_shape[1:])  # elements in one row of the tensor
        rows_out = out.reshape((width, count) if transpose else (count, width))
        if src_dtype == dtype and not transpose:
            file.read_into(tensor, rows_out, first)  # the same bytes in the same order: straight into place
            return
        rows = max(1, min(count, _BLOCK_BYTES // max(1, width * src_dtype.itemsize)))
        scratch = getattr(local, "scratch", None)
        if scratch is None or scratch.nbytes < rows * width * src_dtype.itemsize:
            scratch = local.scratch = np.empty(rows * width * src_dtype.itemsize, np.uint8)
        for start in range(0, count, rows):
            n = min(rows, count - start)
            buffer = scratch[: n * width * src_dtype.itemsize].view(src_dtype).reshape(n, width)
            block = file.rows(tensor, first + start, buffer)
            if not transpose:
                rows_out[start : start + n] = block
                continue
            # A transpose copied 128 rows at a time is ~3x faster than numpy's strided copy of the whole
            # (32 or 64 rows win in isolation but lose here, reading from the mapped file); copying as
            # unsigned ints when the dtype stays is several times faster again for bfloat16.
            same = src_dtype == dtype
            dst, src = (as_bits(rows_out), as_bits(block)) if same else (rows_out, block)
            for i in range(0, n, 128):
                j = min(i + 128, n)
                dst[:, start + i : start + j] = src[i:j].T

    def fill(spec: TensorSpec, out: np.ndarray, k: int = 0, parts: int = 1) -> None:
        """Convert part k of `parts` of the parameter into `out`: all of it, layer k, or block k of the tensor's rows."""
        names = hf_names(spec, cfg)
        if spec.whole:  # the layer's tensor of all experts: read it whole, convert in memory
            layers = range(len(names)) if parts == 1 else [k]
            for j, layer in enumerate(layers):
                out[j] = whole(spec, names[layer])
            return
        if not spec.stacked:
            n = spec.hf_shape[0] // parts
            copy(spec, names[0], out, k * n, n)
            return
        per_layer = cfg.num_experts if spec.experts else 1
        for j, layer in enumerate(range(len(stacked_layers(spec, cfg))) if parts == 1 else [k]):
            for e in range(per_layer):
                copy(spec, names[layer * per_layer + e], out[j, e] if spec.experts else out[j])

    return fill


def _output_columns(spec: TensorSpec) -> np.ndarray | None:
    """The columns of the HF tensor's last (output) axis that spec.to_ours keeps, in order, when it only selects
    such columns; else None. Found by applying it to a probe of one row."""
    probe = np.arange(spec.hf_shape[-1]).reshape((1,) * (len(spec.hf_shape) - 1) + (-1,))
    kept = spec.to_ours(probe)
    return kept.reshape(-1) if kept.shape[:-1] == probe.shape[:-1] else None


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


def _lazy_param(spec: TensorSpec, cfg: ModelConfig, fill: Callable[..., None], part_bytes: int) -> LazyParam:
    """The parameter as parts converted and written one by one: its layers, or blocks of the tensor's rows."""
    shape, dtype = stacked_shape(spec, cfg), np.dtype(cfg.param_dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    if spec.stacked:  # layer by layer (with all its experts), unless the layers are tiny (norm scales)
        layers = len(stacked_layers(spec, cfg))
        axis, parts = 0, (layers if nbytes // layers >= _SPLIT_BYTES else 1)
    else:  # the embedding and output head: blocks of vocabulary rows (our columns when transposed)
        parts = split(spec.hf_shape[0] if spec.hf_shape else 1, nbytes, part_bytes)
        axis = len(shape) - 1 if is_transposed(spec) else 0
    return LazyParam(shape, dtype, partial(fill, spec, parts=parts), axis, parts)


def ingest(hf_dir: str | Path, out_dir: str | Path, cfg: ModelConfig, log: Log = print, allow_pickle: bool = False) -> dict:
    """Check a HF checkpoint against `cfg`, convert it and save it as param-only Orbax at out_dir/params."""
    hf = read_hf_config(hf_dir)
    check_hf_config(hf, cfg)
    hf_max = hf.get("max_position_embeddings")
    if hf_max and cfg.max_seq_len > hf_max:
        log(f"ingest: note: model.max_seq_len {cfg.max_seq_len} exceeds the checkpoint's "
            f"max_position_embeddings {hf_max}")
    specs = tensor_specs(cfg)
    n = sum(math.prod(stacked_shape(s, cfg)) for s in specs)
    size = n * np.dtype(cfg.param_dtype).itemsize
    log(f"ingest: converting {hf_dir} to {cfg.param_dtype} ({n:,} parameters, {size / 2**20:,.1f} MiB)")
    convert, progress = _converter(hf_dir, cfg, allow_pickle), _Progress(size, log)

    def fill(spec: TensorSpec, out: np.ndarray, k: int = 0, parts: int = 1) -> None:
        convert(spec, out, k, parts)
        progress.add(out.nbytes)

    tree: dict = {}
    # Parts are converted while the last ones are written: memory holds four, so the embedding and output
    # head go in blocks of at most a 32nd of the model (and 256 MiB), about a layer's weight.
    for spec in specs:
        _put(tree, spec.path, _lazy_param(spec, cfg, fill, part_bytes=min(size // 32, 1 << 28)))
    path = save_lazy_params(out_dir, tree, log=log)
    log(f"ingest: {n:,} parameters written to {path} in {progress.seconds():.1f}s")
    return {
        "source": str(hf_dir),
        "family": cfg.family,
        "parameters": n,
        "hf_config": {k: text_config(hf)[k] for k in _SUMMARY_KEYS if k in text_config(hf)}
        | ({"quantization_config": hf["quantization_config"]} if "quantization_config" in hf else {}),
        "dtype": cfg.param_dtype,
    }
