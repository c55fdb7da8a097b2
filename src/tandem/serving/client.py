"""The client: the one token-in/token-out API an agent loop sees.

Routing is sticky on the caller's request_id; every backend call gets a fresh id, so a second
turn of one conversation never collides with the first inside the engine. A server that dies,
or stalls (alive but answering nothing, e.g. SIGSTOPped), leaves the balancer and the request
runs again elsewhere from the same prompt: the server returned no token, so none is lost or
generated twice.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any, Awaitable, Callable, TypeVar

from ray.exceptions import RayActorError

from tandem.rollout.base import ReplicaFailedError
from tandem.serving.balancer import NoServerYet
from tandem.serving.remote import call, is_actor, resolve, submit
from tandem.types import GenerateRequest, TokenOutput

logger = logging.getLogger(__name__)
T = TypeVar("T")

# The server process is gone (ActorDiedError and ActorUnavailableError subclass RayActorError).
# a server whose process is gone, or whose engine can no longer serve (a TP rank died)
DEAD_SERVER_ERRORS = (RayActorError, ReplicaFailedError)
# While a request waits, its server must answer a cheap call (weight_version) within this long;
# far above a busy engine step, so only a server that answers nothing at all is called stalled.
STALL_TIMEOUT_S = 60.0
# How often a request asks again while no server is registered but one is being restarted.
NO_SERVER_YET_POLL_S = 0.2


class ServerStalled(RuntimeError):
    """The server of a request answered no call within the client's stall_timeout_s."""


async def unless_stalled(server: Any, server_id: str, work: Any,
                         stall_timeout_s: float | None) -> Any:
    """Await `work` (a call on `server`); every stall_timeout_s / 2 the server must answer
    weight_version() within stall_timeout_s, else the work is cancelled and ServerStalled
    raised. None: no probe. The generation and reward-model clients' one stall probe."""
    if stall_timeout_s is None:
        return await work
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=stall_timeout_s / 2)
            if done:
                return task.result()
            try:
                await resolve(submit(server, "weight_version"), stall_timeout_s,
                              f"weight_version() on server {server_id!r}")
            except TimeoutError:
                raise ServerStalled(f"server {server_id!r} answered nothing within "
                                    f"{stall_timeout_s:g} s") from None
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


_RELEASES: set[asyncio.Future] = set()  # releases nobody awaits: asyncio keeps only weak refs


async def route(balancer: Any, request_id: str, attempt: Callable[[str], Awaitable[T]],
                what: str) -> T:
    """attempt(server_id) on the server the balancer picks for request_id, which is always
    released. A server that died (DEAD_SERVER_ERRORS) or stalled (ServerStalled) is reported
    to the balancer, which stops routing there, and the attempt runs again on another; none
    left: NoServerError, unless one is being restarted (NoServerYet): then it waits for it. The
    generation and reward-model clients' one routing path."""
    while True:  # ends: each failure removes a server, which acquire() never returns again
        try:
            server_id = await _acquire(balancer, request_id)
        except NoServerYet:  # the fleet restarts one; it ends the wait, or gives up (expect(None))
            await asyncio.sleep(NO_SERVER_YET_POLL_S)
            continue
        try:
            return await attempt(server_id)
        except (*DEAD_SERVER_ERRORS, ServerStalled) as error:
            failure = error
        finally:  # submitted before any await: the release happens even if we are cancelled
            await asyncio.shield(_release(balancer, server_id))
        stalled = isinstance(failure, ServerStalled)
        if await call(balancer, "report_dead", server_id, 1, stalled):
            logger.warning("%s %r %s (%s); removed from the balancer, its calls are retried on "
                           "the others", what, server_id, "stalled" if stalled else "died", failure)


async def _acquire(balancer: Any, request_id: str) -> str:
    acquire = asyncio.ensure_future(resolve(submit(balancer, "acquire", request_id),
                                            cancel_remote=False))
    try:
        return await asyncio.shield(acquire)
    except asyncio.CancelledError:
        # The balancer may still count this request: release as soon as it answers.
        _RELEASES.add(acquire)
        acquire.add_done_callback(lambda done: _release_if_acquired(balancer, done))
        raise


def _release_if_acquired(balancer: Any, acquire: asyncio.Future) -> None:
    _RELEASES.discard(acquire)
    if not acquire.cancelled() and acquire.exception() is None:
        _release(balancer, acquire.result())


def _release(balancer: Any, server_id: str) -> asyncio.Future:
    release = asyncio.ensure_future(resolve(submit(balancer, "release", server_id),
                                            cancel_remote=False))
    _RELEASES.add(release)
    release.add_done_callback(_RELEASES.discard)
    return release


class ServerClient:
    """generate(GenerateRequest) -> TokenOutput through the balancer (a LoadBalancer or its Ray
    actor); `servers` maps server ids to local RolloutServers or Ray handles (an id missing there
    is asked of the balancer)."""

    def __init__(self, balancer: Any, servers: dict[str, Any] | None = None,
                 timeout_s: float | None = None,
                 stall_timeout_s: float | None = STALL_TIMEOUT_S) -> None:
        self.balancer = balancer
        # Kept as given (not copied): a manager adding servers at run time updates it in place.
        self.servers: dict[str, Any] = servers if servers is not None else {}
        self.timeout_s = timeout_s  # per generate call; None waits as long as generation takes
        self.stall_timeout_s = stall_timeout_s  # None: never probe the server

    async def generate(self, request: GenerateRequest) -> TokenOutput:
        """Generate once, with a fresh backend id, on the server `route` picks; extra_fields gets
        min_global_steps / max_global_steps (= global_steps unless set) and version_runs."""
        output = await route(self.balancer, request.request_id,
                             lambda server_id: self._generate_on(server_id, request), "server")
        steps = output.extra_fields["global_steps"]
        output.extra_fields.setdefault("min_global_steps", steps)
        output.extra_fields.setdefault("max_global_steps", steps)
        output.extra_fields["version_runs"] = output.version_runs  # checked; one run if absent
        return output

    async def _generate_on(self, server_id: str, request: GenerateRequest) -> TokenOutput:
        server = await self._server(server_id)
        backend_request = request.replace(
            request_id=f"{request.request_id}-{uuid.uuid4().hex}",
            prompt_ids=list(request.prompt_ids), sampling=dict(request.sampling))
        return await unless_stalled(server, server_id, resolve(
            submit(server, "generate", backend_request), self.timeout_s,
            f"generate({request.request_id!r}) on server {server_id!r}"), self.stall_timeout_s)

    async def _server(self, server_id: str) -> Any:
        return await server_for(self.servers, self.balancer, server_id)


async def server_for(servers: dict[str, Any], balancer: Any, server_id: str) -> Any:
    """The handle of `server_id`: from `servers`, else (a server added after this client was
    made or pickled: a restart, an added replica) from the balancer, then kept in `servers`."""
    server = servers.get(server_id)
    if server is None:
        if not is_actor(balancer):
            raise KeyError(f"server {server_id!r} is registered in the balancer but this "
                           "client was not given it; pass it in `servers`")
        registered = await resolve(submit(balancer, "server_handle", server_id))
        if registered is None:
            raise KeyError(f"server {server_id!r} was registered without a Ray handle; "
                           "in-process servers must be passed to the client in `servers`")
        server = await resolve(registered[0])  # [ObjectRef of the handle] (add_server's caller)
        servers[server_id] = server
    return server
