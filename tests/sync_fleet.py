"""Shared set-up of the cross-process sync tests (test_sync_e2e, test_sync_lora,
test_sync_faults): an FSDP2 actor on 2 gloo ranks (Ray actors), the sync's configs, and helpers
that run inside the training workers. The `fleet` fixture (with 2 standalone servers) is in
conftest.py."""

from __future__ import annotations

import socket
import sys

import ray
import torch
from transformers import AutoModelForCausalLM

from tandem.config.schema import CheckpointEngineConfig, RolloutConfig, TandemConfig
from tandem.rollout.native import NativeRollout
from tandem.serving.manager import ServerManager
from tandem.fleet.weight_sync import CrossProcessSync
from tandem.fleet.hybrid_worker import HybridWorkerActor
from tandem.types import GenerateRequest

# the helpers below run inside the training workers, which cannot import this module
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

ROLLOUT = RolloutConfig(kv_cache_memory_bytes=8 << 20, block_size=16)
GREEDY = {"temperature": 0.0, "max_tokens": 10, "ignore_eos": True}
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13]]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_actor(config: TandemConfig) -> list:
    """Two FSDP2 ranks over gloo, one process each."""
    init_method = f"tcp://127.0.0.1:{free_port()}"
    workers = [HybridWorkerActor.options(num_cpus=0).remote(config, rank, 2, init_method, None,
                                                            None, 1) for rank in range(2)]
    ray.get([worker.ping.remote() for worker in workers], timeout=300)
    return workers


def cross_process(workers: list, servers: ServerManager,
                  config: CheckpointEngineConfig) -> CrossProcessSync:
    """The trainer's cross-process sync from `workers` through the transport `config` names."""
    return CrossProcessSync(workers, servers, config.backend, config.timeout_s, config.engine_kwargs)


def training_config(backend: str, timeout_s: float = 60.0, **engine_kwargs) -> TandemConfig:
    config = TandemConfig()
    config.trainer.n_devices = config.actor.fsdp_size = 2
    config.rollout.checkpoint_engine = CheckpointEngineConfig(
        backend=backend, timeout_s=timeout_s, update_weights_bucket_megabytes=1,
        engine_kwargs=engine_kwargs)
    return config


def on_all(workers: list, function, *args) -> list:
    return ray.get([worker.__ray_call__.remote(function, *args) for worker in workers],
                   timeout=300)


# run inside the training workers (Ray's __ray_call__): test set-up, not product code
def use_engine(worker, config: CheckpointEngineConfig) -> None:
    worker.config.rollout.checkpoint_engine = config
    worker._sync_engine = None


def sparse_tensors(worker) -> int:
    return worker._sync_engine.sparse_tensors


async def fresh_engine_tokens(model_path, state: dict, directory) -> list[list[int]]:
    """Greedy tokens of a new native engine built from `state` saved as an HF model."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected
    model.save_pretrained(directory)
    fresh = NativeRollout.create(directory, ROLLOUT)
    outputs = [await fresh.generate(GenerateRequest(f"f{i}", p, GREEDY)) for i, p in enumerate(PROMPTS)]
    await fresh.shutdown()
    return [output.token_ids for output in outputs]
