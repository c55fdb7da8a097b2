"""trainer.deterministic (issue 39): what it derives and refuses at load, the native engine's
batch-invariant steps, and the training side's seeds. The two-run comparison is
tests/e2e/test_e2e_determinism.py."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest
import torch

from tandem.config import ConfigError, load_config
from tandem.config.schema import RolloutConfig
from tandem.models import TinyModelSpec, build_tiny_model
from tandem.rollout.engine.block_manager import BlockManager
from tandem.rollout.engine.scheduler import Scheduler
from tandem.rollout.engine.sequence import Sequence
from tandem.rollout.native import NativeRollout
from tandem.training.determinism import seed_everything, use_deterministic_kernels
from tandem.types import GenerateRequest, SamplingParams

ON = "trainer.deterministic=true"


def test_off_by_default_and_on_derives_the_engine_mode():
    config = load_config()
    assert not config.trainer.deterministic and not config.rollout.batch_invariant
    assert config.rollout.enable_prefix_caching
    config = load_config(overrides=[ON])
    assert config.rollout.batch_invariant and not config.rollout.enable_prefix_caching


REFUSED = [
    (["rollout.name=vllm"], "rollout.batch_invariant", "vllm backend"),
    (["rollout.name=sglang", "model.device=cuda"], "rollout.batch_invariant", "sglang backend"),
    (["trainer.trainer_mode=colocate_async"], "trainer.deterministic", "trainer_mode=sync"),
    (["trainer.trainer_mode=colocate_async", "trainer.async_rollout.max_staleness=0"],
     "trainer.deterministic", "timing"),
    (["trainer.trainer_mode=separate_async"], "trainer.deterministic", "trainer_mode=sync"),
    (["trainer.n_devices=2", "actor.fsdp_size=2"], "trainer.n_devices", "2 rollout replicas"),
    (["rollout.nnodes=1", "rollout.n_gpus_per_node=1"], "rollout.nnodes", "standalone"),
    (["reward.model.enable=true", "reward.model.path=tiny:reward"], "reward.model.enable",
     "served reward"),
    (["rollout.enable_prefix_caching=true"], "rollout.enable_prefix_caching", "which request ran"),
    (["rollout.batch_invariant=false"], "rollout.batch_invariant", "trainer.deterministic=true"),
]


@pytest.mark.parametrize("overrides, field, words", REFUSED,
                         ids=[" ".join(o) for o, _, _ in REFUSED])
def test_what_cannot_promise_it_is_refused_naming_the_field(overrides, field, words):
    with pytest.raises(ConfigError) as error:
        load_config(overrides=[ON, *overrides])
    assert str(error.value).startswith(f"{field}: "), str(error.value)
    assert words in str(error.value), str(error.value)
    assert "deterministic=false" in str(error.value) or field.startswith("rollout.")


def test_batch_invariant_alone_needs_the_native_engine_without_prefix_cache():
    load_config(overrides=["rollout.batch_invariant=true", "rollout.enable_prefix_caching=false"])
    with pytest.raises(ConfigError, match="^rollout.enable_prefix_caching: "):
        load_config(overrides=["rollout.batch_invariant=true"])
    standalone_tp = ["rollout.nnodes=1", "rollout.n_gpus_per_node=2",
                     "rollout.tensor_model_parallel_size=2"]
    with pytest.raises(ConfigError, match="^rollout.tensor_model_parallel_size: .*one-rank"):
        load_config(overrides=["rollout.batch_invariant=true",
                               "rollout.enable_prefix_caching=false", *standalone_tp])
    path = build_tiny_model(TinyModelSpec(architecture="qwen2"))
    with pytest.raises(ValueError, match="enable_prefix_caching=false"):
        NativeRollout.create(path, RolloutConfig(batch_invariant=True))


def _sequence(name: str, length: int, max_tokens: int) -> Sequence:
    return Sequence(name, list(range(3, 3 + length)), SamplingParams(max_tokens=max_tokens),
                    frozenset(), 4096)


def test_batch_invariant_scheduler_cuts_prompts_at_fixed_boundaries_and_reserves_blocks():
    blocks = BlockManager(num_blocks=64, block_size=4, enable_prefix_caching=False)
    scheduler = Scheduler(blocks, max_num_seqs=8, max_num_batched_tokens=16, batch_invariant=True)
    first, second = _sequence("a", 10, 6), _sequence("b", 20, 2)
    scheduler.add(first)
    scheduler.add(second)
    step = scheduler.schedule()
    # "b"'s first chunk (16 tokens) does not fit the 6 left: it waits instead of being cut at 6
    assert [(item.seq.request_id, item.start, item.num_new) for item in step] == [("a", 0, 10)]
    assert len(first.block_table) == 4  # prompt + max_tokens = 16 tokens reserved at admission
    first.num_computed_tokens = 10
    first.token_ids.append(7)
    step = scheduler.schedule()  # 15 tokens left this step: b still waits for a whole chunk
    assert [(item.seq.request_id, item.start, item.num_new) for item in step] == [("a", 10, 1)]
    scheduler.finish(first)
    assert [(item.seq.request_id, item.start, item.num_new)
            for item in scheduler.schedule()] == [("b", 0, 16)]
    second.num_computed_tokens = 16
    assert [(item.seq.request_id, item.start, item.num_new)
            for item in scheduler.schedule()] == [("b", 16, 4)]
    assert len(second.block_table) == 6  # 20 + 2 tokens, reserved when b was admitted


async def _logprobs_of_one_request(path, batch_invariant: bool, with_others: bool) -> list[float]:
    """A seeded request's log-probs, alone or submitted after 7 others of other lengths."""
    config = RolloutConfig(kv_cache_memory_bytes=1 << 24, max_num_batched_tokens=64,
                           enable_prefix_caching=False, batch_invariant=batch_invariant)
    engine = NativeRollout.create(path, config)
    rng = random.Random(0)
    prompt = [rng.randrange(3, 200) for _ in range(100)]
    sampling = {"temperature": 1.0, "max_tokens": 16, "logprobs": True, "ignore_eos": True}
    others = [[rng.randrange(3, 200) for _ in range(rng.randint(5, 90))] for _ in range(7)]
    tasks = [asyncio.create_task(engine.generate(GenerateRequest(f"o{i}", other,
                                                                 {**sampling, "seed": i})))
             for i, other in enumerate(others if with_others else [])]
    target = asyncio.create_task(engine.generate(GenerateRequest("t", prompt,
                                                                 {**sampling, "seed": 1234})))
    outputs = await asyncio.gather(target, *tasks)
    await engine.shutdown()
    return outputs[0].log_probs


async def test_a_seeded_request_does_not_depend_on_its_neighbours_when_batch_invariant():
    path = build_tiny_model(TinyModelSpec(architecture="qwen2"))
    alone = await _logprobs_of_one_request(path, True, with_others=False)
    shared = await _logprobs_of_one_request(path, True, with_others=True)
    assert alone == shared  # bit for bit
    # without the mode the neighbours move its prompt's chunk boundaries and the matmul shapes:
    # the same tokens, log-probs off by float32 rounding (this is what the mode is for)
    assert (await _logprobs_of_one_request(path, False, with_others=False)
            != await _logprobs_of_one_request(path, False, with_others=True))


def test_training_side_seeds_every_generator_and_pins_the_kernels():
    was = torch.are_deterministic_algorithms_enabled()
    try:
        seed_everything(7)
        drawn = (random.random(), np.random.rand(), torch.rand(1).item())
        seed_everything(7)
        assert (random.random(), np.random.rand(), torch.rand(1).item()) == drawn
        use_deterministic_kernels()
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(was)
