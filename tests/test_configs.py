"""Config merge order, overrides and one-line errors."""

import pytest

from configs import ConfigError, available, load_config


def test_default_preset_is_the_demo_model():
    cfg = load_config()
    assert cfg.model.name == "demo" and cfg.data.input == ["stdlib"]


def test_merge_order_base_model_preset_overrides():
    cfg = load_config("tiny", ["train.steps=7", "emb_dim=32", "train.mesh.fsdp=2", "prompt=def f(x):"])
    assert cfg.model.name == "tiny"
    assert cfg.model.vocab_size == 512  # from models/tiny.yml
    assert cfg.data.seq_len == 64  # from presets/tiny.yml
    assert cfg.train.steps == 7 and cfg.model.emb_dim == 32  # overrides win
    assert cfg.train.mesh == {"data": -1, "fsdp": 2, "expert": 1, "context": 1, "tensor": 1}  # merged into the base mesh
    assert cfg.eval.prompt == "def f(x):"  # strings are taken verbatim


def test_a_dict_override_sets_the_whole_value():
    assert load_config("tiny", ["train.mesh={fsdp: -1}"]).train.mesh == {"fsdp": -1}
    assert load_config("tiny", ["train.mesh={fsdp: -1}", "train.mesh.tensor=2"]).train.mesh == {"fsdp": -1, "tensor": 2}
    with pytest.raises(ConfigError, match=r"at most one axis may be -1 .*train.mesh='\{fsdp: -1\}' sets the whole mesh"):
        load_config("tiny", ["train.mesh.fsdp=-1"])


def test_model_can_be_chosen_by_name():
    assert load_config(None, ["model=tiny"]).model.emb_dim == 64


def test_list_override():
    assert load_config(None, ["data.input=a/*.txt,b/*.jsonl"]).data.input == ["a/*.txt", "b/*.jsonl"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["stesp=4"], "unknown config key 'stesp' (did you mean 'steps'?)"),
        (["train.lerning_rate=1"], "did you mean 'train.learning_rate'?"),
        (["steps=abc"], "train.steps: Input should be a valid integer"),
        (["batch_size=4"], "ambiguous: write train.batch_size or eval.batch_size"),
        (["num_kv_heads=3"], "model.num_heads (4) must be a multiple of model.num_kv_heads (3)"),
        (["model=tinny"], "unknown model 'tinny' (did you mean 'tiny'?)"),
        (["warmup_steps=400"], "train.warmup_steps (400) must be below train.steps"),
        (["seq_len=4096"], "data.seq_len (4096) exceeds model.max_seq_len (2048)"),
        (["train.mesh.pipeline=2"], "train.mesh.pipeline"),
        (["dtype=float16"], "model.dtype"),
        (["steps"], "not of the form key=value"),
    ],
)
def test_errors_are_one_line_naming_the_key(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_unknown_preset():
    with pytest.raises(ConfigError, match="did you mean 'tiny'"):
        load_config("tinyy")


def test_every_preset_and_model_file_validates():
    for preset in available("presets"):
        load_config(preset)
    for model in available("models"):
        load_config(None, [f"model={model}"])
