"""Issue 28, "engine bookkeeping": an empty update is refused instead of stamping a new version
on the old weights; versions are integers that never go back; an update must hold every weight
unless it is declared partial. Each refusal leaves the served weights and version as they were."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from tandem.config.schema import RolloutConfig
from tandem.models import build_tiny_model
from tandem.rollout.native import NativeRollout
from tandem.types import GenerateRequest

GREEDY = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}
PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def model_path():
    return build_tiny_model()


@pytest.fixture(scope="module")
def state(model_path):
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    generator = torch.Generator().manual_seed(2)
    return {name: tensor + torch.randn(tensor.shape, generator=generator)
            for name, tensor in model.state_dict().items()}


async def served(rollout: NativeRollout, tag: str) -> tuple[list[int], int]:
    output = await rollout.generate(GenerateRequest(tag, PROMPT, GREEDY))
    return output.token_ids, output.global_steps


async def test_refused_updates_leave_weights_and_version(model_path, state):
    rollout = NativeRollout.create(model_path, RolloutConfig(kv_cache_memory_bytes=4 << 20))
    await rollout.update_weights(state.items(), version=3)
    before = await served(rollout, "before")
    assert before[1] == 3
    some = list(state.items())[:4]
    refusals = [
        ([], 4, ValueError, "the stream held no tensor"),
        ([], 4, ValueError, "the stream held no tensor"),  # partial or not
        (state.items(), 2, ValueError, "older than the served version 3"),
        (state.items(), 4.0, TypeError, "not an integer"),
        (state.items(), "5", TypeError, "not an integer"),
        (state.items(), True, TypeError, "not an integer"),
        (some, 4, ValueError, "holds 4 of the model's 26 weights"),
    ]
    for index, (stream, version, error, words) in enumerate(refusals):
        with pytest.raises(error, match=words):
            await rollout.update_weights(stream, version=version, partial=index == 1)
        assert await served(rollout, f"after-{index}") == before
    # the same version again is a re-sync, a numpy integer is an integer
    await rollout.update_weights(state.items(), version=3)
    await rollout.update_weights(state.items(), version=np.int64(4))
    assert rollout.weight_version == 4 and type(rollout.weight_version) is int
    # a declared partial update may hold some weights only
    name, tensor = some[0]
    await rollout.update_weights([(name, tensor * 0.5)], version=5, partial=True)
    tokens, version = await served(rollout, "partial")
    assert version == 5 and torch.equal(rollout.current_weight(name), tensor * 0.5)
    await rollout.shutdown()


async def test_the_staged_path_of_a_weight_sync_checks_the_same(model_path, state):
    """commit_weights (what a cross-process sync calls after staging) applies the same rules."""
    rollout = NativeRollout.create(model_path, RolloutConfig(kv_cache_memory_bytes=4 << 20))
    with pytest.raises(ValueError, match="held no tensor"):
        await rollout.commit_weights(rollout.stage_weights([]), 1)
    with pytest.raises(ValueError, match="missing e.g."):
        await rollout.commit_weights(rollout.stage_weights(list(state.items())[:2]), 1)
    assert rollout.weight_version == 0
    await rollout.commit_weights(rollout.stage_weights(state.items()), 1)
    with pytest.raises(ValueError, match="versions only increase"):
        await rollout.commit_weights(rollout.stage_weights(state.items()), 0)
    assert rollout.weight_version == 1
    await rollout.shutdown()
