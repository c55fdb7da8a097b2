"""Data parallelism: the process group, FSDP2 sharding (`fully_shard`) and the few collectives
the engine needs. gloo on CPU, NCCL on GPU; one process (no group) is the default."""

from __future__ import annotations

import torch
import torch.distributed as dist
from tensordict import TensorDict

from tandem.batch.jagged import select_samples


def rendezvous_address() -> str:
    """tcp://<this node's IP>:<a free port>: where rank 0 hosts the group's store (call it on
    rank 0's node; the other ranks, on any node, connect there)."""
    import socket

    import ray

    with socket.socket() as sock:
        sock.bind(("", 0))
        port = sock.getsockname()[1]
    return f"tcp://{ray.util.get_node_ip_address()}:{port}"


def init_process_group(rank: int, world_size: int, init_method: str, device: str = "cpu",
                       timeout_s: float = 600.0) -> None:
    """Join the data-parallel group (init_method from rendezvous_address() on rank 0's node);
    its rendezvous and every collective fail after timeout_s (trainer.timeout_s) instead of
    waiting forever for a rank that died."""
    from datetime import timedelta

    if dist.is_initialized():
        raise RuntimeError("init_process_group: torch.distributed is already initialised in this process")
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))


def dp_rank_and_size() -> tuple[int, int]:
    """(rank, world size) of the data-parallel group; (0, 1) without one."""
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def shard_model(model: torch.nn.Module, device: str = "cpu") -> torch.nn.Module:
    """Apply FSDP2: each transformer block (HF `_no_split_modules`) is a unit, then the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    _, world_size = dp_rank_and_size()
    mesh = init_device_mesh("cuda" if device.startswith("cuda") else "cpu", (world_size,))
    block_names = set(getattr(model, "_no_split_modules", None) or [])
    if not block_names:
        raise ValueError(f"shard_model: {type(model).__name__} names no transformer block class "
                         "(_no_split_modules); FSDP needs one to shard layer by layer")
    for module in list(model.modules()):
        if module is not model and type(module).__name__ in block_names:
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def all_reduce(values: list[float], op: str = "sum") -> list[float]:
    """Reduce a few numbers over the data-parallel group (no-op on one process)."""
    if not dist.is_initialized():
        return list(values)
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return tensor.cpu().tolist()


def shard_batch(batch: TensorDict, rank: int, world_size: int) -> TensorDict:
    """This rank's contiguous 1/world_size of the samples (the size must divide evenly); the
    trainer orders the batch first so these shards are token-balanced (batch.balance)."""
    size = batch.batch_size[0]
    if size % world_size:
        raise ValueError(f"shard_batch: {size} samples do not split over {world_size} data-parallel "
                         "ranks; pad first with batch.padding.pad_for_data_parallel")
    chunk = size // world_size
    return select_samples(batch, torch.arange(rank * chunk, (rank + 1) * chunk))
