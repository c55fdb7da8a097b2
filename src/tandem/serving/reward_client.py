"""The reward-model client: score(request_id, sequences) through the same load balancer and the
same routing as the rollout servers (client.route): a server whose actor died, or stalled
(answers no weight_version() probe within stall_timeout_s), leaves the balancer and the call
runs again on another; with none left, NoServerError (the caller fails its samples)."""

from __future__ import annotations

from typing import Any, Sequence

from tandem.serving.client import STALL_TIMEOUT_S, route, server_for, unless_stalled
from tandem.serving.remote import resolve, submit


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
        return await route(self.balancer, request_id,
                           lambda server_id: self._score_on(server_id, list(sequences)),
                           "reward server")

    async def _score_on(self, server_id: str, sequences: list[list[int]]) -> list[float | None]:
        server = await server_for(self.servers, self.balancer, server_id)
        return await unless_stalled(server, server_id, resolve(
            submit(server, "score", sequences), self.timeout_s,
            f"score() on reward server {server_id!r}"), self.stall_timeout_s)
