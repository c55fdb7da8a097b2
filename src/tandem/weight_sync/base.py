"""The checkpoint-engine interface: one weight sync is
prepare -> build_topology -> init_process_group -> send || receive -> finalize
(docs/weight_sync.md, "Protocol").

- Before generation pauses the trainer may call `encode_ahead(named_tensors, version)` on the
  sender (engines with `encodes_ahead`: delta); a plan with `encoded_ahead` then sends that
  preparation and no training rank reads the weights in send_weights.
- Rank 0 makes the picklable `SyncPlan` (build_topology); each receiver builds its own engine
  (same name and kwargs, plus receiver-only ones for delta); every participant calls
  `init_process_group(plan, rank)` concurrently (rank 0 sends, ranks 1..n receive).
- `receive_weights()` yields `(name, tensor)` pairs (delta: a `types.WeightPatch` where the
  receiver `patches_in_place`). A yielded tensor may be a view of a transfer buffer, valid only
  until the iterator advances. The iterator ends only once the sender confirmed that every
  receiver has the whole stream; if it raises, the receiver loads nothing.
- `finalize()` follows every sync, failed or not (idempotent); `close()` frees what outlives a
  sync (shm's buffers, delta's kept copy). Every wait is bounded by `timeout_s`; a failure
  raises `WeightSyncError` naming the phase and, where known, the peer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import torch

NamedTensors = Iterable[tuple[str, torch.Tensor]]

PHASES = ("prepare", "build_topology", "init_process_group", "send", "receive", "finalize", "load")


class WeightSyncError(RuntimeError):
    """A failed sync; `.phase` is one of PHASES and `.peer` names the other side when known."""

    def __init__(self, phase: str, peer: str | None, message: str) -> None:
        if phase not in PHASES:
            raise ValueError(f"unknown weight-sync phase {phase!r}; one of {', '.join(PHASES)}")
        self.phase, self.peer, self.message = phase, peer, message
        where = f" with {peer}" if peer else ""
        super().__init__(f"weight sync failed in phase {phase}{where}: {message}")

    def __reduce__(self):  # crosses process boundaries (Ray, multiprocessing) intact
        return type(self), (self.phase, self.peer, self.message)


@dataclass(frozen=True)
class SyncPlan:
    """Everything a receiver needs to join one sync; made by the sender in build_topology."""

    engine: str
    version: int
    n_receivers: int  # ranks 1..n_receivers receive; rank 0 sends
    bucket_bytes: int
    timeout_s: float
    details: dict[str, Any] = field(default_factory=dict)  # transport specific

    @property
    def encoded_ahead(self) -> bool:
        """Whether the sender sends what encode_ahead prepared: no rank reads the weights again."""
        return bool(self.details.get("encoded_ahead"))


class CheckpointEngine(ABC):
    """Moves one (name, tensor) stream from the training side to rollout receivers."""

    name = ""  # registry name, set by each transport
    encodes_ahead = False  # whether encode_ahead does anything (the trainer skips it if not)

    def __init__(self, bucket_megabytes: int = 512, timeout_s: float = 300.0,
                 **engine_kwargs) -> None:
        if engine_kwargs:
            raise ValueError(f"{type(self).__name__} does not take engine_kwargs "
                             f"{sorted(engine_kwargs)} (rollout.checkpoint_engine.engine_kwargs)")
        self.bucket_bytes = bucket_megabytes << 20
        self.timeout_s = float(timeout_s)
        self.plan: SyncPlan | None = None
        self.rank: int | None = None

    def prepare(self) -> None:
        """Allocate what outlives one sync (nothing by default)."""

    def encode_ahead(self, named_tensors: NamedTensors, version: int) -> None:
        """Sender, before generation pauses: prepare `version`'s sync from the stream (delta);
        by default nothing, and the stream is not read."""

    def build_topology(self, n_receivers: int, version: int,
                       receiver_versions: list[int] | None = None,
                       receiver_slots: list | None = None) -> SyncPlan:
        """Sender side: decide who receives what; the plan travels to every receiver.
        `receiver_slots` (per receiver a slots.SlotsDescriptor or None) is read by shm only."""
        if n_receivers < 1:
            raise ValueError(f"n_receivers must be >= 1, got {n_receivers}")
        return SyncPlan(self.name, version, n_receivers, self.bucket_bytes, self.timeout_s)

    def init_process_group(self, plan: SyncPlan, rank: int) -> None:
        """Join the sync as `rank` (0 sends); every participant calls it concurrently."""
        if plan.engine != self.name:
            raise ValueError(f"plan made by engine {plan.engine!r} given to {self.name!r}")
        if not 0 <= rank <= plan.n_receivers:
            raise ValueError(f"rank {rank} outside 0..{plan.n_receivers}")
        self.plan, self.rank = plan, rank

    @abstractmethod
    async def send_weights(self, named_tensors: NamedTensors) -> None:
        """Push the stream (rank 0)."""

    @abstractmethod
    def receive_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield the stream as it arrives (ranks >= 1); see the module docstring on lifetimes."""

    def finalize(self) -> None:
        """Release buffers and the sync group; safe to call after a failure and twice."""
        self.plan, self.rank = None, None

    def close(self) -> None:
        """Release what outlives one sync (nothing by default)."""
