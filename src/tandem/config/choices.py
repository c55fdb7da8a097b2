"""The valid values of the config's choice fields, and the error every bad config raises.

The lowest layer of tandem: modules anywhere may import these without importing the loader
(load.py), which consults the registries of the layers above.
"""

from __future__ import annotations

TRAINER_MODES = ("sync", "colocate_async", "separate_async")
LOGPROBS_MODES = ("raw", "processed")
IN_FLIGHT_KV = ("recompute", "keep")
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
DTYPES = ("float32", "bfloat16", "float16")
LR_SCHEDULES = ("constant", "cosine")
# what the async modes do about staleness: wait = bound it at admission (nothing is dropped);
# drop | regenerate = discard or redraw a finished group over the bound (biased against length)
STALE_POLICIES = ("wait", "drop", "regenerate")
NONFINITE_LOSS_POLICIES = ("skip", "stop")
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and the fix."""
