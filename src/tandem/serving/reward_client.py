"""The reward-model client: score(request_id, sequences) through the same load balancer the
rollout servers use (serving/balancer.py). A server whose actor died, or stalled (answers no
weight_version() probe within stall_timeout_s: client.unless_stalled), leaves the balancer and
the call runs again on another; with none left, NoServerError (the caller fails its samples)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Sequence

from tandem.serving.client import DEAD_SERVER_ERRORS, STALL_TIMEOUT_S, ServerStalled, unless_stalled
from tandem.serving.remote import call, resolve, submit

logger = logging.getLogger(__name__)


class RewardModelClient:
    """Routes each score call to the least-loaded reward server; always releases it."""

    def __init__(self, balancer: Any, servers: dict[str, Any], timeout_s: float | None = None,
                 stall_timeout_s: float | None = STALL_TIMEOUT_S) -> None:
        self.balancer = balancer
        self.servers = servers  # server_id -> RewardModelServer actor (or local object)
        self.timeout_s = timeout_s
        self.stall_timeout_s = stall_timeout_s  # None: never probe the server

    async def score(self, request_id: str, sequences: Sequence[Sequence[int]]) -> list[float | None]:
        """One score per sequence (None: that sequence could not be scored)."""
        while True:  # ends: each failure removes a server, which acquire() never returns again
            acquire = asyncio.ensure_future(resolve(submit(self.balancer, "acquire", request_id),
                                                    cancel_remote=False))
            try:
                server_id = await asyncio.shield(acquire)
            except asyncio.CancelledError:  # the balancer may count it: release once it answers
                acquire.add_done_callback(self._release_if_acquired)
                raise
            try:
                server = self.servers[server_id]
                return await unless_stalled(server, server_id, resolve(
                    submit(server, "score", list(sequences)), self.timeout_s,
                    f"score() on reward server {server_id!r}"), self.stall_timeout_s)
            except (*DEAD_SERVER_ERRORS, ServerStalled) as error:
                stalled = isinstance(error, ServerStalled)
                if await call(self.balancer, "report_dead", server_id, 1, stalled):
                    logger.warning("reward server %r %s (%s); its calls go to the others",
                                   server_id, "stalled" if stalled else "died", error)
            finally:  # submitted at once: the release happens even if we are cancelled here
                await asyncio.shield(asyncio.ensure_future(resolve(
                    submit(self.balancer, "release", server_id), cancel_remote=False)))

    def _release_if_acquired(self, acquire: asyncio.Future) -> None:
        if not acquire.cancelled() and acquire.exception() is None:
            asyncio.ensure_future(resolve(submit(self.balancer, "release", acquire.result()),
                                          cancel_remote=False))
