"""Call a method on a Ray actor handle or on a plain local object the same way.

The serving classes run as Ray actors (the product) or as plain objects in the caller's process
(the hybrid in-process mode and fast unit tests); this is the one place that tells them apart.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

import ray
from ray.actor import ActorHandle


class NoAnswerError(TimeoutError):
    """A call got no answer within its deadline (the callee's own TimeoutError is not one)."""


def is_actor(target: Any) -> bool:
    """True for a Ray actor handle, False for a local object."""
    return isinstance(target, ActorHandle)


def submit(target: Any, method: str, *args: Any) -> Any:
    """Start the call now (an actor's task is submitted before this returns, so it runs even if the
    caller is cancelled) and return something awaitable: an ObjectRef, a coroutine or a value."""
    if is_actor(target):
        return getattr(target, method).remote(*args)
    return getattr(target, method)(*args)


async def resolve(pending: Any, timeout_s: float | None = None, what: str = "call",
                  cancel_remote: bool = True) -> Any:
    """Await what submit() returned; NoAnswerError after timeout_s. With cancel_remote, a timeout or
    the caller's cancellation also cancels the remote task."""
    if isinstance(pending, ray.ObjectRef):
        future = asyncio.wrap_future(pending.future())
    elif inspect.isawaitable(pending):
        future = asyncio.ensure_future(pending)
    else:
        return pending
    try:
        # asyncio.wait, not wait_for: a TimeoutError raised by the callee must pass through as is.
        done, _ = await asyncio.wait({future}, timeout=timeout_s)
    except asyncio.CancelledError:
        await _cancel(pending, future, cancel_remote)
        raise
    if not done:
        await _cancel(pending, future, cancel_remote)
        raise NoAnswerError(f"{what} got no answer within {timeout_s} s")
    return future.result()


async def _cancel(pending: Any, future: asyncio.Future, cancel_remote: bool) -> None:
    if isinstance(pending, ray.ObjectRef):
        if cancel_remote:
            ray.cancel(pending)  # the caller gave up: stop the remote work too
        # nobody awaits it any more: read its outcome (TaskCancelledError) when it lands, or
        # asyncio logs "Future exception was never retrieved" with a traceback at exit
        future.add_done_callback(_discard_outcome)
    else:
        future.cancel()  # a local coroutine is this caller's own work: let its cleanup finish
        await asyncio.wait({future})


def _discard_outcome(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


async def call(target: Any, method: str, *args: Any, timeout_s: float | None = None) -> Any:
    """submit() then resolve(): the result of target.method(*args), local or remote."""
    return await resolve(submit(target, method, *args), timeout_s, f"{method}()")
