"""Issue 11, "sampling values that pass validation but break the engine": a temperature that
overflows the logits, a top_k the step cannot build, values of the wrong type misread
silently. Each is refused (naming the field) or made harmless, and a bad request never fails
its neighbours."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from tandem.config.schema import RolloutConfig
from tandem.models import build_tiny_model
from tandem.rollout.engine.sampler import sample
from tandem.rollout.engine.sequence import Sequence
from tandem.rollout.native import NativeRollout
from tandem.types import GenerateRequest, SamplingParams, TEMPERATURE_FLOOR

# the largest logit is not the last: the old overflow picked the last token id every time
LOGITS = torch.tensor([0.5, 3.0, 1.0, -2.0, 0.0, 2.9])
GREEDY = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}


@pytest.mark.parametrize("bad, words", [
    ({"logprobs": "false"}, "sampling logprobs='false': must be true or false"),
    ({"ignore_eos": "false"}, "sampling ignore_eos='false': must be true or false"),
    ({"logprobs": 0}, "sampling logprobs=0: must be true or false"),
    ({"max_tokens": 2.5}, "sampling max_tokens=2.5: must be an integer, not float"),
    ({"max_tokens": "16"}, "sampling max_tokens='16': must be an integer, not str"),
    ({"max_tokens": True}, "sampling max_tokens=True: must be an integer, not bool"),
    ({"top_k": 2.5}, "sampling top_k=2.5: must be an integer"),
    ({"top_k": "5"}, "sampling top_k='5': must be an integer"),
    ({"top_k": 2**63}, f"sampling top_k={2**63}: use -1 to disable or a positive count"),
    ({"temperature": "1.0"}, "sampling temperature='1.0': must be a number, not str"),
    ({"temperature": True}, "sampling temperature=True: must be a number, not bool"),
    ({"temperature": float("inf")}, "sampling temperature=inf: must be finite"),
    ({"top_p": "1.0"}, "sampling top_p='1.0': must be a number"),
    ({"top_p": float("nan")}, "sampling top_p=nan: must be finite"),
    ({"repetition_penalty": "1.1"}, "sampling repetition_penalty='1.1': must be a number"),
    ({"seed": 2**64}, f"sampling seed={2**64}: must be in [0, 2**64)"),
    ({"seed": 2**200}, "must be in [0, 2**64)"),
    ({"seed": -1}, "sampling seed=-1: must be in [0, 2**64)"),
    ({"seed": 1.5}, "sampling seed=1.5: must be an integer"),
    ({"seed": "7"}, "sampling seed='7': must be an integer"),
    ({"stop_token_ids": ["5"]}, "sampling stop_token_ids='5': must be an integer"),
    ({"stop_token_ids": "57"}, "sampling stop_token_ids='57': must be a list of token ids"),
    ({"stop_token_ids": [-1]}, "token ids are >= 0"),
])
def test_wrong_types_and_ranges_are_refused_naming_the_field(bad, words):
    with pytest.raises(ValueError) as error:
        SamplingParams.from_dict(bad)
    assert words in str(error.value)


def test_numpy_scalars_and_edge_values_are_accepted_as_plain_python():
    params = SamplingParams.from_dict({"temperature": np.float32(0.5), "top_k": np.int64(3),
                                       "max_tokens": np.int32(4), "seed": 2**64 - 1,
                                       "stop_token_ids": (np.int64(7),)})
    assert (type(params.temperature), type(params.top_k), type(params.max_tokens)) == (float, int, int)
    assert params.stop_token_ids == (7,) and type(params.stop_token_ids[0]) is int
    assert SamplingParams.from_dict(params.to_dict()) == params


def one_row(temperature: float, seed: int | None = None) -> list[Sequence]:
    seq = Sequence("s", [0], SamplingParams(temperature=temperature, seed=seed), frozenset(), 100)
    if seed is not None:
        seq.generator = torch.Generator().manual_seed(seed)
    return [seq]


@pytest.mark.parametrize("temperature", [1e-39, 1e-30, 1e-8, TEMPERATURE_FLOOR / 2])
@pytest.mark.parametrize("mode", ["raw", "processed"])
def test_a_temperature_below_the_floor_is_greedy(temperature, mode):
    assert SamplingParams(temperature=temperature).greedy
    generator = torch.Generator().manual_seed(0)
    for seed in range(20):
        tokens, logprobs, *_ = sample(LOGITS[None].clone(), one_row(temperature, seed), mode, generator)
        expected, *_ = sample(LOGITS[None].clone(), one_row(0.0), mode, generator)
        assert tokens == expected == [1]
        assert np.isfinite(logprobs[0])
        # greedy rows report the logprob at temperature 1, like temperature 0
        assert logprobs[0] == pytest.approx(float(LOGITS.log_softmax(-1)[1]), abs=1e-6)


def test_the_floor_itself_still_samples():
    assert not SamplingParams(temperature=TEMPERATURE_FLOOR).greedy


@pytest.fixture(scope="module")
def rollout():
    return NativeRollout.create(build_tiny_model(), RolloutConfig(kv_cache_memory_bytes=8 << 20,
                                                                  block_size=4))


@pytest.mark.parametrize("top_k, words", [
    (2**63, f"sampling top_k={2**63}: use -1 to disable"),
    (2**31, "sampling top_k=2147483648"),
    ("vocab+1", "larger than the vocabulary"),
])
async def test_a_bad_request_beside_a_good_one_fails_alone(rollout, top_k, words):
    if top_k == "vocab+1":
        top_k = rollout.runner.vocab_size + 1
    alone = await rollout.generate(GenerateRequest("alone", [5, 6, 7], GREEDY))
    good, bad = await asyncio.gather(
        rollout.generate(GenerateRequest("good", [5, 6, 7], GREEDY)),
        rollout.generate(GenerateRequest("bad", [5, 6, 8], {**GREEDY, "temperature": 1.0, "top_k": top_k})),
        return_exceptions=True)
    assert isinstance(bad, ValueError) and words in str(bad)
    assert good.token_ids == alone.token_ids and good.stop_reason == "length"
    assert rollout.counters["failed_steps"] == 0


async def test_the_vocabulary_size_as_top_k_still_samples(rollout):
    vocab = rollout.runner.vocab_size
    out = await rollout.generate(GenerateRequest("k", [5, 6, 7], {**GREEDY, "temperature": 1.0, "top_k": vocab,
                                                  "seed": 2**64 - 1}))
    assert len(out.token_ids) == 6


async def test_a_tiny_temperature_generates_the_greedy_tokens(rollout):
    greedy = await rollout.generate(GenerateRequest("g", [5, 6, 7, 9], GREEDY))
    tiny = await rollout.generate(GenerateRequest("t", [5, 6, 7, 9], {**GREEDY, "temperature": 1e-39, "seed": 3}))
    assert tiny.token_ids == greedy.token_ids
    assert tiny.log_probs == pytest.approx(greedy.log_probs, abs=1e-6)
