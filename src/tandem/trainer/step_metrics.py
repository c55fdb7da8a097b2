"""A step's metrics from what the step produced, as pure functions (no trainer state): rewards
and lengths of the real samples, batch-level entropy / KL / imbalance, rollout throughput,
version spread and token-weighted version lag, the async modes' merge over mini-batches and
their idle times."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from tandem import algorithms
from tandem.batch.balance import token_imbalance
from tandem.batch.padding import drop_padding_samples
from tandem.batch.trajectory import Trajectory
from tandem.rewards.scorer import FAILED
from tandem.rewards.served import BAD_VERDICT
from tandem.trainer import ppo


def trajectory_metrics(trajectories: list[Trajectory], prefix: str) -> dict[str, float]:
    """Mean reward (`reward/mean` or `<prefix>/reward`), accuracy, tool use, forks, splits, response
    length, turns and failed rewards of the non-padding trajectories; {} when there are none."""
    real = [t for t in trajectories if not t.is_padding]
    if not real:
        return {}
    count = len(real)
    metrics = {f"{prefix}/mean" if prefix == "reward" else f"{prefix}/reward":
               sum(t.reward or 0.0 for t in real) / count}
    accuracies = [t.reward_extra.get("acc") for t in real if "acc" in t.reward_extra]
    if accuracies:
        metrics[f"{prefix}/acc"] = sum(accuracies) / len(accuracies)
    tools = [t.metadata["tool_calls"] > 0 for t in real if "tool_calls" in t.metadata]
    if tools:
        metrics[f"{prefix}/tool_use"] = sum(tools) / len(tools)
    forked = [t.metadata["forks"] > 0 for t in real if "forks" in t.metadata]
    if forked:  # openai_agent: trajectories of sessions whose history did not extend (re-rendered)
        metrics[f"{prefix}/forked"] = sum(forked) / len(forked)
    split = [t.metadata["splits"] > 0 for t in real if "splits" in t.metadata]
    if split:  # openai_agent: samples of sessions whose next prompt did not extend their tokens
        metrics[f"{prefix}/split"] = sum(split) / len(split)
        metrics[f"{prefix}/split_samples"] = float(sum(t.metadata.get("continued_by") is not None
                                                       for t in real))
    metrics[f"{prefix}/response_length"] = sum(len(t.responses) for t in real) / count
    metrics[f"{prefix}/num_turns"] = sum(t.num_turns for t in real) / count
    metrics[f"{prefix}/failed_rewards"] = float(sum(t.reward_extra.get(FAILED, 0.0) for t in real))
    bad_verdicts = sum(t.reward_extra.get(BAD_VERDICT, 0.0) for t in real)
    if bad_verdicts:
        metrics[f"{prefix}/judge_bad_verdicts"] = float(bad_verdicts)
    for key in sorted({k for t in real for k in t.reward_extra if k.startswith("reward/")}):
        values = [t.reward_extra[key] for t in real if key in t.reward_extra]  # each function's share
        metrics[f"{prefix}/{key.split('/', 1)[1]}" if prefix == "reward" else f"{prefix}/{key}"] = \
            sum(values) / len(values)
    return metrics


def batch_metrics(trajectories: list[Trajectory], batches: list[TensorDict], n_devices: int,
                  mini_batch: int) -> dict[str, float]:
    """Reward, accuracy, lengths and turns of the real samples, then over the step's batches
    (several in separate_async): policy tokens per sample, token-mean entropy and reference KL,
    and the worst batch's data-parallel imbalance."""
    metrics = trajectory_metrics(trajectories, "reward")
    sums: dict[str, float] = {"samples": 0.0, "tokens": 0.0, "entropy": 0.0, "kl": 0.0}
    for batch in batches:
        real = drop_padding_samples(batch)
        mask = ppo.dense(real, "response_mask")
        sums["samples"] += mask.shape[0]
        sums["tokens"] += float(mask.sum())
        if "entropy" in real.keys():
            sums["entropy"] += float((ppo.dense(real, "entropy") * mask).sum())
        if "ref_log_prob" in real.keys():
            kl = algorithms.kl_penalty(ppo.dense(real, "old_log_probs"),
                                       ppo.dense(real, "ref_log_prob"), "k1", mask)
            sums["kl"] += float((kl * mask).sum())
        for key, value in token_imbalance(batch, n_devices, mini_batch).items():
            metrics[key] = max(metrics.get(key, 0.0), value)
    metrics["response/policy_tokens_mean"] = sums["tokens"] / max(sums["samples"], 1.0)
    if "entropy" in batches[0].keys():
        metrics["actor/entropy"] = sums["entropy"] / max(sums["tokens"], 1.0)
    if "ref_log_prob" in batches[0].keys():
        metrics["actor/ref_kl"] = sums["kl"] / max(sums["tokens"], 1.0)
    return metrics


