"""`shm`: same host, separate processes; buckets move through two shared buffers
(docs/weight_sync.md, "shm").

CPU: two files in /dev/shm (`tandem-sync-<sender pid>-...`) that every participant maps; CUDA:
two device buffers whose IPC handles travel in the plan. The sender copies each byte in once and
the receiver's consumer once out (receivers yield views of the buffer). The buffers outlive a
sync (fresh pages cost a fault and zeroing) until `close()`; a new sender removes the files of
senders that died (weight_layout.remove_orphans). Each buffer's pages are reserved before a bucket
is written, so a shm_dir too small is an error naming the fix, not a SIGBUS. Control goes through the sender's TCPStore: `ready/k` holds bucket k's chunk
list (empty: the end), `consumed/k/rank` frees its buffer for bucket k+2, `done`/`commit` end it.

With `double_buffer` and receivers that map their weights in two shared slots (slots.py), the
sender writes each receiver's inactive slot directly instead (slot_transfer.py).
"""

from __future__ import annotations

import asyncio
import errno
import os
import pickle
import tempfile
import threading
import weakref
from typing import Iterator

import torch
from torch.multiprocessing.reductions import reduce_tensor

from tandem.weight_layout import bucket_size, remove_orphans, shm_room
from tandem.weight_sync.base import CheckpointEngine, NamedTensors, SyncPlan, WeightSyncError
from tandem.weight_sync.bucketing import Unpacker, fill_bucket, tensor_buckets
from tandem.weight_sync.control import (await_commit, commit, put, rendezvous, serve_store, take,
                                        wait_keys)
from tandem.weight_sync.slot_transfer import map_slots, receive_slot, send_into_slots

N_BUFFERS = 2


