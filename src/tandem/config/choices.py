"""The valid values of the config's choice fields, and the error every bad config raises.

The lowest layer of tandem: modules anywhere may import these. `choice_problem` checks every
field of CHOICES (a list field element by element) when a config is loaded.
"""

from __future__ import annotations

from typing import Any

TRAINER_MODES = ("sync", "colocate_async", "separate_async")
LOGPROBS_MODES = ("raw", "processed")
IN_FLIGHT_KV = ("recompute", "keep")
# how an engine admits requests: auto = kv for the native engine, the engine's own otherwise;
# kv = while the admitted sequences' worst-case KV fits (native only); fixed = while blocks for
# the prompt are free (preempting and recomputing when they run out later)
ADMISSION = ("auto", "kv", "fixed")
# how a prefill/decode replica moves KV blocks: a copy inside the process, or Mooncake's engine
KV_TRANSFERS = ("in_process", "shm", "mooncake", "nixl")  # nixl: vLLM's NixlConnector only
LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                  "seq-mean-token-sum-norm")
ADV_ESTIMATORS = ("grpo", "gae")
# KL estimators and their verl aliases; "+" = the estimator's value with k2's gradient.
KL_ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}
KL_BASE_TYPES = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")
KL_TYPES = KL_BASE_TYPES + tuple(f"{name}+" for name in KL_BASE_TYPES)
KL_CONTROLLERS = ("fixed", "adaptive")
TRUNCATE_SIDES = ("left", "right", "middle")
CORRECTION_LEVELS = ("none", "token", "sequence")
IMPORTANCE_SAMPLING_MODES = ("truncate", "icepop")
REWARD_PLACEMENTS = ("agent_loop", "after_sampling")
ENVIRONMENT_KINDS = ("", "verifiers", "gym")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
DTYPES = tuple(DTYPE_BYTES)
LR_SCHEDULES = ("constant", "cosine")
# what the async modes do about staleness: wait = bound it at admission (nothing is dropped);
# drop | regenerate = discard or redraw a finished group over the bound (biased against length)
STALE_POLICIES = ("wait", "drop", "regenerate")
NONFINITE_LOSS_POLICIES = ("skip", "stop")
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
# logger name -> the module its client needs (the preflight checks it is installed)
LOGGER_PACKAGES = {"console": None, "jsonl": None, "tensorboard": "tensorboard", "wandb": "wandb",
                   "mlflow": "mlflow"}

# field -> its valid values (rollout.name and rollout.checkpoint_engine.backend are names in
# registries: the preflight checks them; the KL fields have a message of their own)
CHOICES: dict[str, tuple[str, ...]] = {
    "model.dtype": DTYPES,
    "rollout.logprobs_mode": LOGPROBS_MODES,
    "rollout.in_flight_kv": IN_FLIGHT_KV,
    "rollout.admission": ADMISSION,
    "rollout.disaggregation.kv_transfer": KV_TRANSFERS,
    "rollout.multi_turn.tool_response_truncate_side": TRUNCATE_SIDES,
    "rollout.environment.kind": ENVIRONMENT_KINDS,
    "actor.loss_agg_mode": LOSS_AGG_MODES,
    "actor.optim.schedule": LR_SCHEDULES,
    "critic.optim.schedule": LR_SCHEDULES,
    "algorithm.adv_estimator": ADV_ESTIMATORS,
    "algorithm.kl_ctrl.type": KL_CONTROLLERS,
    "algorithm.rollout_correction.importance_sampling": CORRECTION_LEVELS,
    "algorithm.rollout_correction.importance_sampling_mode": IMPORTANCE_SAMPLING_MODES,
    "reward.placement": REWARD_PLACEMENTS,
    "trainer.trainer_mode": TRAINER_MODES,
    "trainer.loggers": tuple(LOGGER_PACKAGES),
    "trainer.resume_missing": ("warn", "fail"),
    "trainer.on_nonfinite_loss": NONFINITE_LOSS_POLICIES,
    "trainer.placement_strategy": PLACEMENT_STRATEGIES,
    "trainer.async_rollout.on_stale": STALE_POLICIES,
}


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and the fix."""


def choice_problem(config: Any) -> str | None:
    """The first field of CHOICES holding a value outside its choices, "field: why", or None."""
    for path, valid in CHOICES.items():
        value = config
        for part in path.split("."):
            value = getattr(value, part)
        for item in value if isinstance(value, list) else [value]:
            if item not in valid:
                return unknown_value(path, item, valid)
    return None


def unknown_value(field: str, value: Any, valid: tuple[str, ...]) -> str:
    """The message for a value outside a field's choices."""
    return f"{field}: unknown value {value!r}; valid values are {', '.join(valid)}"
