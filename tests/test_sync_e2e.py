"""Issue 13's acceptance: an FSDP2 actor on 2 gloo ranks (Ray actors) syncs into 2 STANDALONE
native servers in their own processes through each cross-process engine (gloo, shm, delta).

Afterwards each server's greedy output equals a fresh engine built from the actor's weights,
token for token, and the tokens carry the new version; requests in flight during a sync finish
with their full budget and show the switch in their min/max versions.
"""

from __future__ import annotations

import asyncio
import sys

import pytest
import ray
import torch

from tandem.models import build_tiny_model
from tandem.serving.manager import ServerManager
from tandem.serving.replica import ServerOptions
from tandem.types import GenerateRequest

from sync_fleet import (GREEDY, PROMPTS, ROLLOUT, cross_process, fresh_engine_tokens, on_all,
                        sparse_tensors, training_config, use_engine)

pytestmark = pytest.mark.slow
# the helpers below run inside the training workers, which cannot import this test module
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


# run inside the training workers (Ray's __ray_call__): test set-up, not product code
def _perturb(worker, seed: int, fraction: float) -> None:
    """Change `fraction` of every local shard's elements (each rank its own shard)."""
    generator = torch.Generator().manual_seed(seed * 10 + worker.rank)
    with torch.no_grad():
        for parameter in worker.actor.model.parameters():
            local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
            noise = torch.randn(local.shape, generator=generator) * 0.3
            mask = torch.rand(local.shape, generator=generator) < fraction
            local.add_(noise * mask)


def _full_state(worker) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in worker.actor.export_weights()}


@pytest.fixture(scope="module")
def model_path():
    return build_tiny_model()


@pytest.fixture(scope="module")
def fleet_config():
    """The training workers' config for conftest's `fleet`."""
    return training_config("gloo")


VERSIONS = iter(range(1, 100))


async def sync_and_check(workers, servers, model_path, tmp_path, config, fraction=1.0,
                         in_flight=0):
    version = next(VERSIONS)
    on_all(workers, _perturb, version, fraction)
    client = servers.resumable_client()
    # long enough to outlast everything a sync does before it aborts (delta's encode ahead, the
    # slot offer, Ray calls on a busy box): 60 tokens finished before the abort in one CI run
    budget = 600
    async def generated() -> int:
        return sum(s["backend"]["generated_tokens"] for s in (await servers.stats()).values())

    before = await generated()  # the fleet is shared by the module's tests: count from here
    running = [asyncio.create_task(client.generate(
        GenerateRequest(f"long{version}-{i}", PROMPTS[i], {"temperature": 0.0, "max_tokens": budget,
                                           "ignore_eos": True}))) for i in range(in_flight)]
    if running:
        while await generated() < before + 4:
            await asyncio.sleep(0.005)
    report = await cross_process(workers, servers, config).sync(version)
    assert report.served == {"replica-0": version, "replica-1": version}, report
    assert report.left_out == {} and await servers.servers_behind(version) == []
    expected = await fresh_engine_tokens(model_path, on_all(workers, _full_state)[0], tmp_path)
    for server_id, replica in servers.replicas.items():
        for i, prompt in enumerate(PROMPTS):
            output = await replica.main_server.generate.remote(GenerateRequest(f"{server_id}-{version}-{i}",
                                                               prompt, GREEDY))
            assert output.token_ids == expected[i], (server_id, i)
            assert output.global_steps == version
    outputs = await asyncio.gather(*running)
    double_buffered = "sync/abort_s" not in report.timings  # the slot path aborts nothing
    assert double_buffered == (config.backend == "shm")  # shm takes the slots where they fit
    for output in outputs:
        assert len(output.token_ids) == budget == len(output.log_probs)
        runs = output.version_runs  # per-token versions: old ones first, the new one last
        assert [v for v, _ in runs] == sorted(v for v, _ in runs) and runs[-1][0] <= version
        if not double_buffered:  # aborted and resumed: every token after the sync is new
            assert output.extra_fields["max_global_steps"] == version == output.global_steps
            assert runs[-1][0] == version
    # the sync came while they generated: at least one holds tokens of the old weights (which
    # requests had a token by then is a race; that 4 were generated before it is not)
    if outputs:
        assert any(output.extra_fields["min_global_steps"] < version for output in outputs)
    return report


@pytest.mark.parametrize("backend", ["gloo", "shm"])
async def test_full_sync_into_standalone_servers(fleet, model_path, tmp_path, backend):
    workers, servers = fleet
    config = training_config(backend).rollout.checkpoint_engine
    on_all(workers, use_engine, config)
    report = await sync_and_check(workers, servers, model_path, tmp_path, config, in_flight=2)
    print(f"{backend} phase timings:", {k: round(v, 4) for k, v in report.timings.items()})


async def test_delta_sync_sends_only_changes_and_matches(fleet, model_path, tmp_path):
    workers, servers = fleet
    config = training_config("delta").rollout.checkpoint_engine
    on_all(workers, use_engine, config)
    await sync_and_check(workers, servers, model_path, tmp_path / "full", config)  # full: no base
    assert on_all(workers[:1], sparse_tensors) == [0]
    report = await sync_and_check(workers, servers, model_path, tmp_path / "delta", config,
                                  fraction=0.01, in_flight=1)
    assert on_all(workers[:1], sparse_tensors)[0] > 0
    print("delta phase timings:", {k: round(v, 4) for k, v in report.timings.items()})


async def test_sync_into_colocated_servers(fleet, model_path, tmp_path):
    """COLOCATED: servers on bundles of a placement group another role holds."""
    from ray.util.placement_group import placement_group, remove_placement_group

    workers, _ = fleet
    group = placement_group([{"CPU": 0.02}] * 2, strategy="STRICT_PACK")
    options = ServerOptions(model_path=str(model_path), start_timeout_s=300)
    servers = await ServerManager.create(ROLLOUT, options, "colocated", placement_group=group)
    try:
        config = training_config("shm").rollout.checkpoint_engine
        on_all(workers, use_engine, config)
        await sync_and_check(workers, servers, model_path, tmp_path, config, in_flight=1)
    finally:
        await servers.shutdown()
        remove_placement_group(group)
