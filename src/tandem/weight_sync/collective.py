"""`gloo` / `nccl`: rank 0 broadcasts the stream to every receiver in fixed-size buckets
(docs/weight_sync.md, "gloo / nccl"): per bucket a size pair, the pickled chunk list, then the
bytes, from two buffers so that packing bucket k+1 overlaps sending bucket k; a zero header
ends the stream. The group is built per sync on the sender's TCPStore (`master_addr`), never
the process's default (training) group, and destroyed in `finalize`.
"""

from __future__ import annotations

import asyncio
import pickle
from datetime import timedelta
from typing import Iterator

import torch
import torch.distributed as dist

from tandem.weight_layout import bucket_size
from tandem.weight_sync.base import CheckpointEngine, NamedTensors, SyncPlan, WeightSyncError
from tandem.weight_sync.bucketing import Unpacker, fill_bucket, tensor_buckets
from tandem.weight_sync.control import (await_commit, commit, local_address_towards, rendezvous,
                                        serve_store)


class CollectiveCheckpointEngine(CheckpointEngine):
    """Bucketed broadcast over a private process group; `device_type` picks gloo or NCCL."""

    name = ""
    device_type = "cpu"

    def __init__(self, bucket_megabytes: int = 512, timeout_s: float = 300.0,
                 master_addr: str = "127.0.0.1", **engine_kwargs) -> None:
        super().__init__(bucket_megabytes, timeout_s, **engine_kwargs)
        self.master_addr = master_addr  # the sender's address as the receivers reach it
        self._store: dist.TCPStore | None = None
        self._group = None
        self.bytes_sent = 0  # bucket payload bytes broadcast by this engine in its last sync

    @property
    def device(self) -> torch.device:
        return torch.device(self.device_type, torch.cuda.current_device()) \
            if self.device_type == "cuda" else torch.device("cpu")

    def build_topology(self, n_receivers: int, version: int,
                       receiver_versions: list[int] | None = None,
                       receiver_slots: list | None = None) -> SyncPlan:
        """Serve the rendezvous store of this sync; its address goes into the plan."""
        plan = super().build_topology(n_receivers, version, receiver_versions)
        self._store, details = serve_store(self.master_addr, self.timeout_s)
        return SyncPlan(plan.engine, version, n_receivers, plan.bucket_bytes, plan.timeout_s, details)

    def init_process_group(self, plan: SyncPlan, rank: int) -> None:
        """Meet every participant, then build the private group (all ranks, concurrently)."""
        super().init_process_group(plan, rank)
        self._store = rendezvous(self._store, plan, rank)
        try:
            self._group = self._make_group(dist.PrefixStore("group/", self._store), rank,
                                           plan.n_receivers + 1, timedelta(seconds=plan.timeout_s))
        except RuntimeError as error:
            raise WeightSyncError("init_process_group", self._others(), str(error)) from error

    def _make_group(self, store, rank: int, size: int, timeout: timedelta):
        # gloo's default device binds the hostname's address, which a peer on another host (or
        # network namespace) may not reach: listen where the route to the sender leaves
        details = self.plan.details
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_address_towards(
            details["master_addr"], details["master_port"]))]
        return dist.ProcessGroupGloo(store, rank, size, options)

    async def send_weights(self, named_tensors: NamedTensors) -> None:
        """Broadcast the stream bucket by bucket (rank 0); blocks a worker thread, not the loop."""
        if self.rank != 0 or self._group is None:
            raise RuntimeError("send_weights needs init_process_group(plan, rank=0) first")
        await asyncio.to_thread(self._send, named_tensors)

    def _send(self, named_tensors: NamedTensors) -> None:
        self.bytes_sent = 0
        buffers = [torch.empty(self.plan.bucket_bytes, dtype=torch.uint8, device=self.device)
                   for _ in range(2)]
        pending: list[list] = [[], []]  # broadcasts in flight per buffer (and the tensors they read)
        for index, bucket in enumerate(tensor_buckets(named_tensors, self.plan.bucket_bytes)):
            slot = index % 2
            self._wait_all(pending[slot], "send")  # bucket index-2 has left this buffer
            chunks = fill_bucket(buffers[slot], bucket)
            header = torch.frombuffer(bytearray(pickle.dumps(chunks)), dtype=torch.uint8)
            used = bucket_size(chunks)
            pending[slot] = self._broadcast_bucket(header, buffers[slot][:used])
            self.bytes_sent += used
        self._wait_all(pending[0] + pending[1], "send")
        self._wait_all(self._broadcast_bucket(torch.empty(0, dtype=torch.uint8), None), "send")
        commit(self._store, self.plan.n_receivers, self.plan.timeout_s)

    def _broadcast_bucket(self, header: torch.Tensor, payload: torch.Tensor | None) -> list:
        sizes = torch.tensor([header.numel(), 0 if payload is None else payload.numel()],
                             dtype=torch.int64, device=self.device)
        header = header.to(self.device)
        works = [(self._group.broadcast(sizes, 0), sizes)]
        if header.numel():
            works.append((self._group.broadcast(header, 0), header))
            works.append((self._group.broadcast(payload, 0), payload))
        return works

    def receive_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield tensors bucket by bucket (ranks >= 1); views live until the iterator advances."""
        if not self.rank or self._group is None:
            raise RuntimeError("receive_weights needs init_process_group(plan, rank>=1) first")
        buffer = torch.empty(self.plan.bucket_bytes, dtype=torch.uint8, device=self.device)
        unpacker = Unpacker()
        try:
            while True:
                sizes = torch.empty(2, dtype=torch.int64, device=self.device)
                self._wait_all([(self._group.broadcast(sizes, 0), sizes)], "receive")
                header_bytes, used = sizes.tolist()
                if header_bytes == 0:
                    break
                header = torch.empty(header_bytes, dtype=torch.uint8, device=self.device)
                self._wait_all([(self._group.broadcast(header, 0), header)], "receive")
                chunks = pickle.loads(header.cpu().numpy().tobytes())
                self._wait_all([(self._group.broadcast(buffer[:used], 0), None)], "receive")
                yield from unpacker.unpack(buffer, chunks)
            if unpacker.check_complete():
                raise WeightSyncError("receive", "sender", f"stream ended inside tensors "
                                      f"{unpacker.check_complete()}")
            await_commit(self._store, self.rank, self.plan.timeout_s)
        finally:
            unpacker.close()

    def _wait_all(self, works: list, phase: str) -> None:
        for work, _ in works:
            try:
                work.wait(timedelta(seconds=self.plan.timeout_s))
            except RuntimeError as error:
                raise WeightSyncError(phase, self._others(), str(error)) from error
        if self.device_type == "cuda" and works:
            torch.cuda.current_stream().synchronize()

    def _others(self) -> str:
        if self.rank == 0:
            return f"receivers (ranks 1..{self.plan.n_receivers})"
        return "sender"

    def finalize(self) -> None:
        """Drop the private group and (on the sender) the store of this sync."""
        group, self._group, self._store = self._group, None, None
        if group is not None and hasattr(group, "shutdown"):
            group.shutdown()
        super().finalize()


class GlooCheckpointEngine(CollectiveCheckpointEngine):
    """CPU tensors over gloo."""

    name = "gloo"
    device_type = "cpu"
