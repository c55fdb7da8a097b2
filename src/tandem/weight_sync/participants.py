"""What each process does in one cross-process sync: the sender (training ranks) and the receivers
(an engine: anything with stage_weights / commit_weights), driven by tandem.fleet.weight_sync. Every
blocking part (rendezvous, transfer, the FSDP gathers) runs in a fresh thread that exits when the
sync ends: the caller's event loop keeps answering, and no second OpenMP team stays behind in a
rollout process (docs/engine.md, "One OpenMP team per process")."""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, TypeVar

import torch

from tandem.weight_sync.base import CheckpointEngine, SyncPlan, WeightSyncError
from tandem.weight_sync.registry import get_checkpoint_engine_class

T = TypeVar("T")


def make_checkpoint_engine(name: str, bucket_megabytes: int, timeout_s: float,
                           **engine_kwargs: Any) -> CheckpointEngine:
    """The registered engine `name` with the config's bucket size and deadline."""
    return get_checkpoint_engine_class(name)(bucket_megabytes, timeout_s, **engine_kwargs)


async def run_in_fresh_thread(function: Callable[[], T], name: str) -> T:
    """Run `function` in a new thread that exits when it returns; await its result here.

    Cancelling the awaiting task does not stop the thread: its own deadlines end it."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():  # the awaiting task was cancelled
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def target() -> None:
        try:
            result, error = function(), None
        except BaseException as raised:  # handed to the awaiting task, not swallowed
            result, error = None, raised
        loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=target, name=name, daemon=True).start()
    return await future


async def receive_into(backend: Any, plan: SyncPlan, rank: int, who: str,
                       engine_kwargs: dict[str, Any] | None = None,
                       progress: dict[str, Any] | None = None) -> dict[str, float]:
    """Join `plan` as receiver `rank`: rendezvous, stage the whole stream, checked (double-buffered:
    the inactive slot the sender wrote), finalize, then swap it in and stamp plan.version; a failure
    raises WeightSyncError with the backend on its previous version. Returns seconds per phase;
    progress["tensors_received"] counts the stream."""
    progress = {} if progress is None else progress
    progress["tensors_received"] = 0

    def counted(stream: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for item in stream:
            progress["tensors_received"] += 1
            yield item

    engine_class = get_checkpoint_engine_class(plan.engine)
    kwargs = dict(engine_kwargs or {})
    if "current_weights" in inspect.signature(engine_class).parameters:  # delta
        kwargs.update(current_weights=backend.current_weight,
                      current_version=backend.weight_version)
        kwargs.update(current_values=getattr(backend, "current_values", None),
                      patches_in_place=getattr(backend, "patches_in_place", None))
    engine = engine_class(max(1, plan.bucket_bytes >> 20), plan.timeout_s, **kwargs)
    timings: dict[str, float] = {}

    def receive() -> Any:
        try:
            with _timed(timings, "init_process_group"):
                engine.init_process_group(plan, rank)
            with _timed(timings, "receive"):
                stream = counted(engine.receive_weights())
                if "slots" in plan.details:  # double-buffered: check the slot the sender wrote
                    return backend.stage_slot_weights(stream, plan.details["slots"][rank - 1].inactive)
                return backend.stage_weights(stream)
        except WeightSyncError:
            raise
        except Exception as error:  # a bad tensor, or a transport bug: name where it happened
            raise WeightSyncError("load", None, f"{who} rejected the stream: "
                                  f"{type(error).__name__}: {error}") from error
        finally:
            with _timed(timings, "finalize"):
                engine.finalize()
                engine.close()  # a receiver's engine serves this one sync

    staged = await run_in_fresh_thread(receive, f"weight-sync-receive-{rank}")
    with _timed(timings, "load"):
        try:
            still = await backend.commit_weights(staged, plan.version,
                                                 bool(plan.details.get("partial")))
        except WeightSyncError:
            raise
        except Exception as error:  # e.g. a tensor-parallel rank that died or stalled
            raise WeightSyncError("load", None, f"{who} could not load version {plan.version}: "
                                  f"{type(error).__name__}: {error}") from error
    if isinstance(still, float):  # the backend says how long generation stood still
        timings["flip"] = still
    return timings


def encode_from(engine: CheckpointEngine | None, version: int,
                named_tensors: Iterator[tuple[str, torch.Tensor]]) -> dict[str, float]:
    """Training side of encode_ahead (blocking; run it in a fresh thread): rank 0 (`engine`
    given) encodes, every other rank only iterates the stream, so the gathers stay in step."""
    timings: dict[str, float] = {}
    with _timed(timings, "encode"):
        try:
            if engine is not None:
                engine.encode_ahead(named_tensors, version)
        finally:
            for _ in named_tensors:
                pass
    return timings


def send_from(engine: CheckpointEngine | None, plan: SyncPlan,
              named_tensors: Iterator[tuple[str, torch.Tensor]]) -> dict[str, float]:
    """Training side of one sync (blocking; run it in a fresh thread). Rank 0 (`engine` given)
    joins as the sender; every other FSDP rank only iterates the stream, so each full-tensor
    gather (a collective of the training group) happens on all ranks in step. The stream is
    always drained, even after a failure, so no rank is left waiting in a gather."""
    timings: dict[str, float] = {}
    try:
        if engine is not None:
            with _timed(timings, "init_process_group"):
                engine.init_process_group(plan, 0)
            with _timed(timings, "send"):
                asyncio.run(engine.send_weights(named_tensors))
            timings["bytes_moved"] = float(getattr(engine, "bytes_sent", 0))
    finally:
        for _ in named_tensors:
            pass
        if engine is not None:
            with _timed(timings, "finalize"):
                engine.finalize()
    return timings


@contextmanager
def _timed(timings: dict[str, float], key: str) -> Iterator[None]:
    """Record the seconds the block took as timings[key] (also when it raises)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        timings[key] = time.perf_counter() - start