class ShmCheckpointEngine(CheckpointEngine):
    """Double-buffered shared-memory buckets between processes of one host."""

    name = "shm"

    def __init__(self, bucket_megabytes: int = 512, timeout_s: float = 300.0,
                 device: str = "cpu", shm_dir: str = "/dev/shm", master_addr: str = "127.0.0.1",
                 double_buffer: bool | None = None, **engine_kwargs) -> None:
        super().__init__(bucket_megabytes, timeout_s, **engine_kwargs)
        self.double_buffer = double_buffer
        self.master_addr = master_addr  # where the sender's control store listens
        if device not in ("cpu", "cuda"):
            raise ValueError(f"shm device must be 'cpu' or 'cuda', got {device!r} (engine_kwargs.device)")
        self.device, self.shm_dir = device, shm_dir
        self._store = None
        self._buffers: list[torch.Tensor] = []
        self._paths: list[str] = []
        self._reserved = [0] * N_BUFFERS  # bytes of each buffer file backed by shm_dir's pages
        self.bytes_sent = 0  # bucket bytes written into shared memory in the last sync

    def build_topology(self, n_receivers: int, version: int,
                       receiver_versions: list[int] | None = None,
                       receiver_slots: list | None = None) -> SyncPlan:
        """Create the control store and the shared buffers (or, double-buffered, take every
        receiver's slots); both go into the plan."""
        plan = super().build_topology(n_receivers, version, receiver_versions)
        slots = self._slots_to_write(n_receivers, receiver_slots)
        self._store, details = serve_store(self.master_addr, self.timeout_s)
        if slots is not None:
            details["slots"] = slots
        elif not self._buffers:
            self._create_buffers()
        if self.device == "cuda":
            details["cuda_handles"] = [reduce_tensor(buffer) for buffer in self._buffers]
        else:
            details["paths"] = list(self._paths)
        return SyncPlan(plan.engine, version, n_receivers, plan.bucket_bytes, plan.timeout_s, details)

    def _slots_to_write(self, n_receivers: int, receiver_slots: list | None) -> list | None:
        """The receivers' slot descriptors if this sync writes slots, else None (the ring)."""
        offered = list(receiver_slots or [None] * n_receivers)
        if self.double_buffer is False or len(offered) != n_receivers:
            return None
        missing = [rank for rank, slots in enumerate(offered, 1) if slots is None]
        if not missing:
            return offered
        if self.double_buffer:
            raise WeightSyncError("build_topology", f"receiver {missing[0]}",
                                  "engine_kwargs.double_buffer is true but this receiver maps no "
                                  "weight slots (its engine cannot, or two copies do not fit); "
                                  "set rollout.checkpoint_engine.engine_kwargs.double_buffer "
                                  "false")
        return None

    def init_process_group(self, plan: SyncPlan, rank: int) -> None:
        """Receivers map the buffers; everyone meets; then the sender unlinks the files."""
        super().init_process_group(plan, rank)
        if "slots" in plan.details:
            map_slots(plan, rank)
            self._store = rendezvous(self._store, plan, rank)
            return
        if rank:
            try:
                self._buffers = _attach(plan.details, plan.bucket_bytes)
            except (RuntimeError, OSError) as error:
                raise WeightSyncError("init_process_group", "sender",
                                      f"cannot map the shared buffers ({error}); shm needs every "
                                      "receiver on the sender's host (use gloo or nccl across "
                                      "hosts)") from error
        self._store = rendezvous(self._store, plan, rank)

    def _create_buffers(self) -> None:
        if self.device == "cuda":
            self._buffers = [torch.empty(self.bucket_bytes, dtype=torch.uint8, device="cuda")
                             for _ in range(N_BUFFERS)]
            return
        remove_orphans(self.shm_dir)
        for _ in range(N_BUFFERS):
            handle, path = tempfile.mkstemp(prefix=f"tandem-sync-{os.getpid()}-", dir=self.shm_dir)
            os.ftruncate(handle, self.bucket_bytes)
            os.close(handle)
            self._paths.append(path)
            self._buffers.append(_map(path, self.bucket_bytes))
        weakref.finalize(self, _unlink, list(self._paths))  # at close(), collection or exit

    async def send_weights(self, named_tensors: NamedTensors) -> None:
        """Fill buffer k % 2 once every receiver is done with bucket k-2; announce it (or,
        double-buffered, write every receiver's inactive slot)."""
        if self.rank != 0 or self.plan is None:
            raise RuntimeError("send_weights needs init_process_group(plan, rank=0) first")
        if "slots" in self.plan.details:
            self.bytes_sent = 0
            self.bytes_sent = await asyncio.to_thread(send_into_slots, self._store, self.plan,
                                                      named_tensors)
            return
        await asyncio.to_thread(self._send, named_tensors)

    def _send(self, named_tensors: NamedTensors) -> None:
        self.bytes_sent = 0
        receivers = range(1, self.plan.n_receivers + 1)
        count = 0
        for index, bucket in enumerate(tensor_buckets(named_tensors, self.plan.bucket_bytes)):
            if index >= N_BUFFERS:
                wait_keys(self._store, {f"consumed/{index - N_BUFFERS}/{r}": f"receiver {r}"
                                        for r in receivers}, self.plan.timeout_s, "send")
            self._reserve(index % N_BUFFERS, bucket_size([chunk for chunk, _ in bucket]))
            chunks = fill_bucket(self._buffers[index % N_BUFFERS], bucket)
            if self.device == "cuda":
                torch.cuda.current_stream().synchronize()
            put(self._store, f"ready/{index}", pickle.dumps(chunks), "send")
            self.bytes_sent += bucket_size(chunks)
            count = index + 1
        put(self._store, f"ready/{count}", b"", "send")
        commit(self._store, self.plan.n_receivers, self.plan.timeout_s)

    def _reserve(self, buffer: int, nbytes: int) -> None:
        """Back the first nbytes of a CPU buffer's file before writing them (the files are
        sparse): a shm_dir too small is this error at the first sync, not a SIGBUS mid-write."""
        if self.device == "cuda" or nbytes <= self._reserved[buffer]:
            return
        what = f"the shm transport's buffer {buffer}"
        problem = shm_room(nbytes - self._reserved[buffer], self.shm_dir, what)
        if problem is None:
            try:
                with open(self._paths[buffer], "r+b") as handle:
                    os.posix_fallocate(handle.fileno(), 0, nbytes)
            except OSError as error:
                if error.errno == errno.ENOSPC:
                    problem = f"{self.shm_dir} cannot hold {nbytes >> 20} MiB of {what} ({error})"
        if problem:
            raise WeightSyncError("send", None, f"{problem}; the ring holds two buffers of up to "
                                  f"{self.bucket_bytes >> 20} MiB (rollout.checkpoint_engine."
                                  "update_weights_bucket_megabytes). Enlarge it (docker: "
                                  "--shm-size), set rollout.checkpoint_engine.engine_kwargs."
                                  "shm_dir to a larger tmpfs, or lower the bucket size")
        self._reserved[buffer] = nbytes

    def receive_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield views of the shared buffer, bucket by bucket (ranks >= 1); double-buffered,
        checked views of this receiver's inactive slot."""
        if self.rank and self.plan is not None and "slots" in self.plan.details:
            yield from receive_slot(self._store, self.plan, self.rank)
            return
        if not self.rank or not self._buffers:
            raise RuntimeError("receive_weights needs init_process_group(plan, rank>=1) first")
        unpacker = Unpacker()
        try:
            index = 0
            while True:
                wait_keys(self._store, {f"ready/{index}": "sender"}, self.plan.timeout_s, "receive")
                header = take(self._store, f"ready/{index}", "receive")
                if not header:
                    break
                yield from unpacker.unpack(self._buffers[index % N_BUFFERS], pickle.loads(header))
                if self.device == "cuda":  # the consumer's copies out of this buffer are done
                    torch.cuda.current_stream().synchronize()
                put(self._store, f"consumed/{index}/{self.rank}", b"1", "receive")
                index += 1
            if unpacker.check_complete():
                raise WeightSyncError("receive", "sender",
                                      f"stream ended inside tensors {unpacker.check_complete()}")
            await_commit(self._store, self.rank, self.plan.timeout_s)
        finally:
            unpacker.close()

    def finalize(self) -> None:
        """Drop the store of this sync; the sender's buffers stay for the next one."""
        if self.rank:
            self._buffers = []
        self._store = None
        super().finalize()

    def close(self) -> None:
        """Sender: unlink and drop the shared buffers."""
        _unlink(self._paths)
        self._buffers, self._paths = [], []
        self._reserved = [0] * N_BUFFERS


_MAPPED: dict[str, torch.Tensor] = {}  # receiver side: path -> mapping, kept for the next sync
_MAPPED_LOCK = threading.Lock()  # receivers of one process (threads) share the mappings


def _map(path: str, size: int) -> torch.Tensor:
    return torch.from_file(path, shared=True, size=size, dtype=torch.uint8)


def _attach(details: dict, size: int) -> list[torch.Tensor]:
    if "cuda_handles" in details:
        return [rebuild(*args) for rebuild, args in details["cuda_handles"]]
    with _MAPPED_LOCK:
        for path in [p for p in _MAPPED if p not in details["paths"]]:  # a former sender's buffers
            del _MAPPED[path]
        for path in details["paths"]:
            if path not in _MAPPED or _MAPPED[path].numel() != size:
                _MAPPED[path] = _map(path, size)
        return [_MAPPED[path] for path in details["paths"]]


def _unlink(paths: list[str]) -> None:
    for path in paths:
        if os.path.exists(path):
            os.unlink(path)
