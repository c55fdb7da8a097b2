"""Real processes for the weight-sync transport tests: long-lived spawned workers that run one
side of a sync each (a sender keeps its engine, and so delta's base copy, between syncs)."""

from __future__ import annotations

import asyncio
import os
import time
import multiprocessing as mp
from typing import Any, Callable

import torch

from tandem.types import WeightPatch
from tandem.weight_sync.base import WeightSyncError
from tandem.weight_sync.registry import get_checkpoint_engine_class

_SENDERS: dict[str, Any] = {}  # engines kept by a sender worker between syncs


class Worker:
    """One spawned process running functions of this module on request."""

    def __init__(self) -> None:
        context = mp.get_context("spawn")
        self._conn, child = context.Pipe()
        self.process = context.Process(target=_serve, args=(child,), daemon=True)
        self.process.start()
        self._unanswered = 0
        self.submit(ready)  # torch imported and serving: a busy box can take many seconds
        self.result(300)

    def submit(self, function: Callable, *args) -> None:
        self._conn.send((function.__name__, args))
        self._unanswered += 1

    def result(self, timeout_s: float) -> Any:
        """The latest submitted call's return value (answers a failed test left unread are
        dropped); raises if the worker died or ran past timeout_s."""
        if not self._unanswered:
            raise RuntimeError("result() without a submitted call")
        while self._unanswered:
            if not self._conn.poll(timeout_s):
                raise TimeoutError(f"worker gave no answer within {timeout_s} s")
            status, value = self._conn.recv()
            self._unanswered -= 1
        if status == "raise":
            raise value
        return value

    def close(self) -> None:
        if self.process.is_alive():
            self._conn.send(None)
            self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


def _serve(conn) -> None:
    torch.set_num_threads(1)
    while (message := conn.recv()) is not None:
        name, args = message
        try:
            conn.send(("ok", globals()[name](*args)))
        except Exception as error:  # handed back to the test process
            conn.send(("raise", error))


def ready() -> bool:
    return True


def error_record(error: WeightSyncError, started: float) -> dict:
    return {"error": True, "phase": error.phase, "peer": error.peer, "message": str(error),
            "elapsed_s": time.monotonic() - started}


def build_sender(key: str, engine: str, kwargs: dict, n_receivers: int, version: int,
                 receiver_versions: list[int] | None, receiver_slots: list | None = None):
    """Make (or reuse) the sender engine `key` and return its plan."""
    if key not in _SENDERS:
        _SENDERS[key] = get_checkpoint_engine_class(engine)(**kwargs)
    return _SENDERS[key].build_topology(n_receivers, version, receiver_versions, receiver_slots)


def encode_ahead(key: str, engine: str, kwargs: dict, state: dict[str, torch.Tensor],
                 version: int) -> bool:
    """The kept sender `key` (made if new) encodes `state` as `version` ahead of its sync."""
    if key not in _SENDERS:
        _SENDERS[key] = get_checkpoint_engine_class(engine)(**kwargs)
    _SENDERS[key].encode_ahead(state.items(), version)
    return True


def sender_base_version(key: str) -> int | None:
    """The version the kept sender `key` trusts its copy to be (None: the next sync is full)."""
    return _SENDERS[key]._base_version


def use_cuda(index: int) -> str:
    """Select this worker's CUDA device."""
    torch.cuda.set_device(index)
    return torch.cuda.get_device_name(index)


def run_sender(key: str, plan, state: dict[str, torch.Tensor], die_after: int | None = None,
               device: str = "cpu", pause_s: float = 0.0):
    """Rank 0: send `state` (moved to `device`); returns bytes_sent, or the error's record.
    die_after makes this process exit abruptly once that many tensors were taken; pause_s
    sleeps before each tensor (a slow writer)."""
    engine = _SENDERS[key]
    state = {name: tensor.to(device) for name, tensor in state.items()}

    def stream():
        for index, item in enumerate(state.items()):
            if die_after is not None and index == die_after:
                os._exit(3)
            time.sleep(pause_s)
            yield item

    started = time.monotonic()
    try:
        engine.init_process_group(plan, 0)
        asyncio.run(engine.send_weights(stream()))
        return {"error": False, "bytes_sent": engine.bytes_sent}
    except WeightSyncError as error:
        return error_record(error, started)
    finally:
        engine.finalize()


def run_receiver(engine: str, kwargs: dict, plan, rank: int,
                 current: dict[str, torch.Tensor] | None = None, die_after: int | None = None,
                 in_place: bool = False):
    """Rank >= 1: receive everything (cloned), or the error's record. `current` becomes the
    engine's current_weights; die_after exits abruptly after that many tensors; in_place: delta
    yields patches, applied into `current` once the stream ended (the sender committed)."""
    if current is not None:
        kwargs = dict(kwargs, current_weights=current.__getitem__)
        if in_place:
            kwargs["patches_in_place"] = lambda name: True
    receiver = get_checkpoint_engine_class(engine)(**kwargs)
    started = time.monotonic()
    received = {}
    try:
        receiver.init_process_group(plan, rank)
        for index, (name, tensor) in enumerate(receiver.receive_weights()):
            if die_after is not None and index == die_after:
                os._exit(3)
            patch = isinstance(tensor, WeightPatch)
            received[name] = tensor if patch else tensor.to("cpu", copy=True)
        for name, item in received.items():
            if isinstance(item, WeightPatch):
                received[name] = current[name].contiguous()  # in place where it already is
                item.apply_to(received[name])
        return {"error": False, "tensors": received}
    except WeightSyncError as error:
        return error_record(error, started)
    finally:
        receiver.finalize()


def random_state(seed: int = 0, big_elements: int = 400_000) -> dict[str, torch.Tensor]:
    """Mixed shapes and dtypes: a tensor larger than a 1 MiB bucket, a 0-dim one, an empty one,
    a non-contiguous one, NaNs (so bitwise equality is the only honest check)."""
    generator = torch.Generator().manual_seed(seed)
    big = torch.randn(big_elements, generator=generator)
    big[::9973] = float("nan")
    return {
        "embed.weight": torch.randn(300, 64, generator=generator),
        "layers.0.big": big,  # 1.6 MB > one bucket
        "layers.0.bias": torch.randn(64, generator=generator).to(torch.bfloat16),
        "layers.0.half": torch.randn(7, 3, generator=generator).to(torch.float16),
        "scale": torch.tensor(0.125),  # 0-dim
        "step": torch.tensor([3, -1, 2**40], dtype=torch.int64),
        "mask": torch.rand(5, 5, generator=generator) > 0.5,
        "empty": torch.empty(0, 4),
        "transposed": torch.randn(8, 16, generator=generator).t(),  # not contiguous
        "double": torch.randn(11, dtype=torch.float64, generator=generator),
    }


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes."""
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                            b.contiguous().reshape(-1).view(torch.uint8)))
