"""Resolve a config: base.yml <- models/NAME.yml <- presets/NAME.yml <- key=value overrides."""

from __future__ import annotations

import difflib
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from configs.errors import ConfigError
from configs.schema import Config

CONFIG_DIR = Path(__file__).parent
DEFAULT_PRESET = "demo"


def available(kind: str) -> list[str]:
    """Names of the model files (`kind="models"`) or presets (`kind="presets"`)."""
    return sorted(p.stem for p in (CONFIG_DIR / kind).glob("*.yml"))


def load_config(
    preset: str | None = None, overrides: Sequence[str] = (), model: dict[str, Any] | None = None,
) -> Config:
    """The validated config for a preset and `key=value` overrides.

    `model` (a model section, e.g. derived from a HF checkpoint) stands in for the model file; the preset's and
    the overrides' `model.*` keys still apply on top of it.
    """
    return validate(_resolve(preset, overrides, model))


def names_model(preset: str | None, overrides: Sequence[str]) -> bool:
    """Whether the overrides (`model=NAME`) or a preset given by name pick a model file (the default preset's
    model is only a default)."""
    trees = [_override_tree([parse_override(item) for item in overrides])]
    if preset:
        trees.append(_read_preset(preset))
    return any(_model_name(tree) for tree in trees)


def setting(preset: str | None, overrides: Sequence[str], key: str) -> Any:
    """The value of a dotted key (`pipeline.hf_checkpoint`) after merging and overrides, before validation."""
    value: Any = _resolve(preset, overrides, None)
    for part in key.split("."):
        value = value[part]
    return value


def _resolve(preset: str | None, overrides: Sequence[str], model: dict[str, Any] | None) -> dict[str, Any]:
    """base.yml <- the model file (or `model`) <- the preset <- the overrides, as a plain tree."""
    merged = _read_yaml(CONFIG_DIR / "base.yml")
    preset_tree = _read_preset(preset or DEFAULT_PRESET)
    parsed = [parse_override(item) for item in overrides]
    # _model_name also turns a preset's `model: NAME` into an empty section, so that it merges.
    named = [_model_name(tree) for tree in (_override_tree(parsed), preset_tree)]
    if model is None:
        model_name = next((n for n in named if n), merged["model"]["name"])
        if model_name not in available("models"):
            raise ConfigError(f"model: unknown model {model_name!r}{_suggest(model_name, available('models'))}")
        model = _read_yaml(CONFIG_DIR / "models" / f"{model_name}.yml")
    else:
        model_name = model["name"]
    for tree in ({"model": model}, preset_tree):
        _merge(merged, tree)
    # Each override sets what it names: `train.mesh={fsdp: -1}` the whole mesh, `train.mesh.fsdp=2` one axis.
    for path, value in parsed:
        _set(merged, path, value)
    merged["model"]["name"] = model_name
    return merged


def _read_preset(preset: str) -> dict[str, Any]:
    if preset not in available("presets"):
        raise ConfigError(f"unknown preset {preset!r}{_suggest(preset, available('presets'))}")
    return _read_yaml(CONFIG_DIR / "presets" / f"{preset}.yml")


def _override_tree(parsed: Sequence[tuple[list[str], Any]]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for path, value in parsed:
        _set(tree, path, value)
    return tree


def validate(tree: dict[str, Any]) -> Config:
    """Build a Config from a plain tree, turning the first problem into one ConfigError line."""
    _check_keys(tree, Config, "")
    try:
        return Config.model_validate(tree)
    except ValidationError as err:
        first = err.errors()[0]
        key = ".".join(str(p) for p in first["loc"])
        msg = first["msg"].removeprefix("Value error, ")
        got = f" (got {first['input']!r})" if first["type"] != "value_error" and not isinstance(first["input"], dict) else ""
        raise ConfigError(f"{key}: {msg}{got}" if key and not msg.startswith(key) else f"{msg}{got}") from None


def parse_override(item: str) -> tuple[list[str], Any]:
    """`train.steps=10` or a unique bare key (`steps=10`) -> (["train", "steps"], value)."""
    key, sep, raw = item.partition("=")
    key = key.strip().lstrip("-")
    if not sep or not key:
        raise ConfigError(f"override {item!r} is not of the form key=value")
    path = _resolve_key(key)
    return path, _parse_value(path, raw)


def leaf_keys() -> list[str]:
    """Every settable dotted key, e.g. `train.steps`."""
    return [f"{section}.{name}" for section, cls in _sections().items() for name in cls.model_fields]


def _sections() -> dict[str, type[BaseModel]]:
    return {name: field.annotation for name, field in Config.model_fields.items()}


def _resolve_key(key: str) -> list[str]:
    parts = key.split(".")
    if parts == ["model"]:
        return ["model", "name"]
    sections = _sections()
    if parts[0] in sections:
        if len(parts) == 1 or parts[1] not in sections[parts[0]].model_fields:
            raise ConfigError(f"unknown config key {key!r}{_suggest(key, leaf_keys())}")
        return parts
    owners = [s for s, cls in sections.items() if parts[0] in cls.model_fields]
    if len(owners) > 1:
        choices = " or ".join(f"{s}.{key}" for s in owners)
        raise ConfigError(f"config key {key!r} is ambiguous: write {choices}")
    if not owners:
        bare = [k.split(".", 1)[1] for k in leaf_keys()]
        raise ConfigError(f"unknown config key {key!r}{_suggest(key, leaf_keys() + bare)}")
    return [owners[0], *parts]


def _parse_value(path: list[str], raw: str) -> Any:
    annotation = _sections()[path[0]].model_fields[path[1]].annotation if len(path) == 2 else None
    if annotation is str:
        return raw
    if typing.get_origin(annotation) is list:
        if raw.strip().startswith("["):
            return [str(v) for v in yaml.safe_load(raw)]
        return [v for v in raw.split(",") if v]
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw


def _check_keys(tree: dict[str, Any], cls: type[BaseModel], prefix: str) -> None:
    for key, value in tree.items():
        field = cls.model_fields.get(key)
        if field is None:
            known = [f"{prefix}{k}" for k in cls.model_fields]
            raise ConfigError(f"unknown config key {prefix + key!r}{_suggest(prefix + key, known)}")
        sub = field.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel) and isinstance(value, dict):
            _check_keys(value, sub, f"{prefix}{key}.")


def _model_name(tree: dict[str, Any]) -> str | None:
    model = tree.get("model")
    if isinstance(model, str):
        tree["model"] = {}
        return model
    return model.get("name") if isinstance(model, dict) else None


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML ({err.problem})") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: expected a mapping of keys to values")
    return tree


def _merge(base: dict[str, Any], top: dict[str, Any]) -> None:
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value


def _set(tree: dict[str, Any], path: list[str], value: Any) -> None:
    for part in path[:-1]:
        tree = tree.setdefault(part, {})
    tree[path[-1]] = value


def _suggest(word: str, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""
