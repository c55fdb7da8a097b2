"""Torn weights (issue 11): a weight update that fails part-way changes nothing.

Each case sends good tensors first and then fails (a stream that raises, a wrong shape, a NaN
or an inf), and checks the engine still serves its previous complete version: the same greedy
tokens as before, stamped with the old version. The old engine loaded the good tensors in place
before it met the bad one, so its tokens changed while still carrying the old version.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tandem.config.schema import RolloutConfig
from tandem.models import build_tiny_model
from tandem.rollout.native import NativeRollout
from tandem.types import GenerateRequest

GREEDY = {"temperature": 0, "max_tokens": 10, "ignore_eos": True}
PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def model_path():
    return build_tiny_model()


@pytest.fixture(scope="module")
def new_state(model_path):
    """The tiny model's weights, perturbed enough to change every greedy token stream."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    generator = torch.Generator().manual_seed(1)
    return {name: tensor + torch.randn(tensor.shape, generator=generator)
            for name, tensor in model.state_dict().items()}


def make(model_path, dtype: str = "float32") -> NativeRollout:
    return NativeRollout.create(model_path, RolloutConfig(kv_cache_memory_bytes=4 << 20,
                                                          block_size=4), dtype=dtype)


def good_then(new_state, failure):
    """All new tensors but the last, then `failure(name, tensor)` for the last one."""
    items = list(new_state.items())
    yield from items[:-1]
    yield failure(*items[-1])


def raising(name, tensor):
    raise ConnectionError("peer went away mid-stream")


FAILURES = {
    "stream raises": (raising, ConnectionError, "mid-stream"),
    "wrong shape": (lambda name, t: (name, t[:-1]), ValueError, "shape"),
    "NaN": (lambda name, t: (name, t.index_fill(0, torch.tensor([0]), float("nan"))),
            ValueError, "NaN or inf"),
    "inf": (lambda name, t: (name, t.index_fill(0, torch.tensor([0]), float("inf"))),
            ValueError, "NaN or inf"),
}


@pytest.mark.parametrize("case", list(FAILURES))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
async def test_failed_update_keeps_the_previous_complete_version(model_path, new_state, case,
                                                                 dtype):
    failure, error, message = FAILURES[case]
    rollout = make(model_path, dtype)
    await rollout.update_weights(new_state.items(), version=1)
    before = await rollout.generate(GenerateRequest("before", PROMPT, GREEDY))
    halved = {name: tensor * 0.5 for name, tensor in new_state.items()}
    with pytest.raises(error, match=message):
        await rollout.update_weights(good_then(halved, failure), version=2)
    after = await rollout.generate(GenerateRequest("after", PROMPT, GREEDY))
    assert rollout.weight_version == 1
    assert after.token_ids == before.token_ids and after.global_steps == 1
    # the stream with its last tensor intact loads and changes the tokens: the test can fail
    await rollout.update_weights(halved.items(), version=2)
    changed = await rollout.generate(GenerateRequest("changed", PROMPT, GREEDY))
    assert changed.global_steps == 2 and changed.token_ids != before.token_ids
    await rollout.shutdown()


async def test_inf_after_casting_to_the_engine_dtype_is_rejected(model_path, new_state):
    """A float32 value finite in the stream but beyond float16's range would load as inf."""
    rollout = make(model_path, "float16")
    name, tensor = next(iter(new_state.items()))
    with pytest.raises(ValueError, match="NaN or inf"):
        await rollout.update_weights([(name, tensor.index_fill(0, torch.tensor([0]), 1e5))],
                                     version=1)
    assert rollout.weight_version == 0
    await rollout.shutdown()
