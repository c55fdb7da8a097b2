"""Conformance: token in / token out, logprob modes, stop reasons, abort, sampling translation."""

from __future__ import annotations

import asyncio
import math

import pytest

from conformance.conftest import SPEC, logprob_tolerance
from conformance.helpers import GREEDY, assert_greedy, hf_logprobs, wait_generated
from tandem.types import GenerateRequest

PROMPT = [5, 6, 7, 8, 9, 10]


def test_greedy_tokens_and_one_raw_logprob_per_token(rollout, reference, loop, device):
    out = loop.run_until_complete(rollout.generate(GenerateRequest("g", PROMPT, GREEDY)))
    assert len(out.token_ids) == 8 and len(out.log_probs) == 8
    assert out.stop_reason == "length" and out.global_steps == rollout.weight_version == 0
    tolerance = logprob_tolerance(device)
    assert_greedy(reference, PROMPT, out.token_ids, tolerance)
    assert out.log_probs == pytest.approx(hf_logprobs(reference, PROMPT, out.token_ids),
                                          abs=tolerance)
    unlogged = loop.run_until_complete(rollout.generate(GenerateRequest("n", PROMPT, {**GREEDY, "logprobs": False})))
    assert unlogged.token_ids == out.token_ids and unlogged.log_probs is None


def test_raw_logprobs_are_the_model_distribution_at_any_temperature(rollout, reference, loop,
                                                                    device):
    params = {"temperature": 0.7, "max_tokens": 12, "ignore_eos": True}
    out = loop.run_until_complete(rollout.generate(GenerateRequest("raw", PROMPT, params)))
    assert len(out.log_probs) == len(out.token_ids) == 12
    assert out.log_probs == pytest.approx(hf_logprobs(reference, PROMPT, out.token_ids),
                                          abs=logprob_tolerance(device))


def test_processed_logprobs_follow_the_temperature(engines, model_path, reference, loop, device):
    cls = engines.cls
    if not cls.supports("logprobs_processed", device):
        with pytest.raises(ValueError, match="logprobs_mode"):
            engines.get(model_path, "processed")
        return
    rollout = engines.get(model_path, "processed")
    params = {"temperature": 0.7, "max_tokens": 12, "ignore_eos": True}
    out = loop.run_until_complete(rollout.generate(GenerateRequest("proc", PROMPT, params)))
    assert len(out.log_probs) == len(out.token_ids) == 12
    assert out.log_probs == pytest.approx(hf_logprobs(reference, PROMPT, out.token_ids, 0.7),
                                          abs=logprob_tolerance(device))
    engines.drop(model_path, "processed")


def test_stop_token_completes_and_budget_ends_in_length(rollout, loop):
    greedy = loop.run_until_complete(rollout.generate(GenerateRequest("s0", PROMPT, GREEDY))).token_ids
    # the last token that did not occur before it: generation must stop right there
    stop_at = max(i for i, t in enumerate(greedy) if t not in greedy[:i])
    out = loop.run_until_complete(rollout.generate(
        GenerateRequest("s1", PROMPT, {**GREEDY, "stop_token_ids": [greedy[stop_at]]})))
    assert out.stop_reason == "completed"
    assert out.token_ids == greedy[:stop_at + 1] and len(out.log_probs) == stop_at + 1
    short = loop.run_until_complete(rollout.generate(GenerateRequest("s2", PROMPT, {**GREEDY, "max_tokens": 3})))
    assert short.stop_reason == "length" and short.token_ids == greedy[:3]


def test_budget_is_capped_by_the_remaining_context(rollout, loop):
    context = SPEC.max_position_embeddings
    prompt = [10 + i % 500 for i in range(context - 3)]
    out = loop.run_until_complete(rollout.generate(GenerateRequest("cap", prompt, {**GREEDY, "max_tokens": 50})))
    assert out.stop_reason == "length"
    assert len(out.token_ids) == len(out.log_probs) == 3


