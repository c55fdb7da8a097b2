"""KV transfers of a prefill/decode handoff (kv_handoff.py): copy some blocks of one engine's KV
cache into blocks of another's, every layer's keys and values, block table to block table
(each block copied once, straight into its place; consecutive blocks in one piece).

`InProcessTransfer` serves engines of TP 1 in one process (the disaggregated replica of
rollout/disaggregated.py), on one device or across devices. `MooncakeTransfer` writes the same
runs through Mooncake's transfer engine (rollout.disaggregation.kv_transfer=mooncake: TCP here,
RDMA on clusters; the `pd` extra), the path KV takes between processes and hosts: each side's
cache is registered once and every run is one write into the target's memory. `ShmTransfer`
(kv_transfer=shm, CPU) serves engines of any TP size on one host: every rank's cache is a file in
/dev/shm and each decode rank copies its KV heads from the prefill ranks' files
(shared_kv.py), process to process.
"""

from __future__ import annotations

from typing import Any

from tandem.rollout.engine.shared_kv import KVMaps, copy_heads, head_plan

MOONCAKE_INSTALL = ("pip install 'mooncake-transfer-engine-non-cuda>=0.3.13' (the pd extra; "
                    "mooncake-transfer-engine on CUDA) and the RDMA verbs library it links "
                    "(Debian/Ubuntu: apt-get install libibverbs1)")


def block_runs(source: list[int], target: list[int]) -> list[tuple[int, int, int]]:
    """(source start, target start, count) of the runs where both block lists go up by one
    together: a run is copied in one piece."""
    runs: list[tuple[int, int, int]] = []
    for src, dst in zip(source, target):
        if runs and runs[-1][0] + runs[-1][2] == src and runs[-1][1] + runs[-1][2] == dst:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((src, dst, 1))
    return runs


class KVTransfer:
    """What every transfer does around its writes: the checks, the runs of every layer's keys
    and values, the counts of blocks and bytes. `write` moves one run of one cache tensor."""

    name = ""

    def __init__(self) -> None:
        self.blocks_moved = 0
        self.bytes_moved = 0

    def move(self, source: Any, source_blocks: list[int], target: Any,
             target_blocks: list[int]) -> int:
        """Copy a handoff's blocks from the prefill engine `source` into the decode engine
        `target` (AsyncEngines, under the target's step lock); returns the bytes moved."""
        if source.ranks is not None or target.ranks is not None:
            raise ValueError(f"KV transfer {self.name}: moves KV between engines of TP 1 (one "
                             "process each); tensor-parallel engines need kv_transfer=shm")
        return self.copy(source.runner, source_blocks, target.runner, target_blocks)

    def copy(self, source: Any, source_blocks: list[int], target: Any,
             target_blocks: list[int]) -> int:
        """Copy blocks `source_blocks` of `source`'s cache (a ModelRunner) into `target_blocks`
        of `target`'s, layer by layer; returns the bytes moved."""
        if len(source_blocks) != len(target_blocks):
            raise ValueError(f"KV transfer: {len(source_blocks)} source blocks for "
                             f"{len(target_blocks)} target blocks")
        if not source_blocks:
            return 0
        if source.block_size != target.block_size or len(source.key_caches) != len(
                target.key_caches):
            raise ValueError("KV transfer: the engines' caches differ in block size or layers "
                             "(prefill and decode must serve one model with one block_size)")
        moved = 0
        runs = block_runs(source_blocks, target_blocks)
        for caches in ((source.key_caches, target.key_caches),
                       (source.value_caches, target.value_caches)):
            for held, into in zip(*caches):  # [kv heads, blocks, block size, head dim]
                moved += self.write(held, into, runs)
        self.blocks_moved += len(source_blocks)
        self.bytes_moved += moved
        return moved

    def write(self, held: Any, into: Any, runs: list[tuple[int, int, int]]) -> int:
        raise NotImplementedError


class InProcessTransfer(KVTransfer):
    """Copies between the KV caches of two engines of this process."""

    name = "in_process"

    def write(self, held: Any, into: Any, runs: list[tuple[int, int, int]]) -> int:
        """One strided copy per run, straight into its place."""
        moved = 0
        for start, to, count in runs:
            part = held.narrow(1, start, count)
            into.narrow(1, to, count).copy_(part)
            moved += part.numel() * part.element_size()
        return moved


