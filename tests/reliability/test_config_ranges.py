"""Issue 11, "configs": every numeric field's range is checked when the config loads (with a
bad value for each), a KV cache too small for the lengths fails before the run (the preflight),
and a section given as a scalar or a file that is not a mapping gets a message that says so."""

from __future__ import annotations

import math
import typing

import pytest

from tandem.config import ConfigError, TandemConfig, load_config
from tandem.config.ranges import RANGES, describe, numeric_fields
from tandem.preflight import check_model_fit


def field_type(path: str) -> type:
    cls: typing.Any = TandemConfig
    for part in path.split("."):
        cls = typing.get_type_hints(cls)[part]
    return cls


def outside(interval: str, kind: type) -> list[float]:
    """Values just outside the interval (and NaN for float fields)."""
    low, high = (float(v) for v in interval[1:-1].split(","))
    step = 1 if kind is int else 0.5
    values = [low if interval[0] == "(" else low - step]
    if high != math.inf:
        values.append(high if interval[-1] == ")" else high + step)
    if kind is not int:
        values.append(math.nan)
    return [int(v) if kind is int else v for v in values]


def override(path: str, value: float) -> str:
    if path.endswith(".betas"):
        return f"{path}=[0.9,{value}]"
    if path == "reward.weights":  # one weight per reward function (a custom one is given)
        return f"{path}=[{value}]"
    return f"{path}={value}"


CASES = [(path, value) for path in sorted(RANGES)
         for value in outside(RANGES[path], int if field_type(path) is int else float)]


def test_every_numeric_field_has_a_range():
    fields = set(numeric_fields(TandemConfig))
    assert fields == set(RANGES), (f"no range for {sorted(fields - set(RANGES))}; "
                                   f"no such field {sorted(set(RANGES) - fields)}")


def test_the_defaults_are_inside_every_range():
    load_config()


@pytest.mark.parametrize("path, value", CASES, ids=[f"{p}={v}" for p, v in CASES])
def test_a_value_outside_its_range_fails_at_load_naming_the_field(path, value):
    with pytest.raises(ConfigError) as error:
        load_config(overrides=[override(path, value)])
    message = str(error.value)
    assert message.startswith(f"{path}: is "), message
    assert describe(RANGES[path]) in message


@pytest.mark.parametrize("item, words", [
    ("actor.optim.grad_clip=0", "actor.optim.grad_clip: is 0.0; must be > 0"),
    ("actor.optim.grad_clip=-1.0", "actor.optim.grad_clip: is -1.0; must be > 0"),
    ("critic.optim.grad_clip=-0.5", "critic.optim.grad_clip: is -0.5; must be > 0"),
    ("actor.optim.lr=-1e-5", "actor.optim.lr: is -1e-05; must be >= 0"),
    ("actor.optim.lr=nan", "actor.optim.lr: is nan; must be finite and >= 0"),
    ("actor.optim.lr=inf", "actor.optim.lr: is inf; must be finite and >= 0"),
    ("actor.optim.betas=[0.9,1.0]", "actor.optim.betas: is [0.9, 1.0]; every element must be in [0, 1)"),
    ("actor.optim.betas=[-0.1,0.9]", "every element must be in [0, 1)"),
    ("actor.optim.betas=[0.9]", "actor.optim.betas: is [0.9]; give two values"),
    ("actor.optim.min_lr_ratio=1.5", "actor.optim.min_lr_ratio: is 1.5; must be in [0, 1]"),
    ("algorithm.gamma=1.1", "algorithm.gamma: is 1.1; must be in [0, 1]"),
    ("algorithm.lam=-0.1", "algorithm.lam: is -0.1; must be in [0, 1]"),
    ("algorithm.kl_ctrl.kl_coef=nan", "algorithm.kl_ctrl.kl_coef: is nan; must be finite and >= 0"),
    ("actor.entropy_coeff=nan", "actor.entropy_coeff: is nan"),
    ("actor.kl_loss_coef=nan", "actor.kl_loss_coef: is nan"),
    ("actor.clip_ratio_low=-0.2", "actor.clip_ratio_low: is -0.2; must be in [0, 1)"),
    ("actor.clip_ratio_high=-0.2", "actor.clip_ratio_high: is -0.2; must be >= 0"),
    ("algorithm.kl_ctrl.horizon=0", "algorithm.kl_ctrl.horizon: is 0; must be >= 1"),
    ("rollout.temperature=nan", "rollout.temperature: is nan; must be finite and >= 0"),
    ("rollout.val_kwargs.temperature=nan", "rollout.val_kwargs.temperature: is nan"),
    ("rollout.temperature=1e-39", "rollout.temperature: is 1e-39, below 1e-05; use 0 for greedy"),
    ("rollout.multi_turn.max_tool_calls_per_turn=0", "rollout.multi_turn.max_tool_calls_per_turn: is 0"),
    ("rollout.multi_turn.tool_timeout_seconds=0", "rollout.multi_turn.tool_timeout_seconds: is 0.0; must be > 0"),
])
def test_the_issues_cases(item, words):
    with pytest.raises(ConfigError) as error:
        load_config(overrides=[item])
    assert words in str(error.value)


