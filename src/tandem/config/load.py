"""Load a TandemConfig from YAML plus `a.b.c=value` overrides, and validate its fields.

Every error is a ConfigError whose message names the field and the fix. The checks live by
concern beside this file (ranges, choices, rollout, footprint, trainer, sync, lora, training,
reward, pool, determinism); those that need registries, data, the model or memory are
tandem.preflight's.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from tandem.config.choices import ConfigError, choice_problem
from tandem.config.determinism_check import derive_determinism, determinism_problem
from tandem.config.footprint import fleet_problem
from tandem.config.lora_check import derive_lora_rank, lora_problem
from tandem.config.pool_check import pool_problem
from tandem.config.ranges import out_of_range
from tandem.config.replay_check import derive_replay_sampling_mask, replay_problem
from tandem.config.reward_check import served_reward_problem
from tandem.config.rollout_check import rollout_problem
from tandem.config.schema import TandemConfig
from tandem.config.sync_check import sync_problem
from tandem.config.trainer_check import trainer_problem
from tandem.config.training_check import training_problem


def load_config(source: str | Path | Mapping[str, Any] | None = None,
                overrides: Iterable[str] = ()) -> TandemConfig:
    """Read a YAML file or a nested dict (optional), apply `a.b.c=value` overrides, validate,
    return a TandemConfig."""
    schema = OmegaConf.structured(TandemConfig)
    try:
        layers = [schema]
        if isinstance(source, Mapping):
            layers.append(OmegaConf.create(dict(source)))
        elif source is not None:
            layers.append(_load_yaml(Path(source)))
        overrides = list(overrides)
        for item in overrides:
            if "=" not in item:
                raise ConfigError(f"override {item!r} is not of the form a.b.c=value")
        if overrides:
            layers.append(OmegaConf.from_dotlist(overrides))
        for layer in layers[1:]:
            _check_sections(OmegaConf.to_container(layer, resolve=False), TandemConfig, "")
        merged = OmegaConf.merge(*layers)
        config: TandemConfig = OmegaConf.to_object(merged)
        given = {key for layer in layers[1:]
                 for key in _dotted_keys(OmegaConf.to_container(layer, resolve=False))}
    except ConfigKeyError as error:
        raise ConfigError(_unknown_key_message(error)) from None
    except OmegaConfBaseException as error:
        key = getattr(error, "full_key", None) or "?"
        message = str(error.msg if hasattr(error, "msg") else error).splitlines()[0]
        raise ConfigError(f"{key}: {message}. "
                          "Fix the value's type or spelling in the YAML or override.") from None
    derive_separate_async(config, given)
    derive_lora_rank(config, given)
    derive_replay_sampling_mask(config, given)
    derive_determinism(config, given)
    validate(config)
    return config


def derive_separate_async(config: TandemConfig, given: set[str]) -> None:
    """trainer_mode=separate_async with its own options left unset (so one override switches
    modes): rollout devices = 1 node x trainer.n_devices, parameter_sync_step =
    data.train_batch_size / actor.ppo_mini_batch_size. (The checkpoint engine's "auto" is
    decided at start, once the fleet knows which host each server runs on.)"""
    if config.trainer.trainer_mode != "separate_async":
        return
    rollout = config.rollout
    if not {"rollout.nnodes", "rollout.n_gpus_per_node"} & given:
        rollout.nnodes, rollout.n_gpus_per_node = 1, config.trainer.n_devices
    batch, mini = config.data.train_batch_size, config.actor.ppo_mini_batch_size
    if "trainer.separate_async.parameter_sync_step" not in given and mini and batch % mini == 0:
        config.trainer.separate_async.parameter_sync_step = batch // mini


def _dotted_keys(tree: Any, prefix: str = "") -> Iterator[str]:
    """a.b.c for every leaf of a nested mapping (the keys a YAML file or override sets)."""
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _dotted_keys(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}"


def to_yaml(config: TandemConfig) -> str:
    """Serialise a config back to YAML (what a run saves next to its outputs)."""
    return OmegaConf.to_yaml(OmegaConf.structured(config))


def _load_yaml(path: Path) -> DictConfig:
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        layer = OmegaConf.load(str(path))
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        context = getattr(error, "context", None)
        raise ConfigError(f"{where}: not valid YAML: {problem}"
                          f"{f' ({context})' if context else ''}") from None
    except UnicodeDecodeError as error:
        raise ConfigError(f"{path} is not UTF-8 text (byte {error.start}); save it as UTF-8") from None
    if not isinstance(layer, DictConfig):
        raise ConfigError(f"{path} must be a YAML mapping of sections (model: ..., rollout: ...), "
                          f"not a {type(OmegaConf.to_container(layer)).__name__}")
    return layer


def _check_sections(layer: Any, cls: type, prefix: str) -> None:
    """A section (a dataclass in the schema) must be given as a mapping, e.g. not `rollout: 5`."""
    hints = typing.get_type_hints(cls)
    for key, value in layer.items():
        hint = hints.get(key)
        if not dataclasses.is_dataclass(hint):
            continue  # unknown keys are reported by the merge
        if not isinstance(value, dict):
            raise ConfigError(f"{prefix}{key}: is {value!r}, but it is a section: give a mapping of "
                              f"its options (e.g. `{key}:` then indented `name: value` lines), or "
                              f"leave it out. Valid keys: "
                              f"{', '.join(f.name for f in dataclasses.fields(hint))}")
        _check_sections(value, hint, f"{prefix}{key}.")


def _unknown_key_message(error: ConfigKeyError) -> str:
    full_key = error.full_key or error.key or "?"
    parent = full_key.rsplit(".", 1)[0] if "." in full_key else ""
    node: Any = OmegaConf.structured(TandemConfig)
    for part in filter(None, parent.split(".")):
        node = node[part]
    valid = ", ".join(sorted(node.keys()))
    return (f"unknown config key {full_key!r}: no option of that name exists, so it would be "
            f"silently ignored.{did_you_mean(full_key)} Valid keys under {parent or 'the root'}: "
            f"{valid}")


# names users bring from verl and TRL -> tandem's (docs/from_verl_trl.md has the whole table)
FOREIGN_NAMES = {
    "trainer.total_training_steps": "trainer.total_steps",
    "trainer.default_local_dir": "trainer.output_dir",
    "trainer.logger": "trainer.loggers",
    "trainer.tensorboard": "trainer.loggers",
    "trainer.n_gpus_per_node": "trainer.n_devices",
    "trainer.resume_mode": "trainer.resume",
    "actor_rollout_ref.model.path": "model.path",
    "actor_rollout_ref.model.lora_rank": "actor.lora.rank",
    "actor_rollout_ref.model.lora_alpha": "actor.lora.alpha",
    "actor_rollout_ref.model.target_modules": "actor.lora.target_modules",
    "custom_reward_function.path": "reward.custom_function.path",
    "custom_reward_function.name": "reward.custom_function.name",
    "reward.custom_reward_function.path": "reward.custom_function.path",
    "reward.custom_reward_function.name": "reward.custom_function.name",
    "algorithm.rollout_is": "algorithm.rollout_correction.importance_sampling",
    "algorithm.rollout_is_threshold": "algorithm.rollout_correction.importance_sampling_threshold",
    "algorithm.rollout_rs": "algorithm.rollout_correction.rejection",
    "algorithm.rollout_rs_threshold": "algorithm.rollout_correction.rejection_threshold",
    "data.max_prompt_length": "rollout.prompt_length",
    "data.max_response_length": "rollout.response_length",
    "actor.ppo_max_token_len_per_gpu": "actor.ppo_max_token_len_per_micro_batch",
    # TRL's GRPOConfig
    "num_generations": "rollout.n",
    "beta": "actor.kl_loss_coef",
    "learning_rate": "actor.optim.lr",
    "max_completion_length": "rollout.response_length",
    "max_prompt_length": "rollout.prompt_length",
    "num_iterations": "actor.ppo_epochs",
    "epsilon": "actor.clip_ratio_low",
    "epsilon_high": "actor.clip_ratio_high",
    "reward_weights": "reward.weights",
    "output_dir": "trainer.output_dir",
    "max_steps": "trainer.total_steps",
    "save_steps": "trainer.save_freq",
    "eval_steps": "trainer.test_freq",
    "report_to": "trainer.loggers",
}


def did_you_mean(key: str) -> str:
    """' Did you mean trainer.total_steps?' for a misspelt or verl/TRL key, else ''."""
    if key in FOREIGN_NAMES:
        return f" Did you mean {FOREIGN_NAMES[key]} (tandem's name for it)?"
    tail = key.rsplit(".", 1)[-1]
    for foreign, ours in FOREIGN_NAMES.items():
        if foreign.rsplit(".", 1)[-1] == tail and "." not in foreign:
            return f" Did you mean {ours} (tandem's name for it)?"
    candidates = list(_all_keys(TandemConfig))
    section = key.split(".", 1)[0]
    # the right name in the wrong place first (same section preferred), then a misspelling
    same_tail = sorted((c for c in candidates if c.rsplit(".", 1)[-1] == tail),
                       key=lambda c: c.split(".", 1)[0] != section)
    close = same_tail[:1] or difflib.get_close_matches(key, candidates, n=1, cutoff=0.75)
    if not close:
        tails = difflib.get_close_matches(tail, [c.rsplit(".", 1)[-1] for c in candidates], n=1,
                                          cutoff=0.8)
        close = [c for c in candidates if tails and c.rsplit(".", 1)[-1] == tails[0]][:1]
    return f" Did you mean {close[0]}?" if close else ""


def _all_keys(cls: type, prefix: str = "") -> Iterator[str]:
    hints = typing.get_type_hints(cls)
    for item in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[item.name]):
            yield from _all_keys(hints[item.name], f"{prefix}{item.name}.")
        else:
            yield f"{prefix}{item.name}"


# Each check returns the first problem of its concern as "field: why; fix". They read the
# fields alone: what needs a registry, the data, the model or the memory budget is checked by
# tandem.preflight, before Ray or torch start.
CHECKS: tuple[Callable[[TandemConfig], str | None], ...] = (
    out_of_range, choice_problem, fleet_problem, rollout_problem, trainer_problem, sync_problem,
    lora_problem, training_problem, served_reward_problem, pool_problem, replay_problem,
    determinism_problem)


def validate(config: TandemConfig) -> None:
    """Raise ConfigError on the first invalid field; return None when the config is usable."""
    for check in CHECKS:
        problem = check(config)
        if problem:
            raise ConfigError(problem)