class MooncakeTransfer(KVTransfer):
    """KV runs written by Mooncake's TransferEngine from the source's cache straight into the
    target's (both registered with it), over TCP on this box."""

    name = "mooncake"

    def __init__(self, host: str = "127.0.0.1") -> None:
        super().__init__()
        try:
            from mooncake.engine import TransferEngine
        except ImportError as error:
            raise ImportError(f"rollout.disaggregation.kv_transfer=mooncake: Mooncake's transfer "
                              f"engine does not import ({error}); {MOONCAKE_INSTALL}") from None
        self.engine = TransferEngine()
        code = self.engine.initialize(host, "P2PHANDSHAKE", "tcp", "")
        if code != 0:
            raise RuntimeError(f"Mooncake's transfer engine did not start on {host} (code {code})")
        self.peer = f"{host}:{self.engine.get_rpc_port()}"
        self.registered: dict[int, int] = {}  # data_ptr -> bytes, of every cache tensor

    def _register(self, tensor: Any) -> int:
        address, size = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        if self.registered.get(address) != size:  # a cache re-allocated after a sleep
            code = self.engine.register_memory(address, size)
            if code != 0:
                raise RuntimeError(f"Mooncake could not register {size} bytes of KV cache "
                                   f"(code {code})")
            self.registered[address] = size
        return address

    def write(self, held: Any, into: Any, runs: list[tuple[int, int, int]]) -> int:
        """Each run of each KV head one write into the target's registered memory."""
        if held.shape[0] != into.shape[0] or held.shape[2:] != into.shape[2:] \
                or held.dtype != into.dtype or not held.is_contiguous() \
                or not into.is_contiguous():
            raise ValueError("KV transfer: the engines' caches differ in layout or dtype "
                             "(prefill and decode must serve one model alike)")
        src, dst = self._register(held), self._register(into)
        block = held.stride(1) * held.element_size()  # bytes of one block of one head
        moved = 0
        for head in range(held.shape[0]):
            src_head = src + head * held.stride(0) * held.element_size()
            dst_head = dst + head * into.stride(0) * into.element_size()
            for start, to, count in runs:
                code = self.engine.transfer_sync_write(
                    self.peer, src_head + start * block, dst_head + to * block, count * block)
                if code != 0:
                    raise RuntimeError(f"Mooncake write of {count} KV block(s) failed "
                                       f"(code {code})")
                moved += count * block
        return moved


class ShmTransfer(KVTransfer):
    """Each rank of the decode engine copies its KV heads from the prefill ranks' shared-memory
    caches (rank 0 here, the others in their processes); the two TP sizes may differ."""

    name = "shm"

    def __init__(self) -> None:
        super().__init__()
        self.maps = KVMaps()  # the prefill ranks' files, as rank 0 of a decode engine maps them

    def forget(self) -> None:
        """Unmap the prefill ranks' files (a sleep: their pages are freed once no one maps them;
        the next handoff maps the files then published)."""
        self.maps = KVMaps()

    def move(self, source: Any, source_blocks: list[int], target: Any,
             target_blocks: list[int]) -> int:
        """Rank 0's heads here while every worker rank copies its own (one command); the bytes
        moved."""
        if len(source_blocks) != len(target_blocks):
            raise ValueError(f"KV transfer: {len(source_blocks)} source blocks for "
                             f"{len(target_blocks)} target blocks")
        shares, targets = source.kv_shares, target.kv_shares
        if shares is None or targets is None:
            raise ValueError("KV transfer shm: both engines' KV caches must be in shared memory "
                             "(engines built with kv_shm_dir)")
        if not source_blocks:
            return 0
        runs = block_runs(source_blocks, target_blocks)
        heads = [share.heads for share in shares]
        plans = [head_plan(heads, share.heads) for share in targets]
        def local() -> int:
            return copy_heads(self.maps.get(shares), plans[0], target.runner.key_caches,
                              target.runner.value_caches, runs)

        moved = local() if target.ranks is None else target.ranks.pull_kv(shares, plans[1:],
                                                                           runs, local)
        self.blocks_moved += len(source_blocks)
        self.bytes_moved += moved
        return moved


def make_transfer(name: str) -> KVTransfer:
    """The KV transfer rollout.disaggregation.kv_transfer names."""
    if name == "in_process":
        return InProcessTransfer()
    if name == "mooncake":
        return MooncakeTransfer()
    if name == "shm":
        return ShmTransfer()
    raise ValueError(f"rollout.disaggregation.kv_transfer={name!r}: use in_process, shm or "
                     "mooncake")
