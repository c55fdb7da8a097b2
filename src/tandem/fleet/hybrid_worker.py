"""One device of the HYBRID layout: the training engines and a rollout engine in one process.

The worker *is* a rollout server (the balancer routes generate calls to it) and holds the actor (and
the reference / critic the config needs). It loads the actor's weights into its own engine
in-process (load_actor_weights, for InProcessSync) and is the sending side of a sync into servers of
their own (encode_weights_ahead, build_sync_plan, send_weights, for CrossProcessSync). With
trainer.n_devices > 1 the workers shard the actor with FSDP2; each still hosts a full rollout
engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, TypeVar

import ray
import torch
from tensordict import TensorDict

from tandem.config.schema import RolloutConfig, TandemConfig
from tandem.models.tiny import resolve_model_path
from tandem.quiet import quiet_libraries
from tandem.rollout.base import MEMORY_TAGS, BaseRollout
from tandem.serving.server import RolloutServer, ServerInfo
from tandem.training.checkpoint import full_disk_named
from tandem.training.determinism import seed_everything, use_deterministic_kernels
from tandem.training.engine import TrainingEngine
from tandem.weight_sync.base import CheckpointEngine, SyncPlan
from tandem.weight_sync.naive import NaiveCheckpointEngine
from tandem.weight_sync.participants import (encode_from, make_checkpoint_engine,
                                             run_in_fresh_thread, send_from)
from tandem.weight_sync.registry import get_checkpoint_engine_class

T = TypeVar("T")


def needs_reference(config: TandemConfig) -> bool:
    """A frozen reference is loaded when a KL term needs it (or ref.enable is set)."""
    return config.ref.enable or config.actor.use_kl_loss or config.algorithm.use_kl_in_reward


class HybridWorker(RolloutServer):
    """Training engines + rollout server in one process (one per device)."""

    def __init__(self, config: TandemConfig, rank: int = 0, world_size: int = 1,
                 init_method: str | None = None, total_steps: int | None = None,
                 critic_total_steps: int | None = None, torch_threads: int | None = None) -> None:
        quiet_libraries()
        self._init_rollout_server(f"hybrid-{rank}", pause_timeout_s=3600.0, drain_timeout_s=60.0)
        if torch_threads is not None:  # before any torch work: every thread of the process takes it
            torch.set_num_threads(torch_threads)
        if world_size > 1:
            from tandem.training.fsdp import init_process_group

            init_process_group(rank, world_size, init_method, config.model.device,
                               config.trainer.timeout_s)
        if config.trainer.deterministic:
            seed_everything(config.trainer.seed + rank)
            use_deterministic_kernels()
        else:
            torch.manual_seed(config.trainer.seed + rank)
        self.config = config
        self.rank = rank
        self.actor = TrainingEngine.from_config(config, "actor", total_steps)
        # a LoRA actor is its own reference: its forward with the adapters disabled
        self.reference = (TrainingEngine.from_config(config, "reference")
                          if needs_reference(config) and not config.actor.lora.rank else None)
        self.critic = TrainingEngine.from_config(config, "critic", critic_total_steps) if config.critic.enable else None
        ckpt = config.rollout.checkpoint_engine
        self.checkpoint_engine = NaiveCheckpointEngine(ckpt.update_weights_bucket_megabytes,
                                                       ckpt.timeout_s)
        self._sync_engine: CheckpointEngine | None = None  # rank 0's sender of a separate sync
        self._actor_path = resolve_model_path(config.model.path)
        # set when the engine started from the same files as a wholly loaded actor: the actor's
        # parameter versions then; while they stand, a version-0 sync would copy equal weights
        self._engine_matches_actor_at: list[int] | None = None

    # ---- threads -------------------------------------------------------------------------

    async def _compute(self, function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run training-side torch work off the event loop, in asyncio's thread pool. (A thread
        per call, which leaves no second OpenMP team beside the engine's, made generation and
        sync several times slower in 2 of 3 SmolLM2 runs, unexplained: docs/trainer.md, "Threads".)"""
        return await asyncio.to_thread(function, *args, **kwargs)

    async def torch_threads(self) -> dict[str, int]:
        """torch.get_num_threads() on the event loop's thread, where the engine steps, and on a
        training thread."""
        return {"engine": torch.get_num_threads(), "training": await self._compute(torch.get_num_threads)}

    # ---- log-probabilities and values (the batch is this worker's shard) ------------------

    async def compute_log_prob(self, batch: TensorDict, calculate_entropy: bool = False) -> dict[str, torch.Tensor]:
        """Actor re-forward: {"log_probs": [sum R_i], "entropy": ...} (old_log_probs)."""
        out = await self._compute(self.actor.compute_log_prob, batch, self._temperature(), calculate_entropy)
        return {"log_probs": out.log_probs, **({"entropy": out.entropy} if calculate_entropy else {})}

    async def compute_ref_log_prob(self, batch: TensorDict) -> torch.Tensor:
        """Frozen reference forward: [sum R_i] (ref_log_prob); a LoRA actor with its adapters
        disabled is the reference."""
        if self.actor.uses_lora:
            out = await self._compute(self.actor.compute_ref_log_prob, batch, self._temperature())
            return out.log_probs
        if self.reference is None:
            raise RuntimeError("no reference model: set ref.enable, actor.use_kl_loss or "
                               "algorithm.use_kl_in_reward")
        out = await self._compute(self.reference.compute_log_prob, batch, self._temperature())
        return out.log_probs

    async def compute_values(self, batch: TensorDict) -> torch.Tensor:
        """Critic forward: [sum R_i]."""
        out = await self._compute(self.critic.compute_values, batch)
        return out.values

    def _temperature(self) -> float:
        # The policy being optimised is the distribution sampled from: logits / temperature
        # (config validation makes the rollout's logprobs the same distribution).
        temperature = self.config.rollout.temperature
        return temperature if temperature > 0 else 1.0

    # ---- updates ---------------------------------------------------------------------------

    async def update_actor(self, batch: TensorDict, mini_batch_size: int) -> dict[str, float]:
        """PPO epochs over this shard's mini-batches; returns mean metrics."""
        from tandem.training.losses import actor_loss_fn

        self._engine_matches_actor_at = None
        return await self._compute(
            self.actor.update, batch, actor_loss_fn(self.config), mini_batch_size,
            self.config.actor.ppo_epochs, temperature=self._temperature(),
            calculate_entropy=bool(self.config.actor.entropy_coeff))

    async def update_actor_on_policy(self, batch: TensorDict) -> dict[str, Any]:
        """One step on this shard whose old_log_probs come from the update's own forward:
        {"metrics": ..., "log_probs": [sum R_i], "entropy": [sum R_i]} (see ppo.old_log_probs_from_update)."""
        from tandem.training.losses import actor_loss_fn

        self._engine_matches_actor_at = None
        metrics, old = await self._compute(
            self.actor.update_on_policy, batch, actor_loss_fn(self.config), temperature=self._temperature(),
            calculate_entropy=bool(self.config.actor.entropy_coeff))
        return {"metrics": metrics, "log_probs": old.log_probs, "entropy": old.entropy}

    async def update_critic(self, batch: TensorDict, mini_batch_size: int) -> dict[str, float]:
        """Value-function epochs over this shard."""
        from tandem.training.losses import critic_loss_fn

        return await self._compute(self.critic.update, batch, critic_loss_fn(self.config),
                                   mini_batch_size, self.config.critic.ppo_epochs)

    # ---- weight sync ----------------------------------------------------------------------

    async def start(self, backend_class: type[BaseRollout], model_path: str | Path,
                    config: RolloutConfig, dtype: str = "float32", device: str = "cpu",
                    torch_threads: int | None = None) -> ServerInfo:
        """RolloutServer.start, noting whether the engine now holds exactly the actor's weights."""
        info = await super().start(backend_class, model_path, config, dtype, device, torch_threads)
        if (Path(model_path) == self._actor_path and dtype == self.config.model.dtype
                and loaded_whole(self.actor.model, self._actor_path)):
            self._engine_matches_actor_at = self._actor_versions()
        return info

    async def sleep(self, tags: Iterable[str] = MEMORY_TAGS) -> None:
        self._engine_matches_actor_at = None
        await super().sleep(tags)

    def _actor_versions(self) -> list[int]:
        # a tensor's version counts its in-place changes (optimizer steps, copies, edits)
        return [parameter._version for parameter in self.actor.model.parameters()]

    async def load_actor_weights(self, version: int) -> None:
        """Load the actor's weights into this process's (awake) engine through the naive checkpoint
        engine and stamp `version`; the first sync of a fresh run (version 0, both loaded from the
        same files, unchanged since) has nothing to copy and is skipped. Frozen weights
        (actor.freeze_vision_tower) stay behind unless the engine dropped its weights."""
        unchanged = self._engine_matches_actor_at == self._actor_versions()
        if not (version == 0 and unchanged):
            partial = self.actor.leaves_weights_out and self.backend.synced_in_full()
            await self.checkpoint_engine.sync(self._actor_stream(partial), self, version, partial)
        self._engine_matches_actor_at = None

    def _actor_stream(self, partial: bool) -> Iterator[tuple[str, torch.Tensor]]:
        """The actor's weights for a sync; `partial`: without the frozen ones."""
        actor = self.actor
        return actor.export_weights(include_frozen=False) if partial else actor.export_weights()

    async def encode_weights_ahead(self, engine: str, version: int) -> dict[str, float]:
        """Every training rank, before generation pauses: rank 0's sender for `engine` prepares
        `version`'s sync (delta: the changes against what the receivers hold), the other ranks
        take part in the gathers; engines without encodes_ahead skip it. Returns seconds."""
        if not get_checkpoint_engine_class(engine).encodes_ahead:
            return {}
        sender = self._sender_engine(engine) if self.rank == 0 else None
        stream = self.actor.export_weights()
        return await run_in_fresh_thread(lambda: encode_from(sender, version, stream),
                                         f"weight-sync-encode-{self.rank}")

    async def build_sync_plan(self, engine: str, n_receivers: int, version: int,
                              receiver_versions: list[int] | None = None,
                              receiver_slots: list | None = None,
                              receivers_hold_all: bool = False) -> SyncPlan:
        """Rank 0: this sync's plan from its sender (_sender_engine), which the cross-process
        sync hands to every receiving server (build_topology; `receiver_slots`: the servers'
        weight slots of a double-buffered shm sync). With `receivers_hold_all` (no receiver
        dropped its weights) the actor's frozen weights stay behind: details["partial"]."""
        if self.rank != 0:
            raise RuntimeError(f"build_sync_plan on rank {self.rank}: only rank 0 sends")
        extra = (receiver_slots,) if receiver_slots is not None else ()  # shm reads it only
        plan = self._sender_engine(engine).build_topology(n_receivers, version, receiver_versions,
                                                          *extra)
        if receivers_hold_all and self.actor.leaves_weights_out and not plan.encoded_ahead:
            plan = dataclasses.replace(plan, details={**plan.details, "partial": True})
        return plan

    def _sender_engine(self, engine: str) -> CheckpointEngine:
        """Rank 0's sender (checkpoint engine `engine`, which the fleet chose; its store on this
        node's IP unless engine_kwargs.master_addr says otherwise), kept across syncs: delta
        remembers what it sent, and what encode_weights_ahead prepared."""
        if self._sync_engine is None or self._sync_engine.name != engine:
            ckpt = self.config.rollout.checkpoint_engine
            kwargs = dict(ckpt.engine_kwargs)
            if engine in ("gloo", "nccl", "shm") or kwargs.get("transport") in ("gloo", "nccl"):
                kwargs.setdefault("master_addr", ray.util.get_node_ip_address())
            self._sync_engine = make_checkpoint_engine(
                engine, ckpt.update_weights_bucket_megabytes, ckpt.timeout_s, **kwargs)
            self._sync_engine.prepare()
        return self._sync_engine

    async def send_weights(self, plan: SyncPlan) -> dict[str, float]:
        """Every training rank, concurrently with the receivers: the (FSDP2-sharded) actor's full
        tensors are gathered one at a time and rank 0 sends them through build_sync_plan's engine (a
        plan encoded ahead reads no weights). Returns seconds per phase."""
        engine = self._sync_engine if self.rank == 0 else None
        if self.rank == 0 and engine is None:
            raise RuntimeError("send_weights on rank 0 before build_sync_plan")
        stream = (iter(()) if plan.encoded_ahead else
                  self._actor_stream(bool(plan.details.get("partial"))))
        return await run_in_fresh_thread(lambda: send_from(engine, plan, stream),
                                         f"weight-sync-send-{self.rank}")

    # ---- checkpoints and inspection ------------------------------------------------------

    def save_checkpoint(self, directory: str, extra: dict[str, Any] | None = None) -> None:
        """Actor (and critic) weights, optimizer, schedule and RNG; the actor directory also gets
        the tokenizer, so it loads as an HF model + tokenizer (from_pretrained) on its own."""
        self.actor.save_checkpoint(f"{directory}/actor", extra)
        if self.rank == 0:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(self.config.model.path))
            with full_disk_named(Path(directory)):
                tokenizer.save_pretrained(f"{directory}/actor")
                if self.actor.uses_lora and self.config.actor.lora.save_merged:
                    tokenizer.save_pretrained(f"{directory}/actor/merged")
        if self.critic is not None:
            self.critic.save_checkpoint(f"{directory}/critic")

    def load_checkpoint(self, directory: str) -> dict[str, Any]:
        """Restore what save_checkpoint wrote; returns its `extra`."""
        self._engine_matches_actor_at = None
        extra = self.actor.load_checkpoint(f"{directory}/actor")
        if self.critic is not None:
            self.critic.load_checkpoint(f"{directory}/critic")
        return extra

    def actor_greedy(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        """The actor's own greedy continuation (HF generate), to compare with the engine."""
        model = self.actor.model
        model.eval()
        eos = model.config.eos_token_id
        with torch.no_grad():
            output = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens,
                                    do_sample=False, eos_token_id=eos, pad_token_id=eos)
        return output[0, len(prompt_ids):].tolist()

    def ping(self) -> str:
        """Readiness check: where this worker runs (Ray actor, node IP, pid), for messages that
        name it."""
        actor = ray.get_runtime_context().get_actor_id() if ray.is_initialized() else None
        return f"actor {actor}, {ray.util.get_node_ip_address()}:{os.getpid()}"

    def node_id(self) -> str:
        """The Ray node this worker was placed on."""
        return ray.get_runtime_context().get_node_id()


def loaded_whole(model: torch.nn.Module, directory: Path) -> bool:
    """Whether every parameter of `model` (a tied one under any of its names) has a tensor in
    the safetensors files of `directory`, i.e. loading it initialised nothing at random."""
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        return False
    from safetensors import safe_open

    stored: set[str] = set()
    for path in files:
        with safe_open(str(path), "pt") as handle:
            stored.update(handle.keys())
    names: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(name)
    return all(any(name in stored for name in aliases) for aliases in names.values())


# Generate calls overlap with control calls: an async actor with room for many of them.
HybridWorkerActor = ray.remote(max_concurrency=10_000)(HybridWorker)