def rollout_metrics(trajectories: list[Trajectory], phase_seconds: dict[str, float]
                    ) -> dict[str, float]:
    """The fraction of trajectories whose tokens span a sync (partial rollouts the resumable
    client finished), policy tokens per second (of generation in sync mode, else of the whole
    step) and, where the engine recorded kept sets (top-k / top-p with sampling-mask replay),
    their mean mass and log mass per sampled token (rollout/kept_mass, rollout/kept_log_mass:
    the log S by which truncation moves each processed logprob from the full softmax)."""
    spanning = sum(t.min_global_steps != t.max_global_steps for t in trajectories)
    generated = sum(int(t.response_mask.sum()) for t in trajectories)
    seconds = phase_seconds.get("generate") or sum(phase_seconds.values())
    metrics = {"rollout/cross_version_fraction": spanning / max(len(trajectories), 1),
               "throughput/generated_tokens_per_second": generated / max(seconds, 1e-9)}
    kept_tokens = sum(t.metadata.get("kept_tokens", 0) for t in trajectories)
    if kept_tokens:
        for name, key in (("kept_mass", "kept_mass_sum"), ("kept_log_mass", "kept_log_mass_sum")):
            metrics[f"rollout/{name}"] = sum(t.metadata.get(key, 0.0)
                                             for t in trajectories) / kept_tokens
    return metrics


def token_lag_metrics(trajectories: list[Trajectory], version: int) -> dict[str, float]:
    """Token-weighted staleness at training version `version` over the policy tokens of the real
    trajectories (lag = version - response_versions): staleness/token_lag_mean, _max,
    staleness/tokens_lag_<k> (the fraction of tokens at lag k) and staleness/policy_tokens (the
    count they are fractions of); {} when there are none."""
    lags = [version - t.response_versions[t.response_mask.bool()]
            for t in trajectories if not t.is_padding]
    lags = torch.cat(lags) if lags else torch.zeros(0, dtype=torch.long)
    if lags.numel() == 0:
        return {}
    metrics = {"staleness/token_lag_mean": float(lags.float().mean()),
               "staleness/token_lag_max": float(lags.max()),
               "staleness/policy_tokens": float(lags.numel())}
    values, counts = torch.unique(lags, return_counts=True)
    for lag, count in zip(values.tolist(), counts.tolist()):
        metrics[f"staleness/tokens_lag_{lag}"] = count / lags.numel()
    return metrics


def merge_mini_batch_metrics(parts: list[dict[str, float]]) -> dict[str, float]:
    """One record for a step's mini-batches: means, except maxima (lag_max), sums (buffer
    wait, policy tokens), token-weighted means of the token-lag fractions and the latest value
    of running totals."""
    merged = {key: sum(p.get(key, 0.0) for p in parts) / len(parts)
              for key in {key for p in parts for key in p}}
    tokens = sum(p.get("staleness/policy_tokens", 0.0) for p in parts)
    if tokens:
        for key in [k for k in merged if k == "staleness/token_lag_mean"
                    or k.startswith("staleness/tokens_lag_")]:
            merged[key] = sum(p.get(key, 0.0) * p.get("staleness/policy_tokens", 0.0)
                              for p in parts) / tokens
        merged["staleness/policy_tokens"] = tokens
    for key in ("staleness/lag_max", "staleness/version_spread_max", "staleness/token_lag_max"):
        if key in merged:
            merged[key] = max(p.get(key, 0.0) for p in parts)
    merged["buffer/wait_seconds"] = sum(p["buffer/wait_seconds"] for p in parts)
    if "buffer/admission_wait_seconds" in merged:
        merged["buffer/admission_wait_seconds"] = sum(p.get("buffer/admission_wait_seconds", 0.0)
                                                      for p in parts)
    for key in ("staleness/dropped_total", "staleness/regenerated_total"):
        merged[key] = parts[-1][key]
    return merged


def idle_metrics(phase_seconds: dict[str, float], backpressure_s: float,
                 sync_s: float) -> dict[str, float]:
    """Trainer idle = waiting for data; rollout idle = held back by a full buffer + paused by
    the sync; seconds and fractions of the step's wall time."""
    wall = max(sum(phase_seconds.values()), 1e-9)
    trainer_idle = phase_seconds.get("wait_rollout", 0.0)
    rollout_idle = min(backpressure_s + sync_s, wall)
    return {"idle/trainer_seconds": trainer_idle, "idle/trainer_fraction": trainer_idle / wall,
            "idle/rollout_seconds": rollout_idle, "idle/rollout_fraction": rollout_idle / wall}
