"""Issue 37: separate_async with one TP=2 native replica spread over two simulated hosts
(network and mount namespaces: no shared loopback or /dev/shm), one server per host. After
training, the replica's greedy tokens equal a fresh TP=1 engine built from the actor's weights,
its log-probs are within the float32 bound, and seeded sampling reproduces."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from two_hosts import TwoHosts, why_not_available

SCRIPT = Path(__file__).with_name("tensor_parallel_hosts_run.py")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def spread_result(tmp_path_factory) -> dict:
    reason = why_not_available()
    if reason:
        pytest.skip(f"two simulated hosts cannot be made here: {reason}")
    directory = tmp_path_factory.mktemp("tp_hosts")
    # 2 CPUs a host: the training worker and one replica bundle share a host
    with TwoHosts(directory, cpus=2) as hosts:
        done = hosts.on("A", [sys.executable, str(SCRIPT), str(directory), hosts.address],
                        capture_output=True, text=True, timeout=800)
        assert done.returncode == 0, done.stderr[-6000:]
        result = json.loads((directory / "result.json").read_text())
        result["ips"] = dict(hosts.ips)
    print("TP=2 over two hosts:", json.dumps(result, indent=1))
    return result


def test_one_replica_has_a_server_on_each_host(spread_result):
    result, ips = spread_result, spread_result["ips"]
    assert result["replicas"] == 1 and result["engine_ranks"] == 2
    assert sorted([result["main_ip"], *result["rank_host_ips"]]) == sorted(ips.values())
    assert result["rank_host_ranks"] == [[1]]
    assert result["step"] == 2


def test_the_spread_replica_serves_the_actors_weights_like_one_rank(spread_result):
    greedy = spread_result["greedy"]
    assert greedy["served"] == greedy["fresh"]
    assert greedy["served_versions"] == [2, 2, 2]
    assert greedy["bound_ratio"] <= 1.0, greedy
    assert all(first == second for first, second in greedy["seeded"])
