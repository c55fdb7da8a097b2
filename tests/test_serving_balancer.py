"""The load balancer's routing rules, as a plain object (the Ray actor is the same class)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.serving.balancer import LoadBalancer, NoServerError


def balancer_with(*server_ids: str, **kwargs) -> LoadBalancer:
    balancer = LoadBalancer(**kwargs)
    for server_id in server_ids:
        balancer.add_server(server_id)
    return balancer


def test_new_requests_go_to_least_in_flight_with_ties_to_first_registered() -> None:
    balancer = balancer_with("a", "b", "c")
    assert [balancer.acquire(f"r{i}") for i in range(3)] == ["a", "b", "c"]
    balancer.release("b")
    assert balancer.acquire("r3") == "b"
    assert balancer.acquire("r4") == "a"  # all at 1 again: first registered wins
    assert balancer.status().in_flight() == {"a": 2, "b": 1, "c": 1}


def test_a_request_id_sticks_to_its_server_across_turns() -> None:
    balancer = balancer_with("a", "b")
    first = balancer.acquire("conversation")
    balancer.acquire("other")  # the other server now has the same load
    for _ in range(3):
        assert balancer.acquire("conversation") == first  # sticky even when it is busier
    assert balancer.status().in_flight()[first] == 4


def test_removing_a_server_drops_its_sticky_entries_and_reroutes() -> None:
    balancer = balancer_with("a", "b")
    assert balancer.acquire("x") == "a"
    assert balancer.acquire("y") == "b"
    balancer.remove_server("a")
    assert balancer.status().sticky_entries == 1
    assert balancer.acquire("x") == "b"
    assert balancer.status().removed_in_flight == 1
    balancer.release("a")  # the request that was running on "a" finishes late
    status = balancer.status()
    assert status.removed_in_flight == 0 and status.in_flight() == {"b": 2}


def test_no_server_left_is_a_clear_error() -> None:
    balancer = balancer_with("a")
    balancer.remove_server("a")
    with pytest.raises(NoServerError, match="no servers"):
        balancer.acquire("x")
    with pytest.raises(KeyError, match="not registered"):
        balancer.remove_server("a")


def test_sticky_map_is_lru_bounded() -> None:
    balancer = balancer_with("a", "b", max_sticky_entries=2)
    balancer.acquire("old")  # -> a
    balancer.acquire("mid")  # -> b
    balancer.acquire("new")  # -> a; evicts "old"
    assert balancer.status().sticky_entries == 2
    balancer.release("a")
    balancer.release("a")  # a: 0 in flight, b: 1
    balancer.acquire("mid")  # touching "mid" keeps it; b: 2
    assert balancer.acquire("old") == "a"  # forgotten, so least in-flight decides


def test_unmatched_release_and_duplicate_registration_are_errors() -> None:
    balancer = balancer_with("a")
    with pytest.raises(RuntimeError, match="exactly one release"):
        balancer.release("a")
    with pytest.raises(ValueError, match="already registered"):
        balancer.add_server("a")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["acquire", "release", "remove", "add"]),
                          st.integers(0, 5)), max_size=60))
def test_in_flight_counts_stay_exact_under_any_operation_order(ops) -> None:
    balancer = balancer_with("s0", "s1", "s2")
    outstanding: list[str] = []  # server ids of acquisitions not yet released
    for op, arg in ops:
        registered = balancer.server_ids()
        if op == "acquire" and registered:
            outstanding.append(balancer.acquire(f"r{arg}"))
        elif op == "release" and outstanding:
            balancer.release(outstanding.pop(arg % len(outstanding)))
        elif op == "remove" and f"s{arg % 3}" in registered:
            balancer.remove_server(f"s{arg % 3}")
        elif op == "add" and f"s{arg % 3}" not in registered:
            balancer.add_server(f"s{arg % 3}")
    status = balancer.status()
    assert sum(status.in_flight().values()) + status.removed_in_flight == len(outstanding)
    assert all(count >= 0 for count in status.in_flight().values())