def test_abort_returns_the_partial_tokens_and_their_logprobs(rollout, loop, device):
    greedy = loop.run_until_complete(rollout.generate(GenerateRequest("a0", PROMPT, GREEDY))).token_ids

    async def go():
        task = asyncio.ensure_future(rollout.generate(GenerateRequest("a1", PROMPT,
                                                      {**GREEDY, "max_tokens": 400})))
        await wait_generated(rollout, 3)
        await rollout.abort("a1")
        return await asyncio.wait_for(task, 60)

    out = loop.run_until_complete(go())
    assert out.stop_reason == "aborted"
    if not rollout.supports("abort_partial", device):
        assert out.token_ids == []
        return
    assert 3 <= len(out.token_ids) < 400 and len(out.log_probs) == len(out.token_ids)
    assert out.token_ids[:8] == greedy[:len(out.token_ids[:8])]
    assert all(math.isfinite(lp) and lp <= 0 for lp in out.log_probs)


def test_abort_all_stops_every_request(rollout, loop):
    async def go():
        tasks = [asyncio.ensure_future(rollout.generate(GenerateRequest(f"b{i}", [5 + i, 6, 7],
                                                        {**GREEDY, "max_tokens": 400})))
                 for i in range(3)]
        await wait_generated(rollout, 6)
        await rollout.abort_all()
        return await asyncio.wait_for(asyncio.gather(*tasks), 60)

    outs = loop.run_until_complete(go())
    assert all(o.stop_reason == "aborted" and len(o.token_ids) < 400 for o in outs)
    assert all(len(o.log_probs) == len(o.token_ids) for o in outs)


def test_top_k_one_and_tiny_top_p_sample_the_argmax(rollout, loop):
    greedy = loop.run_until_complete(rollout.generate(GenerateRequest("k0", PROMPT, GREEDY))).token_ids
    hot = {"temperature": 1.0, "max_tokens": 8, "ignore_eos": True}
    top_k = loop.run_until_complete(rollout.generate(GenerateRequest("k1", PROMPT, {**hot, "top_k": 1})))
    top_p = loop.run_until_complete(rollout.generate(GenerateRequest("k2", PROMPT, {**hot, "top_p": 1e-6})))
    assert top_k.token_ids == greedy and top_p.token_ids == greedy


def test_repetition_penalty_reaches_the_engine(rollout, loop):
    plain = loop.run_until_complete(rollout.generate(GenerateRequest("r0", PROMPT, {**GREEDY, "max_tokens": 24})))
    out = loop.run_until_complete(rollout.generate(
        GenerateRequest("r1", PROMPT, {**GREEDY, "max_tokens": 24, "repetition_penalty": 1000.0})))
    # a seen token's logit is divided (or, if negative, multiplied) by 1000: it cannot win again
    seen = set(PROMPT)
    for token in out.token_ids:
        assert token not in seen
        seen.add(token)
    assert out.token_ids != plain.token_ids or len(set(plain.token_ids)) == 24


def test_seeds_reproduce_or_are_refused(rollout, loop, device):
    params = {"temperature": 1.0, "max_tokens": 16, "ignore_eos": True, "seed": 1234}
    if not rollout.supports("per_request_seed", device):
        with pytest.raises(ValueError, match="seed"):
            loop.run_until_complete(rollout.generate(GenerateRequest("seed0", PROMPT, params)))
        return
    first = loop.run_until_complete(rollout.generate(GenerateRequest("seed1", PROMPT, params)))
    again = loop.run_until_complete(rollout.generate(GenerateRequest("seed2", PROMPT, params)))
    other = loop.run_until_complete(rollout.generate(GenerateRequest("seed3", PROMPT, {**params, "seed": 99})))
    assert first.token_ids == again.token_ids and first.log_probs == again.log_probs
    assert other.token_ids != first.token_ids


def test_bad_sampling_is_refused_naming_the_field(rollout, loop):
    with pytest.raises(ValueError, match="top_p"):
        loop.run_until_complete(rollout.generate(GenerateRequest("bad", PROMPT, {"top_p": 0.0})))
    with pytest.raises(ValueError, match="unknown sampling keys"):
        loop.run_until_complete(rollout.generate(GenerateRequest("bad", PROMPT, {"max_new_tokens": 3})))
