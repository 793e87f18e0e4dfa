"""The model config of a command that names no model file: from the artifact it starts from, or from a HF checkpoint."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from configs import Config, ModelConfig, UserError, load_config, names_model, setting

Log = Callable[[str], None]


def resolve_config(
    preset: str | None, overrides: Sequence[str], hf_dir: str | None = None, artifact: str | Path | None = None,
    log: Log = print,
) -> Config:
    """The config of a command. Unless `model=NAME` or a preset given by name picks a model file, the model is
    `artifact`'s (from its manifest), else the HF checkpoint's (`hf_dir`, else `pipeline.hf_checkpoint`)."""
    if names_model(preset, overrides):
        return load_config(preset, overrides)
    if artifact:
        return load_config(preset, overrides, model=artifact_model(artifact, log))
    hf_dir = hf_dir or setting(preset, overrides, "pipeline.hf_checkpoint")
    if hf_dir:
        return load_config(preset, overrides, model=checkpoint_model(hf_dir, log).model_dump())
    return load_config(preset, overrides)


def checkpoint_model(hf_dir: str, log: Log = print) -> ModelConfig:
    """The model config of a HF checkpoint's config.json, named after its directory."""
    from contract.manifest import mounted_url
    from trainer.hf.config import model_config_from_hf, read_hf_config

    url = mounted_url(hf_dir)  # a /gcs/ path of the steps is read through gs:// here
    try:
        hf = read_hf_config(url)
    except UserError as err:
        raise UserError(f"{err} (or name a model file: model=NAME)") from None
    model = model_config_from_hf(hf, name=url.rstrip("/").rsplit("/", 1)[-1] or "hf")
    log(f"model {model.name}: derived from {hf_dir}'s config.json ({model.family}, {model.num_layers} layers, "
        f"{_parameters(model):,} parameters)")
    return model


def artifact_model(directory: str | Path, log: Log = print) -> dict[str, Any]:
    """The model config recorded in an artifact's manifest."""
    from contract.manifest import require_manifest

    manifest = require_manifest(directory)
    model = manifest["config"].get("model")
    if not isinstance(model, dict):
        raise UserError(f"{directory} holds a {manifest['kind']} artifact, which records no model config: "
                        "give model=NAME")
    log(f"model {model.get('name')}: the model config of {directory} "
        f"({model.get('family')}, {model.get('num_layers')} layers)")
    return model


def _parameters(model: ModelConfig) -> int:
    """Counted from the tensor shapes: building the model would start JAX in this (the launching) process."""
    from trainer.hf.tensor_spec import stacked_shape
    from trainer.hf.tensors import tensor_specs

    return sum(math.prod(stacked_shape(s, model)) for s in tensor_specs(model))
