"""The training engine: one HF model as actor, frozen reference or critic, with its optimizer.

One engine per data-parallel rank; each rank gets its own shard of the batch. Gradients of a
mini-batch are accumulated over micro-batches cut by a token budget. The loss callable returns
its micro-batch's *share* of the mini-batch loss, normalised by the mini-batch totals in
`outputs.mini_batch` (e.g. token-mean: sum(loss * mask) / global_tokens), so the gradient does
not depend on how the mini-batch was cut, nor on the number of ranks.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from tensordict import TensorDict

from tandem.algorithms.aggregation import loss_normalizers
from tandem.batch.jagged import field_lengths, padded_field, select_samples
from tandem.batch.layouts import prompt_groups
from tandem.config.schema import LoraConfig, OptimConfig, TandemConfig
from tandem.training import checkpoint
from tandem.training.export import LocalShard, iter_full_weights, iter_local_shards
from tandem.training.forward import ForwardOutput, MiniBatchInfo, actor_forward, critic_forward
from tandem.training.fsdp import all_reduce, dp_rank_and_size, shard_model
from tandem.training.lm_head import plain_linear_head
from tandem.training.lora import (apply_lora, is_lora_model, iter_adapter_weights, save_adapter,
                                  save_merged)
from tandem.training.memory_budget import micro_batch_token_budget
from tandem.training.micro_batches import split_by_token_budget, split_into
from tandem.training.optim import build_lr_scheduler, build_optimizer, take_config_settings
from tandem.training.packed_attention import uses_packed_sdpa

logger = logging.getLogger(__name__)
ROLES = ("actor", "reference", "critic")
LossFn = Callable[[TensorDict, ForwardOutput], tuple[torch.Tensor, dict[str, float]]]


class NonFiniteLossError(RuntimeError):
    """A mini-batch's loss was NaN or inf and trainer.on_nonfinite_loss=stop."""


