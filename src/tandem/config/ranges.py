"""The allowed range of every numeric config field, checked when a config is loaded.

One table, interval notation: "[0, 1)" is 0 <= x < 1, "(0, inf)" is x > 0. NaN is outside every
range and so is inf (no bound is closed at infinity). A list field (betas) is checked element by
element. tests/reliability/test_config_ranges.py fails when a numeric field has no entry here.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any, Iterator

RANGES: dict[str, str] = {
    "rollout.prompt_length": "[1, inf)",
    "rollout.response_length": "[1, inf)",
    "rollout.temperature": "[0, inf)",  # 0 is greedy; (0, 1e-5) is refused in rollout_check.py
    "rollout.top_p": "(0, 1]",
    "rollout.top_k": "[-1, inf)",  # -1 is off; 0 is refused in rollout_check.py
    "rollout.n": "[1, inf)",
    "rollout.tensor_model_parallel_size": "[1, inf)",
    "rollout.data_parallel_size": "[1, inf)",
    "rollout.pipeline_model_parallel_size": "[1, inf)",
    "rollout.max_num_batched_tokens": "[1, inf)",
    "rollout.max_num_seqs": "[1, inf)",
    "rollout.gpu_memory_utilization": "(0, 1]",
    "rollout.kv_cache_memory_bytes": "[0, inf)",
    "rollout.block_size": "[1, inf)",
    "rollout.lora_rank": "[0, inf)",  # derived from actor.lora.rank
    "rollout.seed": "[0, 9223372036854775807]",  # an int64: torch and numpy seeds
    "rollout.agent_concurrency": "[1, inf)",
    "rollout.environment.reward_weight": "(-inf, inf)",  # finite, like reward.weights
    "rollout.elastic.auto.min_replicas": "[1, inf)",
    "rollout.elastic.auto.max_replicas": "[0, inf)",  # 0: what the rollout devices hold
    "rollout.elastic.auto.grow_above": "(0, 1]",  # 1: never grows (a fraction is at most 1)
    "rollout.elastic.auto.shrink_above": "(0, 1]",  # 1: never shrinks
    "rollout.fault_tolerance.max_restarts": "[0, inf)",  # 0: the first failure ends the run
    "rollout.fault_tolerance.health_interval_s": "(0, inf)",
    "rollout.torch_threads": "[0, inf)",  # 0: auto
    "rollout.nnodes": "[0, inf)",
    "rollout.n_gpus_per_node": "[0, inf)",
    "rollout.val_kwargs.n": "[1, inf)",
    "rollout.val_kwargs.temperature": "[0, inf)",
    "rollout.val_kwargs.top_p": "(0, 1]",
    "rollout.val_kwargs.top_k": "[-1, inf)",
    "rollout.disaggregation.prefill_tensor_parallel_size": "[1, inf)",
    "rollout.disaggregation.prefill_replicas": "[1, inf)",
    "rollout.disaggregation.decode_tensor_parallel_size": "[1, inf)",
    "rollout.disaggregation.decode_replicas": "[1, inf)",
    "rollout.checkpoint_engine.update_weights_bucket_megabytes": "[1, inf)",
    "rollout.checkpoint_engine.timeout_s": "(0, inf)",  # the deadline of every wait of a weight sync
    "trainer.timeout_s": "(0, inf)",  # engine start, control calls, training collectives
    "trainer.worker_timeout_s": "(0, inf)",  # each call to the training workers
    "rollout.openai_agent.port": "[0, 65535]",  # 0: a free port
    "rollout.openai_agent.max_request_bytes": "[1024, inf)",
    "rollout.multi_turn.max_assistant_turns": "[1, inf)",
    "rollout.multi_turn.max_user_turns": "[1, inf)",
    "rollout.multi_turn.max_tool_response_length": "[1, inf)",
    "rollout.multi_turn.max_tool_calls_per_turn": "[1, inf)",
    "rollout.multi_turn.tool_timeout_seconds": "(0, inf)",
    "reward.timeout_seconds": "(0, inf)",
    "reward.weights": "(-inf, inf)",  # finite; a negative weight penalises
    "reward.rule_weight": "(-inf, inf)",  # finite; 0 leaves the rule reward out
    "reward.model.weight": "(-inf, inf)",
    "reward.model.n_devices": "[0, inf)",  # 0: share the training workers' bundle
    "reward.model.torch_threads": "[1, inf)",
    "reward.model.max_batch_size": "[1, inf)",
    "reward.model.max_length": "[1, inf)",
    "reward.judge.weight": "(-inf, inf)",
    "reward.judge.n_devices": "[0, inf)",
    "reward.judge.torch_threads": "[1, inf)",
    "reward.judge.score_scale": "(-inf, inf)",
    "reward.judge.max_new_tokens": "[1, inf)",
    "reward.judge.prompt_length": "[1, inf)",
    "reward.judge.kv_cache_memory_bytes": "[1, inf)",
    "actor.ppo_mini_batch_size": "[1, inf)",
    "actor.ppo_epochs": "[1, inf)",
    "actor.ppo_max_token_len_per_micro_batch": "[1, inf)",
    "actor.micro_batch_memory_gb": "[0, inf)",  # 0: off
    "actor.torch_threads": "[0, inf)",  # 0: auto
    "actor.lora.rank": "[0, inf)",  # 0: off
    "actor.lora.alpha": "(0, inf)",
    "actor.lora.dropout": "[0, 1)",
    "actor.clip_ratio_low": "[0, 1)",  # the ratio's lower clip 1 - low must stay > 0
    "actor.clip_ratio_high": "[0, inf)",
    "actor.clip_ratio_c": "(1, inf)",  # dual clip
    "actor.entropy_coeff": "[0, inf)",
    "actor.kl_loss_coef": "[0, inf)",
    "actor.fsdp_size": "[1, inf)",
    "critic.ppo_epochs": "[1, inf)",
    "critic.cliprange_value": "(0, inf)",
    "data.train_batch_size": "[1, inf)",
    "data.seed": "[0, 9223372036854775807]",  # an int64: torch and numpy seeds
    "algorithm.gamma": "[0, 1]",
    "algorithm.lam": "[0, 1]",
    "algorithm.kl_ctrl.kl_coef": "[0, inf)",
    "algorithm.kl_ctrl.target_kl": "(0, inf)",
    "algorithm.kl_ctrl.horizon": "[1, inf)",  # the adaptive controller divides by it
    "algorithm.rollout_correction.importance_sampling_threshold": "(0, inf)",
    "algorithm.rollout_correction.importance_sampling_low": "[0, inf)",
    "algorithm.rollout_correction.rejection_low": "(0, 1]",
    "algorithm.rollout_correction.rejection_high": "[1, inf)",
    "algorithm.overlong.buffer_len": "[0, inf)",  # at most rollout.response_length (training_check)
    "algorithm.overlong.penalty_factor": "[0, inf)",
    "algorithm.filter_groups.max_gen_batches": "[1, inf)",
    "trainer.total_steps": "[0, inf)",
    "trainer.test_freq": "[0, inf)",
    "trainer.save_freq": "[0, inf)",
    "trainer.seed": "[0, 9223372036854775807]",  # an int64: torch and numpy seeds
    "trainer.n_devices": "[1, inf)",
    "trainer.separate_async.parameter_sync_step": "[1, inf)",
    "trainer.separate_async.spill_below_groups": "[0, inf)",  # 0: actor.ppo_mini_batch_size
    "trainer.async_rollout.max_staleness": "[0, inf)",
    "trainer.async_rollout.buffer_groups": "[0, inf)",  # 0: 2 x data.train_batch_size
}
for _role in ("actor", "critic"):
    RANGES.update({
        f"{_role}.optim.lr": "[0, inf)",
        f"{_role}.optim.weight_decay": "[0, inf)",
        f"{_role}.optim.betas": "[0, 1)",  # each of the two
        f"{_role}.optim.warmup_steps": "[0, inf)",
        f"{_role}.optim.min_lr_ratio": "[0, 1]",
        f"{_role}.optim.grad_clip": "(0, inf)",  # <= 0 would zero or flip every gradient
    })


def numeric_fields(cls: type, prefix: str = "") -> Iterator[str]:
    """Dotted paths of every int, float and list-of-float field under a config dataclass."""
    hints = typing.get_type_hints(cls)
    for item in dataclasses.fields(cls):
        hint, path = hints[item.name], f"{prefix}{item.name}"
        if dataclasses.is_dataclass(hint):
            yield from numeric_fields(hint, path + ".")
        elif hint in (int, float) or hint == list[float]:
            yield path


def out_of_range(config: Any) -> str | None:
    """"field: is value; it must be ..." for the first field outside its range, else None."""
    for path, interval in RANGES.items():
        value = _get(config, path)
        values = value if isinstance(value, (list, tuple)) else [value]
        for item in values:
            if not _inside(item, interval):
                where = "every element " if isinstance(value, (list, tuple)) else ""
                finite = "" if _finite(item) else "finite and "
                return f"{path}: is {value}; {where}must be {finite}{describe(interval)}"
        if path.endswith(".betas") and len(values) != 2:
            return f"{path}: is {value}; give two values [beta1, beta2]"
    return None


def describe(interval: str) -> str:
    """">= 1", "> 0" or "in [0, 1)"."""
    low, high = _bounds(interval)
    if high == math.inf:
        return f"{'>' if interval[0] == '(' else '>='} {low:g}"
    if isinstance(high, int) and high > 10**6:
        return f"an integer in [{low:g}, 2**63 - 1]" if high == 2**63 - 1 else f"in {interval}"
    return f"in {interval}"


def _bounds(interval: str) -> tuple[float, float]:
    low, high = interval[1:-1].split(",")
    return _number(low), _number(high)


def _number(text: str) -> float:
    """An int bound stays an int, so 2**63 - 1 compares exactly (as a float it is 2**63)."""
    text = text.strip()
    return int(text) if text.lstrip("-").isdigit() else float(text)


def _inside(value: Any, interval: str) -> bool:
    low, high = _bounds(interval)
    above = value > low if interval[0] == "(" else value >= low
    below = value < high if interval[-1] == ")" else value <= high
    return bool(above and below) and _finite(value)


def _finite(value: Any) -> bool:
    return isinstance(value, int) or math.isfinite(value)  # a huge int overflows isfinite


def _get(config: Any, path: str) -> Any:
    for part in path.split("."):
        config = getattr(config, part)
    return config
