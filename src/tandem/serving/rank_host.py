"""The server of a tensor-parallel native replica on a node other than rank 0's (seed §3.2: one
server per node). It only starts its node's worker ranks (rollout/engine/rank_worker.py), which
join rank 0's rendezvous and from then on take every command, step and weight slice from rank 0
over the replica's collectives: control verbs reach them through rank 0, never through here.
The workers die with this process; a dead worker fails rank 0's next collective, and with it the
replica (docs/serving.md, "Replicas over several nodes")."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import ray
import torch

from tandem.quiet import quiet_libraries
from tandem.rollout.engine.rank_processes import spawn_workers
from tandem.rollout.engine.rank_worker import Rendezvous
from tandem.rollout.engine.tensor_parallel import rank_devices


@dataclass
class RankHostInfo:
    """Where a node's worker ranks run: the node, this server's process, the ranks' pids."""

    server_id: str
    node_ip: str
    node_id: str | None
    pid: int
    ranks: list[int]
    rank_pids: list[int]


class RankHost:
    """One node's worker ranks of a replica spread over nodes."""

    def __init__(self, server_id: str) -> None:
        self.server_id = server_id
        self.processes: list[subprocess.Popen] = []
        self.ranks: list[int] = []

    def start(self, model_path: str | Path, dtype: str, device: str, rendezvous: Rendezvous,
              ranks: range, size: int, torch_threads: int | None) -> RankHostInfo:
        """Spawn the worker processes of `ranks` (of a replica of `size`) on this node; they
        connect to rank 0's store at `rendezvous`. Returns at once: rank 0 waits for them."""
        from tandem.models import resolve_model_path

        if self.processes:
            raise RuntimeError(f"rank host {self.server_id!r} already started its ranks")
        quiet_libraries()
        here = ray.util.get_node_ip_address()
        torch_device = torch.device(device)
        devices = rank_devices(torch_device, len(ranks))
        shared = torch_device.type == "cuda" and len(set(devices)) < len(ranks)
        threads = None
        if torch_device.type == "cpu":
            threads = max(1, (torch_threads or torch.get_num_threads()) // len(ranks))
        self.processes = spawn_workers(ranks, size, rendezvous.host, rendezvous.port,
                                       str(resolve_model_path(str(model_path))), dtype, devices,
                                       shared, threads, here)
        self.ranks = list(ranks)
        return self.info()

    def info(self) -> RankHostInfo:
        """Node, process and worker ranks of this server."""
        node_id = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
        return RankHostInfo(self.server_id, ray.util.get_node_ip_address(), node_id, os.getpid(),
                            self.ranks, [process.pid for process in self.processes])

    def exited(self) -> dict[int, int]:
        """The worker ranks that exited, with their exit codes."""
        return {rank: process.poll() for rank, process in zip(self.ranks, self.processes)
                if process.poll() is not None}


RankHostActor = ray.remote(num_cpus=0)(RankHost)
