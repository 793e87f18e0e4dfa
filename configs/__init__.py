"""maxpipe's typed config: base.yml <- models/NAME.yml <- presets/NAME.yml <- key=value overrides."""

from configs.errors import ConfigError, UserError
from configs.loader import available, load_config, names_model, parse_override, setting, validate
from configs.schema import (
    Config, DataConfig, EvalConfig, ExportConfig, ModelConfig, PipelineConfig, TrainConfig, TrainSettings,
)

__all__ = [
    "Config", "ConfigError", "DataConfig", "EvalConfig", "ExportConfig", "ModelConfig", "PipelineConfig", "TrainConfig",
    "TrainSettings", "UserError", "available", "load_config", "names_model", "parse_override", "setting", "validate",
]
