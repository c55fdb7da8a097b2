"""The global load balancer: sticky routing by the caller's request_id, else least in-flight.

A plain class; `LoadBalancerActor` is the same class as a Ray actor (one per server manager).
Its methods are synchronous, so as an actor it handles one call at a time: counts never race.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import ray


@dataclass
class ServerLoad:
    """One registered server as the balancer sees it."""

    server_id: str
    in_flight: int
    requests: int  # acquisitions since registration


@dataclass
class BalancerStatus:
    """A snapshot of the balancer: servers in registration order and sticky-map size."""

    servers: list[ServerLoad]
    sticky_entries: int
    removed_in_flight: int  # requests still running on servers removed while they ran
    dead_servers: list[str] = field(default_factory=list)  # removed because their actor died
    retried_requests: int = 0  # calls that found their server dead (each tried again elsewhere)
    stalled_servers: list[str] = field(default_factory=list)  # removed: alive, answering nothing
    expected: list[str] = field(default_factory=list)  # being restarted: acquire() says wait

    def in_flight(self) -> dict[str, int]:
        """server_id -> requests in flight."""
        return {load.server_id: load.in_flight for load in self.servers}


class NoServerError(RuntimeError):
    """Every server was removed (or none was ever added); nothing can serve the request."""


class NoServerYet(NoServerError):
    """No server is registered, but one is being restarted (expect()): ask again shortly."""


class LoadBalancer:
    """Picks a server per request: sticky while the remembered server is registered."""

    def __init__(self, max_sticky_entries: int = 100_000) -> None:
        if max_sticky_entries < 1:
            raise ValueError(f"max_sticky_entries must be >= 1, not {max_sticky_entries}")
        self._max_sticky = max_sticky_entries
        self._loads: dict[str, ServerLoad] = {}  # insertion order = registration order
        self._handles: dict[str, Any] = {}
        self._sticky: OrderedDict[str, str] = OrderedDict()  # request_id -> server_id, LRU order
        self._removed_in_flight: dict[str, int] = {}  # removed server_id -> requests still out
        self._dead: list[str] = []
        self._stalled: list[str] = []
        self._retried = 0
        self._expected: set[str] = set()
        self._restarting = False  # a server reported dead is started again: expect it back

    def add_server(self, server_id: str, handle: Any = None) -> None:
        """Register a server and what clients that lack it get back from server_handle() (the
        manager passes [ObjectRef of its Ray handle], None for an in-process server)."""
        if server_id in self._loads:
            raise ValueError(f"server {server_id!r} is already registered")
        self._expected.discard(server_id)
        self._loads[server_id] = ServerLoad(server_id, 0, 0)
        self._handles[server_id] = handle

    def remove_server(self, server_id: str) -> None:
        """Stop routing to a server and drop its sticky entries; its requests in flight finish there
        (their releases count down `removed_in_flight`)."""
        if server_id not in self._loads:
            raise KeyError(f"server {server_id!r} is not registered; registered: "
                           f"{list(self._loads)}")
        load = self._loads.pop(server_id)
        del self._handles[server_id]
        if load.in_flight:
            self._removed_in_flight[server_id] = (self._removed_in_flight.get(server_id, 0)
                                                  + load.in_flight)
        for request_id in [rid for rid, sid in self._sticky.items() if sid == server_id]:
            del self._sticky[request_id]

    def report_dead(self, server_id: str, retried_requests: int = 1, stalled: bool = False) -> bool:
        """A call on server_id found its actor dead (or stalled: alive, answering nothing): stop
        routing to it (its sticky entries go) and count the requests retried elsewhere. True if
        this report removed it (another may have first)."""
        self._retried += retried_requests
        if server_id not in self._loads:
            return False
        self.remove_server(server_id)
        (self._stalled if stalled else self._dead).append(server_id)
        if self._restarting:  # until the fleet names the server it starts in its place
            self._expected.add(server_id)
        return True

    def restart_dead(self) -> None:
        """From now on a server reported dead or stalled is expected back (the fleet restarts
        it): clients wait while no server is registered, until expect(None)."""
        self._restarting = True

    def expect(self, server_id: str | None, expected: bool = True) -> None:
        """A server of this id is being started (a restart): while none is registered, acquire()
        raises NoServerYet, which clients wait on, instead of NoServerError. It ends when the id
        is added, or with expected=False; expect(None) ends every one and restart_dead() (the
        fleet gave up: waiting clients fail now)."""
        if server_id is None:
            self._expected.clear()
            self._restarting = False
        elif expected:
            self._expected.add(server_id)
        else:
            self._expected.discard(server_id)

    def in_flight_on(self, server_id: str) -> int:
        """Requests acquired on server_id and not released yet (registered or removed)."""
        load = self._loads.get(server_id)
        return (load.in_flight if load else 0) + self._removed_in_flight.get(server_id, 0)

    def server_handle(self, server_id: str) -> Any:
        """The handle registered with a server id."""
        if server_id not in self._handles:
            raise KeyError(f"server {server_id!r} is not registered")
        return self._handles[server_id]

    def server_ids(self) -> list[str]:
        """Registered servers in registration order."""
        return list(self._loads)

    def acquire(self, request_id: str) -> str:
        """Choose the server for request_id and count one more request in flight on it."""
        if not self._loads and self._expected:
            raise NoServerYet(f"no server is registered while {sorted(self._expected)} restart")
        if not self._loads:
            raise NoServerError("the load balancer has no servers: every server was removed or "
                                "none was added; add one with add_server() before generating")
        server_id = self._sticky.get(request_id)
        if server_id is None or server_id not in self._loads:
            # min() keeps the first of equal counts, i.e. the first registered server.
            server_id = min(self._loads.values(), key=lambda load: load.in_flight).server_id
        self._sticky[request_id] = server_id
        self._sticky.move_to_end(request_id)
        if len(self._sticky) > self._max_sticky:
            self._sticky.popitem(last=False)
        load = self._loads[server_id]
        load.in_flight += 1
        load.requests += 1
        return server_id

    def release(self, server_id: str) -> None:
        """One request on server_id finished (or failed, or was cancelled)."""
        if self._removed_in_flight.get(server_id):
            # A removed (maybe re-added) id counts its old requests down first: totals stay exact.
            self._removed_in_flight[server_id] -= 1
            return
        load = self._loads.get(server_id)
        if load is None or load.in_flight <= 0:
            raise RuntimeError(f"release() on server {server_id!r} with no request in flight: "
                               "each acquire() must be matched by exactly one release()")
        load.in_flight -= 1

    def status(self) -> BalancerStatus:
        """In-flight and total counts per server, sticky-map size, requests on removed servers,
        dead and stalled servers, retried requests and the servers expected back."""
        return BalancerStatus([ServerLoad(l.server_id, l.in_flight, l.requests)
                               for l in self._loads.values()], len(self._sticky),
                              sum(self._removed_in_flight.values()), list(self._dead),
                              self._retried, list(self._stalled), sorted(self._expected))


# Tiny and synchronous: no CPU reservation, so it never competes with servers for placement.
LoadBalancerActor = ray.remote(num_cpus=0)(LoadBalancer)
