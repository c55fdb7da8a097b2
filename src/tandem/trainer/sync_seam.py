"""The fleet's one weight-sync seam: the actor's weights -> every rollout engine of a layout,
as `await sync(version) -> SyncReport`, with two implementations chosen once by layout:

- HYBRID: `InProcessSync` (in_process_sync.py): each training worker hands its actor's stream to
  the engine in its own process (the `naive` checkpoint engine).
- COLOCATED / STANDALONE: `CrossProcessSync` (cross_process_sync.py) through a checkpoint engine
  of tandem.weight_sync; `choose_transport` resolves rollout.checkpoint_engine.backend=auto once
  the fleet knows where every server runs: shm when all share the sender's host, else nccl on
  CUDA, gloo on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

from tandem.config.choices import ConfigError


@dataclass
class SyncReport:
    """What one sync did: seconds per phase (metric names), the version each server serves
    now (None: it did not answer), and the servers left out with the reason."""

    version: int
    timings: dict[str, float]
    served: dict[str, int | None]
    left_out: dict[str, str] = field(default_factory=dict)

    def behind(self) -> list[str]:
        """Servers not serving this sync's version."""
        return sorted(sid for sid, version in self.served.items() if version != self.version)

    def metrics(self) -> dict[str, float]:
        """The step's sync metrics: every phase's seconds, the whole sync as time/sync_inner,
        and how many servers it left behind."""
        return {**self.timings, "time/sync_inner": self.timings["sync/total_s"],
                "sync/servers_behind": float(len(self.behind()))}


class WeightSync(Protocol):
    """Moves the actor's weights into every engine of one layout, all or nothing per engine."""

    async def sync(self, version: int) -> SyncReport:
        """Load the actor's current weights everywhere as `version`; WeightSyncError on failure."""


def choose_transport(backend: str, device: str, sender_node: str | None,
                     server_nodes: dict[str, str | None], engine_kwargs: dict) -> str:
    """The checkpoint engine of a cross-process sync: `backend` as configured, "auto" resolved
    (shm when every server runs on the sender's node, else nccl on CUDA / gloo on CPU). A shm
    transport (shm, or delta over shm) with a server on another host is a ConfigError."""
    remote = sorted(sid for sid, node in server_nodes.items() if node != sender_node)
    if backend == "naive":
        raise ConfigError("rollout.checkpoint_engine.backend: 'naive' hands tensors over inside "
                          "one process, but these servers run in their own; set it to auto")
    if backend == "auto":
        return ("nccl" if device.startswith("cuda") else "gloo") if remote else "shm"
    over_shm = backend == "shm" or (backend == "delta"
                                    and engine_kwargs.get("transport", "shm") == "shm")
    if over_shm and remote:
        field_name = ("rollout.checkpoint_engine.engine_kwargs.transport" if backend == "delta"
                      else "rollout.checkpoint_engine.backend")
        raise ConfigError(f"{field_name}: shared memory reaches only the sender's host, but "
                          f"servers {', '.join(remote)} run on other hosts; use gloo (CPU) or "
                          "nccl (CUDA), or backend=auto")
    return backend


def receiver_nodes(replicas: Sequence) -> dict[str, str | None]:
    """server_id -> the Ray node of its main server (from the replicas' ServerInfo)."""
    return {replica.server_id: replica.infos[0].node_id for replica in replicas}
