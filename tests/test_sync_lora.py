"""Issue 25's sync acceptance: a LoRA actor sharded by FSDP2 over 2 gloo ranks (Ray actors)
syncs only its adapter into 2 STANDALONE native servers in their own processes, through gloo,
shm and delta. Afterwards each server's greedy tokens equal a fresh engine built from the
merged actor, the tokens carry the new version, and only adapter bytes travelled."""

from __future__ import annotations

import sys

import pytest
import ray
import torch

from tandem.types import GenerateRequest

from sync_fleet import (GREEDY, PROMPTS, ROLLOUT, cross_process, fresh_engine_tokens, on_all,
                        sparse_tensors, training_config, use_engine)

pytestmark = pytest.mark.slow
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
RANK = 4


def lora_config(backend: str, **engine_kwargs):
    config = training_config(backend, **engine_kwargs)
    config.actor.lora.rank, config.actor.lora.alpha = RANK, 8.0
    return config


# run inside the training workers (Ray's __ray_call__): test set-up, not product code
def _perturb_adapter(worker, seed: int, fraction: float) -> None:
    """Change `fraction` of every local adapter shard's elements."""
    generator = torch.Generator().manual_seed(seed * 10 + worker.rank)
    with torch.no_grad():
        for name, parameter in worker.actor.model.named_parameters():
            if ".lora_" in name:
                local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
                mask = torch.rand(local.shape, generator=generator) < fraction
                local.add_(torch.randn(local.shape, generator=generator) * 0.2 * mask)


def _merged_state(worker) -> dict[str, torch.Tensor]:
    from tandem.training.lora import iter_merged_weights

    return {name: tensor.clone() for name, tensor in iter_merged_weights(worker.actor.model)}


def _sync_bytes(worker) -> tuple[int, int]:
    from tandem.training.lora import adapter_bytes

    return worker._sync_engine.bytes_sent, adapter_bytes(worker.actor.model)


def _trainable_are_adapters(worker) -> bool:
    held = {id(p) for group in worker.actor.optimizer.param_groups for p in group["params"]}
    return held == {id(p) for n, p in worker.actor.model.named_parameters() if ".lora_" in n}


async def base_tokens(model_path) -> list[list[int]]:
    from tandem.rollout.native import NativeRollout

    engine = NativeRollout.create(model_path, ROLLOUT)
    outputs = [await engine.generate(GenerateRequest(f"b{i}", p, GREEDY)) for i, p in enumerate(PROMPTS)]
    await engine.shutdown()
    return [output.token_ids for output in outputs]


@pytest.fixture(scope="module")
def model_path():
    from tandem.models import build_tiny_model

    return build_tiny_model()


@pytest.fixture(scope="module")
def fleet_config():
    """The training workers' config for conftest's `fleet`: a LoRA actor."""
    return lora_config("gloo")


@pytest.mark.parametrize("version, backend, kwargs, fraction", [
    (1, "gloo", {}, 1.0), (2, "shm", {}, 1.0),
    (3, "delta", {"transport": "gloo"}, 1.0),  # the first delta sync is full: no kept copy yet
    (4, "delta", {"transport": "gloo"}, 0.02)])  # sparse, against the servers' adapter
async def test_adapter_only_sync_serves_the_merged_actor(fleet, model_path, tmp_path, version,
                                                         backend, kwargs, fraction):
    workers, servers = fleet
    assert on_all(workers, _trainable_are_adapters) == [True, True]
    config = lora_config(backend, **kwargs).rollout.checkpoint_engine
    if version != 4:  # version 4 keeps version 3's sender: delta remembers what it sent
        on_all(workers, use_engine, config)
    on_all(workers, _perturb_adapter, version, fraction)
    report = await cross_process(workers, servers, config).sync(version)
    assert report.served == {"replica-0": version, "replica-1": version}, report
    sent, adapter = on_all(workers[:1], _sync_bytes)[0]
    print(f"{backend}: {sent} bytes sent, adapter {adapter} bytes")
    assert 0 < sent <= adapter, (sent, adapter)
    if fraction < 1:
        assert on_all(workers[:1], sparse_tensors)[0] > 0 and sent < adapter / 2
    expected = await fresh_engine_tokens(model_path, on_all(workers, _merged_state)[0], tmp_path)
    assert expected != await base_tokens(model_path)  # the adapter changes what is served
    for server_id, replica in servers.replicas.items():
        for i, prompt in enumerate(PROMPTS):
            output = await replica.main_server.generate.remote(
                GenerateRequest(f"{server_id}-{version}-{i}", prompt, GREEDY))
            assert output.token_ids == expected[i], (backend, server_id, i)
            assert output.global_steps == version