class TrainingEngine:
    """Actor, reference or critic over an HF model; `optim=None` makes it frozen (inference only)."""

    def __init__(self, model: torch.nn.Module, role: str, max_token_len: int, use_remove_padding: bool = True,
                 optim: OptimConfig | None = None, total_steps: int | None = None, device: str = "cpu",
                 on_nonfinite_loss: str = "skip", share_prompts: bool = True,
                 lora: LoraConfig | None = None, freeze_vision_tower: bool = False):
        """on_nonfinite_loss: "skip" drops a step whose loss is NaN/inf, "stop" raises;
        share_prompts: packed forwards compute a prompt shared by several samples once;
        lora (rank > 0, actor only): train peft adapters only, the base weights frozen;
        freeze_vision_tower: a VLM's vision tower is not trained (`frozen_names`)."""
        if role not in ROLES:
            raise ValueError(f"TrainingEngine role={role!r}: use one of {ROLES}")
        if role == "reference" and optim is not None:
            raise ValueError("TrainingEngine role='reference' is frozen: pass optim=None")
        self.role, self.max_token_len, self.use_remove_padding = role, max_token_len, use_remove_padding
        self.on_nonfinite_loss, self.share_prompts = on_nonfinite_loss, share_prompts
        self.save_merged = bool(lora is not None and lora.rank and lora.save_merged)
        self.device = device
        self.rank, self.dp_size = dp_rank_and_size()
        if lora is not None and lora.rank:
            if role != "actor":
                raise ValueError(f"TrainingEngine role={role!r}: LoRA adapters are the actor's")
            model = apply_lora(model, lora)
        model = model.to(device)
        # weights that never change: a sync may leave them out (export_weights(include_frozen))
        self.frozen_names: set[str] = set()
        if freeze_vision_tower:
            from tandem.training.vision_inputs import vision_tower_names

            self.frozen_names = vision_tower_names(model)
            for name, parameter in model.named_parameters():
                if name in self.frozen_names:
                    parameter.requires_grad_(False)
        if optim is None:
            model.requires_grad_(False)
        self.model = shard_model(model, device) if self.dp_size > 1 else model
        self.optim_config = optim
        self.optimizer = build_optimizer(self.model.parameters(), optim) if optim is not None else None
        self.scheduler = build_lr_scheduler(self.optimizer, optim, total_steps) if optim is not None else None
        self.global_step = 0  # optimizer steps taken

    @classmethod
    def from_config(cls, config: TandemConfig, role: str, total_steps: int | None = None,
                    attn_implementation: str | None = None) -> "TrainingEngine":
        """Load model.path as the actor, the reference (frozen copy) or the critic (value head).
        The attention defaults to `packed_sdpa` (per-sequence attention in packed forwards)."""
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

        from tandem.models.tiny import resolve_model_path
        from tandem.multimodal import is_vision_model
        from tandem.training import packed_attention
        from tandem.training.critic import ValueModel

        attn_implementation = attn_implementation or packed_attention.register()
        path = resolve_model_path(config.model.path)
        dtype = getattr(torch, config.model.dtype)
        _, world_size = dp_rank_and_size()
        if config.actor.fsdp_size != world_size:
            raise ValueError(f"actor.fsdp_size={config.actor.fsdp_size} but this process group has "
                             f"{world_size} rank(s); start one engine per rank after "
                             "training.fsdp.init_process_group, or set actor.fsdp_size=1")
        if role == "critic":
            model = ValueModel.from_pretrained(path, dtype, attn_implementation, seed=config.trainer.seed)
            optim = config.critic.optim
        else:
            kind = AutoModelForImageTextToText if is_vision_model(path) else AutoModelForCausalLM
            model = kind.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation)
            optim = config.actor.optim if role == "actor" else None
        # an FSDP-sharded or non-linear head takes the full logits path (forward.actor_forward)
        full_logits = role != "critic" and (world_size > 1 or plain_linear_head(model) is None)
        max_token_len = micro_batch_token_budget(config, model.config.get_text_config().to_dict(),
                                                 full_logits)
        if role == "actor" and config.actor.micro_batch_memory_gb and dp_rank_and_size()[0] == 0:
            logger.info("actor micro-batches: at most %d tokens (actor.micro_batch_memory_gb=%g, "
                        "actor.ppo_max_token_len_per_micro_batch=%d)", max_token_len,
                        config.actor.micro_batch_memory_gb, config.actor.ppo_max_token_len_per_micro_batch)
        return cls(model, role, max_token_len, config.actor.use_remove_padding,
                   optim, total_steps, config.model.device, config.trainer.on_nonfinite_loss,
                   config.actor.share_prompts, config.actor.lora if role == "actor" else None,
                   role == "actor" and config.actor.freeze_vision_tower)

    @property
    def uses_lora(self) -> bool:
        """Whether this engine trains LoRA adapters (its exports are then adapter-only)."""
        return is_lora_model(self.model)

    # ---- forward passes -------------------------------------------------------------------

    def _forward(self, batch: TensorDict, temperature: float, calculate_entropy: bool,
                 entropy_grad: bool = True) -> ForwardOutput:
        if self.role == "critic":
            return critic_forward(self.model, batch, self.use_remove_padding, self.share_prompts)
        return actor_forward(self.model, batch, self.use_remove_padding, temperature, calculate_entropy,
                             entropy_grad, share_prompts=self.share_prompts)

    def _micro_batches(self, batch: TensorDict, max_token_len: int | None) -> list[torch.Tensor]:
        shared = self.share_prompts and self.use_remove_padding and uses_packed_sdpa(self.model)
        groups = split_by_token_budget(field_lengths(batch["input_ids"]), max_token_len or self.max_token_len,
                                       prompt_groups(batch) if shared else None)
        if self.dp_size > 1:  # every rank must run as many forwards as the busiest one
            groups = split_into(groups, int(all_reduce([len(groups)], op="max")[0]))
        return groups

    @torch.no_grad()
    def compute_log_prob(self, batch: TensorDict, temperature: float = 1.0,
                         calculate_entropy: bool = False) -> ForwardOutput:
        """Response log-probs (old_log_probs for the actor, ref_log_prob for the reference): [B, R_i]."""
        if self.role == "critic":
            raise ValueError("compute_log_prob is for the actor and reference; use compute_values on a critic")
        return self._inference(batch, temperature, calculate_entropy)

    @torch.no_grad()
    def compute_values(self, batch: TensorDict) -> ForwardOutput:
        """The critic's values for each response token: outputs.values [sum R_i]."""
        if self.role != "critic":
            raise ValueError(f"compute_values needs role='critic', this engine is {self.role!r}")
        return self._inference(batch, 1.0, False)

    @torch.no_grad()
    def compute_ref_log_prob(self, batch: TensorDict, temperature: float = 1.0) -> ForwardOutput:
        """ref_log_prob of a LoRA actor: the same forward with its adapters disabled (the
        frozen base model, no second copy): [B, R_i]."""
        if not self.uses_lora:
            raise ValueError("compute_ref_log_prob needs a LoRA actor; without adapters use a "
                             "separate reference engine")
        with self.model.disable_adapter():
            return self._inference(batch, temperature, False)

    def _inference(self, batch: TensorDict, temperature: float, calculate_entropy: bool) -> ForwardOutput:
        self.model.eval()
        groups = self._micro_batches(batch, None)
        outputs = [self._forward(select_samples(batch, group), temperature, calculate_entropy) for group in groups]
        return _merge_outputs(groups, outputs, field_lengths(batch["responses"]))

    # ---- training -------------------------------------------------------------------------

    def accumulate_gradients(self, batch: TensorDict, loss_fn: LossFn, temperature: float = 1.0,
                             calculate_entropy: bool = False, max_token_len: int | None = None,
                             on_policy: list[tuple[torch.Tensor, ForwardOutput]] | None = None
                             ) -> dict[str, float]:
        """Zero the gradients, then forward + backward every micro-batch of this mini-batch. With
        `on_policy` (a list to fill) each micro-batch's old_log_probs are its own forward's,
        detached (ratio exactly 1), and (index group, detached outputs) pairs are appended."""
        if self.optimizer is None:
            raise ValueError(f"the {self.role} engine is frozen (no optimizer); it cannot train")
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        local_tokens, local_sequences = loss_normalizers(padded_field(batch["loss_mask"]))
        tokens, sequences, processed = all_reduce([float(local_tokens), float(local_sequences),
                                                   float(field_lengths(batch["input_ids"]).sum())])
        info = MiniBatchInfo(global_tokens=tokens, global_sequences=int(sequences), dp_size=self.dp_size)
        started = time.perf_counter()
        total_loss = 0.0
        weighted: dict[str, float] = defaultdict(float)  # metric x its micro-batch's loss tokens
        for group in self._micro_batches(batch, max_token_len):
            micro_batch = select_samples(batch, group)
            # on-policy: the entropy is returned with the old log-probs; without gradient unless asked
            outputs = self._forward(micro_batch, temperature, calculate_entropy or on_policy is not None,
                                    entropy_grad=calculate_entropy)
            outputs.mini_batch = info
            # the forward lays out host fields; the loss reads them beside the device outputs
            loss_batch = micro_batch.to(self.device)
            if on_policy is not None:
                detached = _detached(outputs)
                loss_batch["old_log_probs"] = detached.field("log_probs")
                on_policy.append((group, detached))
            loss, metrics = loss_fn(loss_batch, outputs)
            # FSDP averages gradients over ranks; the loss is already a share of the global total
            (loss * self.dp_size).backward()
            total_loss += float(loss.detach())
            micro_tokens = float(padded_field(micro_batch["loss_mask"]).bool().sum())
            for key, value in metrics.items():
                weighted[key] += float(value) * micro_tokens
        elapsed = max(all_reduce([time.perf_counter() - started], op="max")[0], 1e-9)
        # Token-weighted over micro-batches and ranks: padding-only micro-batches weigh nothing.
        keys = sorted(weighted)
        sums = all_reduce([weighted[key] for key in keys]) if keys else []
        result = {key: value / tokens if tokens else 0.0 for key, value in zip(keys, sums)}
        result.update({"loss": all_reduce([total_loss])[0], "tokens_per_second": processed / elapsed,
                       "global_tokens": tokens})
        return {f"{self.role}/{key}": value for key, value in result.items()}

    def optimizer_step(self, loss_finite: bool = True) -> dict[str, float]:
        """Clip the gradient norm, step (skipped if the loss or the norm is not finite), advance
        the schedule."""
        if self.optimizer is None or self.scheduler is None or self.optim_config is None:
            raise ValueError(f"the {self.role} engine is frozen (no optimizer); it cannot step")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.optim_config.grad_clip)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        grad_norm = float(grad_norm)
        learning_rate = self.scheduler.get_last_lr()[0]
        finite = loss_finite and bool(torch.isfinite(torch.tensor(grad_norm)))
        if finite:
            self.optimizer.step()
        self.scheduler.step()
        self.global_step += 1
        return {f"{self.role}/grad_norm": grad_norm, f"{self.role}/lr": learning_rate,
                f"{self.role}/step_skipped": float(not finite)}

    def train_mini_batch(self, batch: TensorDict, loss_fn: LossFn, temperature: float = 1.0,
                         calculate_entropy: bool = False,
                         on_policy: list[tuple[torch.Tensor, ForwardOutput]] | None = None) -> dict[str, float]:
        """One optimizer step on this mini-batch; returns its metrics (loss, grad norm, lr, tokens/s)."""
        metrics = self.accumulate_gradients(batch, loss_fn, temperature, calculate_entropy, on_policy=on_policy)
        if metrics[f"{self.role}/global_tokens"] == 0:
            # Only padding samples: no gradient, so no optimizer or schedule step either (AdamW
            # momentum and weight decay would still move the weights).
            metrics[f"{self.role}/step_skipped"] = 1.0
            return metrics
        # The loss is summed over ranks, so every rank takes the same decision.
        loss_finite = bool(torch.isfinite(torch.tensor(metrics[f"{self.role}/loss"])))
        if not loss_finite and self.on_nonfinite_loss == "stop":
            raise NonFiniteLossError(
                f"the {self.role} loss is {metrics[f'{self.role}/loss']} at optimizer step "
                f"{self.global_step}; stopped by trainer.on_nonfinite_loss=stop before the "
                "weights changed (the last checkpoint is intact). Set it to skip to drop such steps")
        metrics.update(self.optimizer_step(loss_finite))
        metrics[f"{self.role}/nonfinite_loss"] = float(not loss_finite)
        return metrics

    def update(self, batch: TensorDict, loss_fn: LossFn, mini_batch_size: int, epochs: int = 1,
               temperature: float = 1.0, calculate_entropy: bool = False) -> dict[str, float]:
        """`epochs` passes over this rank's batch in order, one optimizer step per mini-batch of
        mini_batch_size trajectories over all ranks (this rank takes 1/dp_size of it); returns
        metric means."""
        if mini_batch_size % self.dp_size:
            raise ValueError(f"mini_batch_size={mini_batch_size} does not split over {self.dp_size} "
                             "data-parallel ranks; choose a multiple of actor.fsdp_size")
        local = mini_batch_size // self.dp_size
        size = batch.batch_size[0]
        if size % local:
            raise ValueError(f"this rank's {size} samples are not a multiple of its mini-batch of {local}; "
                             "pad the batch with batch.padding.pad_to_multiple first")
        collected: dict[str, list[float]] = defaultdict(list)
        for _ in range(epochs):
            for start in range(0, size, local):
                mini_batch = select_samples(batch, torch.arange(start, start + local))
                metrics = self.train_mini_batch(mini_batch, loss_fn, temperature, calculate_entropy)
                if metrics[f"{self.role}/global_tokens"] == 0:
                    continue  # an all-padding mini-batch says nothing about the policy
                for key, value in metrics.items():
                    collected[key].append(value)
        if not collected:  # every token was masked out (padding, rollout rejection): no step
            return {f"{self.role}/global_tokens": 0.0, f"{self.role}/step_skipped": 1.0}
        return {key: sum(values) / len(values) for key, values in collected.items()}

    def update_on_policy(self, batch: TensorDict, loss_fn: LossFn, temperature: float = 1.0,
                         calculate_entropy: bool = False) -> tuple[dict[str, float], ForwardOutput]:
        """One optimizer step on this rank's whole batch whose old_log_probs come from that step's
        own forward; returns the metrics and those log-probs with the entropy, detached, in batch
        order."""
        if "old_log_probs" in batch.keys():
            raise ValueError("update_on_policy computes old_log_probs itself; this batch already "
                             "has them: call update() instead")
        groups: list[tuple[torch.Tensor, ForwardOutput]] = []
        metrics = self.train_mini_batch(batch, loss_fn, temperature, calculate_entropy, on_policy=groups)
        merged = _merge_outputs([g for g, _ in groups], [o for _, o in groups], field_lengths(batch["responses"]))
        return metrics, merged

    # ---- weights and checkpoints ----------------------------------------------------------

    def export_weights(self, include_frozen: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """(hf_name, full tensor) one at a time; a collective under FSDP (all ranks drain it).
        With LoRA only the adapter travels (training/lora.py's stream); without
        `include_frozen` the weights that never change (`frozen_names`) stay behind."""
        if self.uses_lora:
            return iter_adapter_weights(self.model)
        stream = iter_full_weights(self.model)
        if include_frozen or not self.frozen_names:
            return stream
        return ((name, tensor) for name, tensor in stream if name not in self.frozen_names)

    @property
    def leaves_weights_out(self) -> bool:
        """Whether export_weights(include_frozen=False) leaves weights out (frozen, no LoRA)."""
        return bool(self.frozen_names) and not self.uses_lora

    def export_local_shards(self) -> Iterator[LocalShard]:
        """This rank's shards, without communication."""
        return iter_local_shards(self.model)

    def save_checkpoint(self, directory: str | Path, extra: dict[str, Any] | None = None) -> Path:
        """Weights, optimizer, scheduler, step and RNG; every rank calls it. A LoRA actor also
        writes adapter/ (peft's format) and, with lora.save_merged, merged/ (a plain HF model)."""
        path = checkpoint.save_checkpoint(directory, self.model, self.optimizer, self.scheduler,
                                          self.global_step, extra)
        if self.uses_lora:
            base = getattr(self.model.get_base_model().config, "_name_or_path", None)
            with checkpoint.full_disk_named(path):
                save_adapter(self.model, path / "adapter", base)
                if self.save_merged:
                    save_merged(self.model, path / "merged")
        return path

    def load_checkpoint(self, directory: str | Path) -> dict[str, Any]:
        """Resume from save_checkpoint's directory; returns its extra dict. The optimizer's lr,
        betas and weight decay are the config's, not the checkpoint's (a change is logged)."""
        state = checkpoint.load_checkpoint(directory, self.model, self.optimizer, self.scheduler)
        self.global_step = state["step"]
        if self.optimizer is not None:
            changed = take_config_settings(self.optimizer, self.scheduler, self.optim_config)
            if changed and self.rank == 0:
                logger.warning("%s resumed from %s with the config's optimizer settings, not the "
                               "checkpoint's: %s", self.role, directory, ", ".join(
                                   f"{self.role}.optim.{key} {old} -> {new}"
                                   for key, (old, new) in changed.items()))
        return state["extra"]


def _detached(outputs: ForwardOutput) -> ForwardOutput:
    """The log-probs and entropy of a forward, cut from the graph."""
    return ForwardOutput(response_lengths=outputs.response_lengths,
                         log_probs=outputs.log_probs.detach(),
                         entropy=outputs.entropy.detach() if outputs.entropy is not None else None)


def _merge_outputs(groups: list[torch.Tensor], outputs: list[ForwardOutput],
                   response_lengths: torch.Tensor) -> ForwardOutput:
    """Put micro-batch outputs back into the batch's sample order."""
    count = sum(group.numel() for group in groups)
    merged = ForwardOutput(response_lengths=response_lengths)
    for name in ("log_probs", "entropy", "values"):
        pieces = [getattr(out, name) for out in outputs]
        if pieces[0] is None:
            continue
        per_sample: list[torch.Tensor] = [None] * count  # type: ignore[list-item]
        for out, group, values in zip(outputs, groups, pieces):
            for index, sample_values in zip(group.tolist(), values.split(out.response_lengths.tolist())):
                per_sample[index] = sample_values
        setattr(merged, name, torch.cat(per_sample) if per_sample else pieces[0])
    return merged
