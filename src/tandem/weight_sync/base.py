"""The checkpoint-engine interface: one weight sync is
prepare -> build_topology -> init_process_group -> send || receive -> finalize.

Contract between the transports (this package) and the trainer's cross-process sync that drives them:

- Before generation pauses, the trainer may call `encode_ahead(named_tensors, version)` on the
  sender (engines with `encodes_ahead`, i.e. delta); a plan with `encoded_ahead` then sends
  that preparation and no training rank reads the weights in send_weights.
- The sending process (training rank 0) calls `build_topology(n_receivers, version,
  receiver_versions)` and hands the returned picklable `SyncPlan` to every receiver; each
  receiver builds its own engine (same name, same kwargs plus receiver-only ones such as
  `current_weights` / `current_version` for delta) and every participant calls
  `init_process_group(plan, rank)` concurrently (rank 0 sends, ranks 1..n receive).
- Rank 0 awaits `send_weights(named_tensors)`; every receiver iterates `receive_weights()`,
  which yields full `(name, tensor)` pairs (delta: a `types.WeightPatch` instead, owned by the
  consumer, for a name the receiver's `patches_in_place` accepts). A yielded tensor may be a
  view of a transfer buffer: it is valid only until the iterator is advanced, so the consumer
  copies it (into staging or the parameters) before asking for the next one. The iterator
  ends (StopIteration) only once the sender has confirmed that every receiver has the whole
  stream; if it raises instead, the receiver must not load what it got (staging is discarded,
  the old version stays).
- Every participant calls `finalize()` afterwards, on success and on failure alike; it is
  idempotent and frees the sync process group and per-sync state. Buffers worth keeping between
  syncs (shm's shared buckets) stay until `close()`, which the owner calls when done with the
  engine (also run at collection / interpreter exit).
- Every blocking wait is bounded by `timeout_s` and a failure raises `WeightSyncError` naming
  the phase and, where known, the peer. The sync process group is created per sync from its own
  TCPStore (never the default/training group) and destroyed in `finalize`.
- `naive` keeps its in-process `sync(named_tensors, rollout, version)` path.

Additions to /work/wt/SYNC_INTERFACE.md as built: `WeightSyncError(phase, peer, message)`
pickles intact; `close()` (release what outlives a sync: shm buffers, delta's kept copy);
the commit handshake above (a receiver loads only after its iterator ends normally);
senders expose `bytes_sent` (payload bytes of the last sync); engine kwargs: gloo/nccl
`master_addr`, shm `device` ("cpu" | "cuda"), `shm_dir`; delta `transport`, `dtype`,
`max_sparse_ratio`, receivers `current_weights`, `current_version`, `current_values`,
`patches_in_place` (others go to the transport).
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
        if bucket_megabytes < 1:
            raise ValueError(f"bucket_megabytes must be >= 1, got {bucket_megabytes} "
                             "(rollout.checkpoint_engine.update_weights_bucket_megabytes)")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s} (checkpoint_engine.timeout_s)")
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

    def _peer_of(self, rank: int) -> str:
        return "sender" if rank == 0 else f"receiver {rank}"
