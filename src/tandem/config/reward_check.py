"""Load-time checks of reward.model and reward.judge (the served rewards): what the config
accepts is what the fleet starts, and separate_async gives a served reward a pool of its own.
The numeric fields' ranges are ranges.py's (validate checks them first)."""

from __future__ import annotations

import re

from tandem.config.schema import TandemConfig


def served_reward_problem(config: TandemConfig) -> str | None:
    """The first served-reward setting that would not run as written, "field: why; fix"."""
    reward = config.reward
    for name, served in (("reward.model", reward.model), ("reward.judge", reward.judge)):
        if not served.enable:
            continue
        if not served.path:
            return (f"{name}.path: is empty but {name}.enable=true; give the model's HF directory "
                    f"(or {'tiny:reward' if name == 'reward.model' else 'tiny:qwen2'}), or set "
                    f"{name}.enable=false")
        if served.n_devices == 0 and config.model.device.startswith("cuda"):
            return (f"{name}.n_devices: is 0 (share the training workers' devices), which is "
                    "built for CPU only (the training worker holds its whole GPU); set "
                    f"{name}.n_devices >= 1 on cuda")
        if served.n_devices == 0 and config.trainer.trainer_mode == "separate_async":
            return (f"{name}.n_devices: is 0 (share the training workers' devices), but in "
                    "trainer_mode=separate_async the actor trains while generation goes on, so "
                    "scoring there would stall training and be stalled by it; give the served "
                    f"reward a resource pool of its own: set {name}.n_devices >= 1")
    judge = reward.judge
    if judge.enable:
        if "{response}" not in judge.prompt_template:
            return ("reward.judge.prompt_template: has no {response}, so the judge would never see "
                    "the reply it scores; put {response} (and {prompt}) in it")
        try:
            groups = re.compile(judge.verdict_pattern).groups
        except re.error as error:
            return f"reward.judge.verdict_pattern: is not a valid regex ({error}); fix it"
        if groups < 1:
            return ("reward.judge.verdict_pattern: has no group; wrap the verdict's number in "
                    "parentheses, e.g. SCORE:\\s*(\\d+)")
    return None
