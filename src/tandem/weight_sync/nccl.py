"""`nccl`: the collective engine on CUDA tensors over a private NCCL group."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from tandem.weight_sync.collective import CollectiveCheckpointEngine

if not dist.is_nccl_available():
    raise ImportError("this torch build has no NCCL (a CPU build); use gloo or shm")
if not torch.cuda.is_available():
    raise ImportError("no CUDA device is visible; use gloo or shm")


class NcclCheckpointEngine(CollectiveCheckpointEngine):
    """CUDA tensors over NCCL; every participant must have its CUDA device selected."""

    name = "nccl"
    device_type = "cuda"

    def _make_group(self, store, rank: int, size: int, timeout: timedelta):
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
