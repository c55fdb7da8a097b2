"""Load a TandemConfig from YAML plus `a.b.c=value` overrides, and validate it at load time.

Every error is a ConfigError whose message names the field and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from tandem.config.choices import (ADV_ESTIMATORS, CORRECTION_LEVELS, DTYPES,
                                   IMPORTANCE_SAMPLING_MODES, IN_FLIGHT_KV, KL_CONTROLLERS, KL_TYPES,
                                   LOGPROBS_MODES, LOSS_AGG_MODES, LR_SCHEDULES,
                                   NONFINITE_LOSS_POLICIES, PLACEMENT_STRATEGIES,
                                   REWARD_PLACEMENTS, STALE_POLICIES, TRAINER_MODES,
                                   TRUNCATE_SIDES, ConfigError)
from tandem.config.footprint import fleet_problem, rollout_devices
from tandem.config.kv_budget import hf_config, kv_budget_problem
from tandem.config.lora_check import derive_lora_rank, lora_problem
from tandem.config.model_check import model_problem
from tandem.config.ranges import out_of_range
from tandem.config.reward_check import served_reward_problem
from tandem.config.schema import RolloutConfig, RolloutCorrectionConfig, TandemConfig
from tandem.types import TEMPERATURE_FLOOR


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


def _fail(field_name: str, message: str) -> None:
    raise ConfigError(f"{field_name}: {message}")


def _choice(field_name: str, value: str, valid: Iterable[str]) -> None:
    valid = tuple(valid)
    if value not in valid:
        _fail(field_name, f"unknown value {value!r}; valid values are {', '.join(valid)}")


def validate(config: TandemConfig) -> None:
    """Raise ConfigError on the first invalid field; return None when the config is usable."""
    from tandem.rollout.registry import rollout_backend_names
    from tandem.tools.registry import tool_class
    from tandem.weight_sync.registry import checkpoint_engine_names, engine_kwargs_problem

    problem = out_of_range(config)
    if problem:
        raise ConfigError(problem)
    rollout = config.rollout
    if rollout.mode != "async":
        _fail("rollout.mode", f"{rollout.mode!r} is not supported: the synchronous generation path "
              "was removed and async server mode is the only one. Set rollout.mode=async "
              "(trainer.trainer_mode=sync is a different thing and is still available).")
    _choice("rollout.name", rollout.name, rollout_backend_names())
    if rollout.pipeline_model_parallel_size != 1:
        _fail("rollout.pipeline_model_parallel_size", f"is {rollout.pipeline_model_parallel_size}; "
              "pipeline parallelism is not supported by any rollout backend. Set it to 1.")
    _check_sampling("rollout", rollout.temperature, rollout.top_p, rollout.top_k)
    _check_sampling("rollout.val_kwargs", rollout.val_kwargs.temperature, rollout.val_kwargs.top_p,
                    rollout.val_kwargs.top_k)
    _choice("rollout.logprobs_mode", rollout.logprobs_mode, LOGPROBS_MODES)
    _choice("rollout.in_flight_kv", rollout.in_flight_kv, IN_FLIGHT_KV)
    if rollout.in_flight_kv == "keep" and rollout.name != "native":
        _fail("rollout.in_flight_kv", f"'keep' is the native engine's; {rollout.name} recomputes "
              "running requests after a weight update. Set it to recompute.")
    problem = model_problem(config) or kv_budget_problem(config)
    if problem:
        raise ConfigError(problem)

    problem = fleet_problem(config)
    if problem:
        raise ConfigError(problem)

    ckpt = rollout.checkpoint_engine
    _choice("rollout.checkpoint_engine.backend", ckpt.backend, ("auto", *checkpoint_engine_names()))
    problem = engine_kwargs_problem(ckpt.backend, dict(ckpt.engine_kwargs))
    if problem:
        _fail("rollout.checkpoint_engine.engine_kwargs", problem)
    transport = ckpt.engine_kwargs.get("transport") if ckpt.backend == "delta" else ckpt.backend
    if transport == "nccl" and not config.model.device.startswith("cuda"):
        _fail("rollout.checkpoint_engine.backend", f"{ckpt.backend!r} moves weights over NCCL, "
              f"which needs CUDA devices, but model.device={config.model.device!r}; use shm or "
              "gloo on CPU (or model.device=cuda)")

    turns = rollout.multi_turn
    _choice("rollout.multi_turn.tool_response_truncate_side", turns.tool_response_truncate_side,
            TRUNCATE_SIDES)
    for tool in turns.tools:
        try:
            tool_class(tool)
        except ValueError as error:
            raise ConfigError(str(error)) from None
    if turns.tools and not turns.enable:
        _fail("rollout.multi_turn.enable", f"is false, so the tools {list(turns.tools)} listed in "
              "rollout.multi_turn.tools would be ignored; set rollout.multi_turn.enable=true or drop them")
    _check_openai_agent(rollout)

    _choice("model.dtype", config.model.dtype, DTYPES)
    if config.model.device not in ("cpu", "cuda") and not config.model.device.startswith("cuda:"):
        _fail("model.device", f"unknown device {config.model.device!r}; use cpu or cuda")

    actor = config.actor
    _choice("actor.loss_agg_mode", actor.loss_agg_mode, LOSS_AGG_MODES)
    if actor.loss_scale_factor is not None and actor.loss_scale_factor <= 0:
        _fail("actor.loss_scale_factor", f"is {actor.loss_scale_factor}; it must be a positive "
              "constant (or null: rollout.response_length)")
    _kl_type("actor.kl_loss_type", actor.kl_loss_type)
    _choice("actor.optim.schedule", actor.optim.schedule, LR_SCHEDULES)
    _choice("critic.optim.schedule", config.critic.optim.schedule, LR_SCHEDULES)
    longest = rollout.prompt_length + rollout.response_length
    if actor.ppo_max_token_len_per_micro_batch < longest:
        _fail("actor.ppo_max_token_len_per_micro_batch", f"is {actor.ppo_max_token_len_per_micro_batch}, "
              f"below the longest trajectory rollout.prompt_length + rollout.response_length = {longest}; "
              f"raise it to at least {longest}")
    if actor.micro_batch_memory_gb:
        _check_memory_budget(config)
    problem = lora_problem(actor.lora)
    if problem:
        raise ConfigError(problem)

    algorithm = config.algorithm
    _choice("algorithm.adv_estimator", algorithm.adv_estimator, ADV_ESTIMATORS)
    _kl_type("algorithm.kl_penalty", algorithm.kl_penalty)
    _choice("algorithm.kl_ctrl.type", algorithm.kl_ctrl.type, KL_CONTROLLERS)
    correction = algorithm.rollout_correction
    _check_rollout_correction(correction)
    if not rollout.calculate_log_probs and (correction.importance_sampling != "none"
                                            or correction.rejection != "none"):
        _fail("algorithm.rollout_correction", "importance sampling and rejection compare rollout and "
              "actor log-probs, so rollout.calculate_log_probs must be true (or set both to none)")
    if rollout.calculate_log_probs and rollout.logprobs_mode == "raw" and rollout.temperature not in (0.0, 1.0):
        _fail("rollout.logprobs_mode", f"'raw' log-probs are of the untempered model, but rollout.temperature="
              f"{rollout.temperature} samples from logits / temperature; PPO's ratio, rollout correction "
              "and the rollout-vs-actor gap need the sampled distribution. Set rollout.logprobs_mode="
              "processed (or rollout.temperature=1)")
    if correction.bypass_mode and not rollout.calculate_log_probs:
        _fail("algorithm.rollout_correction.bypass_mode", "uses rollout_log_probs as old_log_probs, "
              "so rollout.calculate_log_probs must be true")
    if algorithm.adv_estimator == "grpo" and rollout.n < 2:
        _fail("rollout.n", f"is {rollout.n}, but adv_estimator=grpo normalises each reward against "
              "its prompt's group: a group of one gets advantage 0 and learns nothing. Set "
              "rollout.n >= 2 (e.g. rollout.n=4) or use algorithm.adv_estimator=gae with a critic")
    if algorithm.adv_estimator == "gae" and not config.critic.enable:
        _fail("algorithm.adv_estimator", "gae needs a value model: set critic.enable=true "
              "(or use adv_estimator=grpo)")
    _choice("reward.placement", config.reward.placement, REWARD_PLACEMENTS)
    from tandem.rewards.scorer import user_reward_functions

    user_reward_functions(config.reward)  # a bad entry or weights list is a ConfigError
    problem = served_reward_problem(config)
    if problem:
        raise ConfigError(problem)

    if config.data.train_batch_size < actor.ppo_mini_batch_size:
        _fail("actor.ppo_mini_batch_size", f"is {actor.ppo_mini_batch_size} prompts, more than "
              f"data.train_batch_size={config.data.train_batch_size}: a mini-batch would be mostly "
              "padding. Lower it or raise the batch size")

    trainer = config.trainer
    _choice("trainer.trainer_mode", trainer.trainer_mode, TRAINER_MODES)
    _check_loggers(trainer.loggers)
    _choice("trainer.resume_missing", trainer.resume_missing, ("warn", "fail"))
    _choice("trainer.on_nonfinite_loss", trainer.on_nonfinite_loss, NONFINITE_LOSS_POLICIES)
    _choice("trainer.placement_strategy", trainer.placement_strategy, PLACEMENT_STRATEGIES)
    if actor.fsdp_size != trainer.n_devices:
        _fail("actor.fsdp_size", f"is {actor.fsdp_size} but trainer.n_devices={trainer.n_devices}: in the "
              "hybrid layout every device runs one FSDP rank; set both to the same value")
    if (actor.ppo_mini_batch_size * rollout.n) % trainer.n_devices:
        _fail("actor.ppo_mini_batch_size", f"a mini-batch of {actor.ppo_mini_batch_size} prompts x rollout.n="
              f"{rollout.n} trajectories does not split over trainer.n_devices={trainer.n_devices}")
    if trainer.trainer_mode == "separate_async":
        if rollout.nnodes < 1 or rollout.n_gpus_per_node < 1:
            _fail("rollout.nnodes", "separate_async runs rollout on its own devices: set "
                  "rollout.nnodes and rollout.n_gpus_per_node to at least 1")
        if ckpt.backend == "naive":
            _fail("rollout.checkpoint_engine.backend", "separate_async cannot use 'naive' (it only "
                  "hands tensors over inside one process); choose one of "
                  f"{', '.join(n for n in checkpoint_engine_names() if n != 'naive')}")
        sync_step = trainer.separate_async.parameter_sync_step
        if config.data.train_batch_size != sync_step * actor.ppo_mini_batch_size:
            _fail("data.train_batch_size", f"is {config.data.train_batch_size}, but separate_async "
                  f"needs train_batch_size == trainer.separate_async.parameter_sync_step ({sync_step})"
                  f" x actor.ppo_mini_batch_size ({actor.ppo_mini_batch_size}) = "
                  f"{sync_step * actor.ppo_mini_batch_size}")
    elif rollout.torch_threads and not rollout_devices(config):
        _fail("rollout.torch_threads", f"is {rollout.torch_threads}, but in trainer_mode="
              f"{trainer.trainer_mode} the rollout engine runs inside the training workers, whose "
              "threads are actor.torch_threads; set rollout.torch_threads=0")
    async_rollout = trainer.async_rollout
    _choice("trainer.async_rollout.on_stale", async_rollout.on_stale, STALE_POLICIES)
    if async_rollout.buffer_groups and async_rollout.buffer_groups < config.data.train_batch_size:
        _fail("trainer.async_rollout.buffer_groups", f"is {async_rollout.buffer_groups}, fewer than "
              f"data.train_batch_size={config.data.train_batch_size}: a step could never fill its "
              "batch. Raise it (or 0 for 3 x train_batch_size)")
    usable = (async_rollout.max_staleness + 1) * config.data.train_batch_size
    if async_rollout.buffer_groups > usable:
        _fail("trainer.async_rollout.buffer_groups", f"is {async_rollout.buffer_groups}, but a step "
              f"takes data.train_batch_size={config.data.train_batch_size} groups, so groups past "
              f"(max_staleness + 1) x train_batch_size = {usable} would wait beyond "
              f"trainer.async_rollout.max_staleness={async_rollout.max_staleness} versions and be "
              f"generated only to go stale. Lower it to at most {usable} (or 0 for 3 x "
              "train_batch_size), or raise max_staleness")


# logger name -> the module its client needs (and the extra that installs it)
LOGGER_PACKAGES = {"console": None, "jsonl": None, "tensorboard": "tensorboard", "wandb": "wandb",
                   "mlflow": "mlflow"}


def _check_loggers(loggers: list[str]) -> None:
    import importlib.util

    for name in loggers:
        _choice("trainer.loggers", name, LOGGER_PACKAGES)
        package = LOGGER_PACKAGES[name]
        if package is not None and importlib.util.find_spec(package) is None:
            _fail("trainer.loggers", f"lists {name!r}, but the {package} package is not "
                  f"installed; pip install 'tandem-rl[{name}]' or drop {name!r}")


def _check_memory_budget(config: TandemConfig) -> None:
    """actor.micro_batch_memory_gb must hold the longest trajectory, when the model's shape is
    known here (the engine checks again with the loaded model: a head with softcapping or logit
    scaling takes the full-logits path, as an FSDP-sharded one does)."""
    from tandem.training.memory_budget import micro_batch_token_budget

    if not config.actor.use_remove_padding:
        _fail("actor.micro_batch_memory_gb", "sizes packed micro-batches, but actor.use_remove_padding="
              "false: a padded forward also holds its padding tokens, which the estimate cannot bound. "
              "Set actor.use_remove_padding=true, or actor.micro_batch_memory_gb=0 and size "
              "micro-batches with actor.ppo_max_token_len_per_micro_batch")
    hf = hf_config(config.model.path)
    if hf is None:
        return
    try:
        micro_batch_token_budget(config, hf, full_logits=config.actor.fsdp_size > 1)
    except ValueError as error:
        raise ConfigError(str(error)) from None


def _kl_type(field_name: str, value: str) -> None:
    if value.rstrip("+") == "full":
        _fail(field_name, "'full' (the exact KL over the whole vocabulary) needs both policies' full "
              "distributions per token, which the trainer does not keep (verl does not implement it "
              f"either); use an estimator instead: {', '.join(KL_TYPES)}")
    _choice(field_name, value, KL_TYPES)


def _check_rollout_correction(correction: RolloutCorrectionConfig) -> None:
    from tandem.config.rejection_spec import parse_rejection

    prefix = "algorithm.rollout_correction"
    _choice(f"{prefix}.importance_sampling", correction.importance_sampling, CORRECTION_LEVELS)
    _choice(f"{prefix}.importance_sampling_mode", correction.importance_sampling_mode,
            IMPORTANCE_SAMPLING_MODES)
    if correction.importance_sampling_threshold <= 0:
        _fail(f"{prefix}.importance_sampling_threshold", "must be > 0 (the upper bound on the ratio)")
    if (correction.importance_sampling_mode == "icepop"
            and not 0 < correction.importance_sampling_low <= correction.importance_sampling_threshold):
        _fail(f"{prefix}.importance_sampling_low", f"is {correction.importance_sampling_low}; icepop "
              "keeps ratios in [importance_sampling_low, importance_sampling_threshold], so it must "
              "be > 0 and <= importance_sampling_threshold")
    try:
        parse_rejection(correction.rejection, correction.rejection_low, correction.rejection_high,
                        correction.rejection_threshold)
    except ValueError as error:
        raise ConfigError(f"{prefix}.rejection: {error}") from None


def _check_openai_agent(rollout: RolloutConfig) -> None:
    agent = rollout.openai_agent
    if not 0 <= agent.port <= 65535:
        _fail("rollout.openai_agent.port", f"is {agent.port}; use 0 (a free port) or 1..65535")
    if not agent.served_model_name:
        _fail("rollout.openai_agent.served_model_name", "is empty; callers name it as `model`")
    if not agent.enable:
        return
    if ":" not in agent.agent:
        _fail("rollout.openai_agent.agent", f"is {agent.agent!r}; give the import path of the "
              "agent as 'package.module:function' (async def run(client, row))")
    if rollout.multi_turn.enable:
        _fail("rollout.openai_agent.enable", "and rollout.multi_turn.enable are both true; the "
              "openai agent runs its own tools, so set rollout.multi_turn.enable=false")


def _check_sampling(prefix: str, temperature: float, top_p: float, top_k: int) -> None:
    if 0 < temperature < TEMPERATURE_FLOOR:  # the engine would sample greedily, the actor not
        _fail(f"{prefix}.temperature", f"is {temperature}, below {TEMPERATURE_FLOOR:g}; use 0 for "
              f"greedy decoding or a temperature >= {TEMPERATURE_FLOOR:g}")
    if top_k == 0:
        _fail(f"{prefix}.top_k", f"is {top_k}; use -1 to disable top-k or a positive count")
