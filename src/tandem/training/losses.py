"""The loss callables TrainingEngine.update takes (micro-batch, forward outputs) -> (loss,
metrics): the actor's PPO clip with optional KL and entropy terms, the critic's clipped value loss.
They live beside the engine because the training workers run them; the trainer only picks them.
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict

from tandem import algorithms
from tandem.batch.jagged import padded_field
from tandem.config.schema import TandemConfig
from tandem.training.forward import ForwardOutput


def dense(batch: TensorDict, key: str) -> torch.Tensor:
    """A response-aligned field right-padded to [B, R_max] (float)."""
    return padded_field(batch[key], 0).float()


def actor_loss_fn(config: TandemConfig):
    """The actor's loss callable for TrainingEngine.update: PPO clip + optional KL and entropy."""
    actor = config.actor
    # seq-mean-token-sum-norm's constant divisor (verl's actor.loss_scale_factor)
    horizon = actor.loss_scale_factor or config.rollout.response_length

    def loss_fn(micro_batch: TensorDict, outputs: ForwardOutput) -> tuple[torch.Tensor, dict[str, Any]]:
        mask = dense(micro_batch, "loss_mask")
        log_probs = outputs.padded("log_probs")
        counts = dict(global_token_count=outputs.mini_batch.global_tokens,
                      global_seq_count=outputs.mini_batch.global_sequences, horizon=horizon)
        weights = dense(micro_batch, "importance_weights") if "importance_weights" in micro_batch.keys() else None
        policy = algorithms.ppo_clip_loss(log_probs, dense(micro_batch, "old_log_probs"),
                                          dense(micro_batch, "advantages"), mask, actor.clip_ratio_low,
                                          actor.clip_ratio_high, actor.clip_ratio_c, importance_weights=weights)
        loss = algorithms.aggregate_loss(policy.loss, mask, actor.loss_agg_mode, **counts)
        kl = None
        if actor.use_kl_loss:
            reference = dense(micro_batch, "ref_log_prob")
            loss = loss + actor.kl_loss_coef * algorithms.kl_loss(log_probs, reference, mask, actor.kl_loss_type,
                                                                  actor.loss_agg_mode, **counts)
            kl = algorithms.kl_penalty(log_probs.detach(), reference, actor.kl_loss_type, mask)
        entropy = outputs.padded("entropy") if outputs.entropy is not None else None
        if actor.entropy_coeff and entropy is not None:
            loss = loss + algorithms.entropy_bonus(entropy, mask, actor.entropy_coeff, actor.loss_agg_mode,
                                                   **counts)
        metrics = algorithms.policy_metrics(policy, mask, kl=kl, entropy=entropy)
        return loss, metrics

    return loss_fn


def critic_loss_fn(config: TandemConfig):
    """The critic's loss callable: clipped value loss, token-mean over the mini-batch's loss_mask
    (the same mask the engine counts global_tokens from)."""
    def loss_fn(micro_batch: TensorDict, outputs: ForwardOutput) -> tuple[torch.Tensor, dict[str, Any]]:
        mask = dense(micro_batch, "loss_mask")
        loss, clip_fraction = algorithms.clipped_value_loss(
            outputs.padded("values"), dense(micro_batch, "values"), dense(micro_batch, "returns"), mask,
            config.critic.cliprange_value)
        total = algorithms.aggregate_loss(loss, mask, "token-mean",
                                          global_token_count=outputs.mini_batch.global_tokens)
        return total, {"value_clip_fraction": float(clip_fraction)}

    return loss_fn