def fit(overrides: list[str]) -> None:
    """The preflight's check of the loaded config against the model (tandem train, Trainer)."""
    check_model_fit(load_config(overrides=overrides))


def test_a_response_longer_than_the_kv_cache_fails_before_the_run():
    # tiny:qwen2 in float32: 2 (K, V) x 2 layers x 16 tokens x 2 kv heads x 16 dims x 4 bytes
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4
    base = ["rollout.prompt_length=64", "rollout.response_length=192", "actor.ppo_max_token_len_per_micro_batch=256"]
    fit(base + [f"rollout.kv_cache_memory_bytes={16 * block_bytes}"])
    with pytest.raises(ConfigError) as error:
        fit(base + [f"rollout.kv_cache_memory_bytes={16 * block_bytes - 1}"])
    assert str(error.value) == (
        f"rollout.response_length: prompt_length + response_length = 256 tokens need 16 KV blocks "
        f"of 16 tokens ({16 * block_bytes} bytes for tiny:qwen2), but rollout.kv_cache_memory_bytes="
        f"{16 * block_bytes - 1} holds 15; raise rollout.kv_cache_memory_bytes to at least "
        f"{16 * block_bytes} or shorten the lengths")
    # half precision halves the block: the same budget fits twice the tokens
    fit(base + ["model.dtype=bfloat16", f"rollout.kv_cache_memory_bytes={8 * block_bytes}"])


def test_the_kv_check_reads_an_hf_directory(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "qwen2", "num_hidden_layers": 4, '
                                          '"num_attention_heads": 8, "num_key_value_heads": 2, '
                                          '"hidden_size": 256, "max_position_embeddings": 4096}')
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes((2).to_bytes(8, "little") + b"{}")  # no tensors
    # 2 x 4 layers x 16 tokens x 2 heads x 32 dims x 4 bytes = 32 KiB per block; 768 tokens: 48 blocks
    with pytest.raises(ConfigError, match="need 48 KV blocks"):
        fit([f"model.path={tmp_path}", f"rollout.kv_cache_memory_bytes={47 * 32768}"])
    fit([f"model.path={tmp_path}", f"rollout.kv_cache_memory_bytes={48 * 32768}"])


def write(tmp_path, text: str, name: str = "config.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize("text, words", [
    ("rollout: 5\n", "rollout: is 5, but it is a section: give a mapping of its options"),
    ("rollout: null\n", "rollout: is None, but it is a section"),
    ("rollout:\n  val_kwargs: [1]\n", "rollout.val_kwargs: is [1], but it is a section"),
    ("actor:\n  optim: fast\n", "actor.optim: is 'fast', but it is a section"),
])
def test_a_scalar_where_a_section_belongs_says_so(tmp_path, text, words):
    with pytest.raises(ConfigError) as error:
        load_config(write(tmp_path, text))
    assert words in str(error.value) and "?" not in str(error.value).split(":")[0]


def test_an_override_replacing_a_section_says_so():
    with pytest.raises(ConfigError, match="rollout: is 5, but it is a section"):
        load_config(overrides=["rollout=5"])


def test_files_that_are_not_a_yaml_mapping(tmp_path):
    with pytest.raises(ConfigError, match=r"must be a YAML mapping of sections .* not a list"):
        load_config(write(tmp_path, "- 1\n- 2\n"))
    with pytest.raises(ConfigError, match=r"config.yaml:2:1: not valid YAML: "):
        load_config(write(tmp_path, "rollout: [1,\n"))
    with pytest.raises(ConfigError, match=r"does not exist"):
        load_config(tmp_path / "missing.yaml")
    utf16 = tmp_path / "utf16.yaml"
    utf16.write_text("rollout:\n  n: 2\n", encoding="utf-16")
    with pytest.raises(ConfigError, match=r"utf16.yaml is not UTF-8 text"):
        load_config(utf16)


def test_type_errors_are_one_line():
    with pytest.raises(ConfigError) as error:
        load_config(overrides=["rollout.n=2.5"])
    assert "\n" not in str(error.value) and str(error.value).startswith("rollout.n: ")
