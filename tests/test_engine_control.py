"""Abort, sleep/wake, weight updates, preemption and bad input on the native engine."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from tandem.config.schema import RolloutConfig
from tandem.models import TinyModelSpec, build_tiny_model
from tandem.rollout.engine.weight_staging import all_finite
from tandem.rollout.native import NativeRollout
from tandem.types import GenerateRequest


GREEDY = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}
PROMPTS = [[5 + i, 6, 7 + 2 * i, 8, 9, 10 + i, 11, 12, 13] * (1 + i % 3) for i in range(6)]


@pytest.fixture(scope="module")
def model_path():
    return build_tiny_model()


def make(model_path, **overrides) -> NativeRollout:
    config = RolloutConfig(kv_cache_memory_bytes=overrides.pop("kv", 8 << 20), block_size=4,
                           **overrides)
    return NativeRollout.create(model_path, config)


async def until_generated(rollout: NativeRollout, count: int, timeout_s: float = 30.0) -> None:
    """Wait until the engine has generated `count` tokens in all (fails instead of hanging)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while rollout.stats()["generated_tokens"] < count:
        assert asyncio.get_running_loop().time() < deadline, f"fewer than {count} tokens"
        await asyncio.sleep(0.001)


async def greedy_all(rollout: NativeRollout, prefix: str = "g") -> list[list[int]]:
    outs = await asyncio.gather(*(rollout.generate(GenerateRequest(f"{prefix}{i}", p, GREEDY))
                                  for i, p in enumerate(PROMPTS)))
    return [out.token_ids for out in outs]


def perturbed_state(model_path, seed: int = 1) -> dict[str, torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    return {name: tensor + 0.05 * torch.randn(tensor.shape, generator=generator)
            for name, tensor in model.state_dict().items()}


async def test_abort_returns_partial_tokens_and_spares_others(model_path):
    rollout = make(model_path)
    long = asyncio.create_task(rollout.generate(GenerateRequest("long", [5, 6, 7], {"temperature": 1.0,
                                                                    "max_tokens": 1000,
                                                                    "ignore_eos": True})))
    other = asyncio.create_task(rollout.generate(GenerateRequest("other", [8, 9], GREEDY)))
    await until_generated(rollout, 5)
    await rollout.abort("long")
    out = await long
    assert out.stop_reason == "aborted"
    assert 0 < len(out.token_ids) < 1000 and len(out.log_probs) == len(out.token_ids)
    assert (await other).stop_reason == "length"
    await rollout.abort("unknown-id")  # a no-op
    assert rollout.stats()["free_blocks"] == rollout.stats()["num_blocks"]


async def test_abort_all_covers_running_and_waiting(model_path):
    rollout = make(model_path, max_num_seqs=2)
    tasks = [asyncio.create_task(rollout.generate(GenerateRequest(f"r{i}", [5, 6, 7 + i], {"max_tokens": 500,
                                                                           "ignore_eos": True})))
             for i in range(5)]
    await until_generated(rollout, 4)
    await rollout.abort_all()
    outs = await asyncio.gather(*tasks)
    assert all(out.stop_reason == "aborted" for out in outs)
    assert any(len(out.token_ids) == 0 for out in outs)  # never admitted
    assert (await rollout.generate(GenerateRequest("after", [5, 6], GREEDY))).stop_reason == "length"


async def test_cancelled_caller_frees_its_request(model_path):
    rollout = make(model_path)
    task = asyncio.create_task(rollout.generate(GenerateRequest("c", [5, 6], {"max_tokens": 10_000,
                                                              "ignore_eos": True})))
    await until_generated(rollout, 3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(100):
        if rollout.stats()["running"] == 0:
            break
        await asyncio.sleep(0.01)
    assert rollout.stats()["running"] == 0


async def test_many_concurrent_tasks_and_a_responsive_loop(model_path):
    rollout = make(model_path)
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    tick_task = asyncio.create_task(ticker())
    outs = await asyncio.gather(*(rollout.generate(GenerateRequest(f"m{i}", [5 + i % 50, 6, 7], {"max_tokens": 8}))
                                  for i in range(100)))
    tick_task.cancel()
    assert all(out.log_probs is not None and len(out.log_probs) == len(out.token_ids)
               for out in outs)
    assert ticks > rollout.stats()["steps"]  # the loop ran between steps


async def test_update_weights_equals_a_fresh_engine_and_reuses_no_old_block(model_path, tmp_path):
    rollout = make(model_path)
    old = await greedy_all(rollout)
    assert rollout.stats()["cached_blocks"] > 0
    state = perturbed_state(model_path)
    await rollout.update_weights(state.items(), version=3)
    assert rollout.weight_version == 3
    assert rollout.stats()["cached_blocks"] == 0
    cached_before = rollout.stats()["prompt_tokens_cached"]
    new = await greedy_all(rollout, prefix="n")
    # identical prompts as before, yet nothing came from the cache computed with old weights
    first_hits = rollout.stats()["prompt_tokens_cached"] - cached_before
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.load_state_dict(state)
    model.save_pretrained(tmp_path)
    fresh = make(tmp_path)
    fresh_cached_before = fresh.stats()["prompt_tokens_cached"]
    expected = await greedy_all(fresh)
    assert new == expected and new != old
    assert first_hits == fresh.stats()["prompt_tokens_cached"] - fresh_cached_before
    out = await rollout.generate(GenerateRequest("v", [5, 6], GREEDY))
    assert out.global_steps == 3


async def test_update_weights_during_generation_recomputes_with_new_weights(model_path):
    rollout = make(model_path)
    task = asyncio.create_task(rollout.generate(GenerateRequest("long", [5, 6, 7], {"max_tokens": 60,
                                                                    "ignore_eos": True})))
    await until_generated(rollout, 5)
    await rollout.update_weights(perturbed_state(model_path).items(), version=1)
    out = await task
    assert out.extra_fields["global_steps"] == 1
    assert out.extra_fields["min_global_steps"] == 0 and out.extra_fields["max_global_steps"] == 1
    assert rollout.stats()["preemptions"] >= 1


async def test_update_weights_accepts_tied_lm_head_and_rejects_bad_tensors(model_path):
    rollout = make(model_path)
    embed = rollout.runner.model.get_input_embeddings().weight
    new_embed = torch.randn_like(embed)
    await rollout.update_weights([("lm_head.weight", new_embed)], version=1, partial=True)
    assert torch.equal(embed, new_embed)
    with pytest.raises(ValueError, match="unknown weight"):
        await rollout.update_weights([("model.no_such.weight", new_embed)], version=2)
    with pytest.raises(ValueError, match="shape"):
        await rollout.update_weights([("model.embed_tokens.weight", new_embed[:-1])], version=2)
    with pytest.raises(TypeError, match="dtype"):
        await rollout.update_weights([("model.embed_tokens.weight", new_embed.long())], version=2)
    assert rollout.weight_version == 1
    assert (await rollout.generate(GenerateRequest("ok", [5, 6], GREEDY))).global_steps == 1


async def test_sleep_kv_cache_frees_it_and_wake_up_matches(model_path):
    rollout = make(model_path)
    before = await greedy_all(rollout)
    assert rollout.memory_bytes()["kv_cache"] > 0
    await rollout.sleep(["kv_cache"])
    assert rollout.memory_bytes()["kv_cache"] == 0
    assert rollout.memory_bytes()["weights"] > 0
    waiting = asyncio.create_task(rollout.generate(GenerateRequest("w", PROMPTS[0], GREEDY)))  # waits for wake_up
    await asyncio.sleep(0.05)
    assert not waiting.done()
    await rollout.wake_up(["kv_cache"])
    assert rollout.memory_bytes()["kv_cache"] > 0
    assert (await waiting).token_ids == before[0]
    assert await greedy_all(rollout, prefix="again") == before
    await rollout.release_kv_cache()
    assert rollout.memory_bytes()["kv_cache"] == 0
    await rollout.resume_kv_cache()
    assert await greedy_all(rollout, prefix="third") == before


async def test_sleep_weights_on_cpu_drops_them_until_refilled(model_path):
    rollout = make(model_path)
    before = await greedy_all(rollout)
    state = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).state_dict()
    await rollout.sleep()
    assert rollout.memory_bytes() == {"weights": 0, "kv_cache": 0}
    with pytest.raises(RuntimeError, match="wake_up"):
        await rollout.generate(GenerateRequest("x", [5, 6], GREEDY))
    await rollout.wake_up()
    with pytest.raises(RuntimeError, match="update_weights"):
        await rollout.generate(GenerateRequest("x", [5, 6], GREEDY))
    items = list(state.items())
    await rollout.update_weights(items[:3], version=1, partial=True)  # still not servable
    with pytest.raises(RuntimeError, match="not refilled"):
        await rollout.generate(GenerateRequest("x", [5, 6], GREEDY))
    await rollout.update_weights(items[3:], version=1, partial=True)
    assert rollout.memory_bytes()["weights"] > 0
    assert await greedy_all(rollout, prefix="back") == before


async def test_sleep_rejects_unknown_tags(model_path):
    rollout = make(model_path)
    with pytest.raises(ValueError, match="unknown memory tags"):
        await rollout.sleep(["optimizer"])


async def test_preemption_by_recompute_keeps_outputs(model_path):
    roomy = make(model_path)
    expected = await greedy_all(roomy)
    # room for about two sequences at a time: with fixed admission running ones get preempted
    # and recomputed
    tight = make(model_path, kv=tight_kv_bytes(roomy), admission="fixed")
    assert await greedy_all(tight) == expected
    assert tight.stats()["preemptions"] > 0
    # admission by free KV (the default) holds the others back instead: nothing is preempted
    following = make(model_path, kv=tight_kv_bytes(roomy))
    assert await greedy_all(following) == expected
    stats = following.stats()
    assert stats["preemptions"] == 0 and stats["admission_held_back"] > 0
    assert stats["admitted"] == len(PROMPTS)


def tight_kv_bytes(rollout: NativeRollout) -> int:
    runner = rollout.runner
    longest = max(len(p) for p in PROMPTS) + GREEDY["max_tokens"]
    return runner.block_bytes(4) * (2 * -(-longest // 4))


async def test_bad_input_fails_only_that_request(model_path):
    rollout = make(model_path)
    good = asyncio.create_task(rollout.generate(GenerateRequest("good", [5, 6, 7], GREEDY)))
    cases = [
        ([], GREEDY, "empty"),
        ([5, 6], {"temperature": 0, "bogus": 1}, "unknown sampling keys"),
        ([5, 6], {"max_tokens": -3}, "max_tokens"),
        ([5, 10**9], GREEDY, r"\[0, "),
        ([5] * 5000, GREEDY, "context"),
    ]
    for prompt, params, message in cases:
        with pytest.raises(ValueError, match=message):
            await rollout.generate(GenerateRequest("bad", prompt, params))
    assert (await good).stop_reason == "length"


async def test_kv_request_larger_than_cache_is_rejected(model_path):
    rollout = make(model_path, kv=tight_kv_bytes(make(model_path)) // 4)
    with pytest.raises(ValueError, match="KV"):
        await rollout.generate(GenerateRequest("big", list(range(5, 60)), {"max_tokens": 200}))


async def test_a_failing_step_fails_its_requests_and_the_engine_keeps_serving(model_path):
    rollout = make(model_path)
    runner = rollout.runner
    real_forward = runner.forward_layers

    def broken(batch, *args):  # fails after its first layer
        yield
        raise RuntimeError("boom")

    runner.forward_layers = broken
    with pytest.raises(RuntimeError, match="step failed.*boom"):
        await rollout.generate(GenerateRequest("x", [5, 6, 7], GREEDY))
    runner.forward_layers = real_forward
    assert (await rollout.generate(GenerateRequest("y", [5, 6, 7], GREEDY))).stop_reason == "length"
    assert rollout.stats()["failed_steps"] == 1


async def test_duplicate_running_request_id_is_rejected(model_path):
    rollout = make(model_path)
    first = asyncio.create_task(rollout.generate(GenerateRequest("dup", [5, 6], {"max_tokens": 50,
                                                                 "ignore_eos": True})))
    await asyncio.sleep(0)
    with pytest.raises(ValueError, match="already running"):
        await rollout.generate(GenerateRequest("dup", [5, 6], GREEDY))
    assert len((await first).token_ids) == 50


def test_engine_survives_a_new_event_loop(model_path):
    rollout = make(model_path)
    first = asyncio.run(rollout.generate(GenerateRequest("a", [5, 6, 7], GREEDY)))
    second = asyncio.run(rollout.generate(GenerateRequest("a", [5, 6, 7], GREEDY)))
    assert first.token_ids == second.token_ids


def test_registry_and_bad_config(model_path):
    from tandem.rollout.registry import get_rollout_class

    assert get_rollout_class("native") is NativeRollout
    with pytest.raises(ValueError, match="max_num_seqs"):
        NativeRollout.create(model_path, RolloutConfig(max_num_seqs=0))
    with pytest.raises(ValueError, match="logprobs_mode"):
        NativeRollout.create(model_path, RolloutConfig(logprobs_mode="weird"))


async def test_shutdown_aborts_and_refuses_new_requests(model_path):
    rollout = make(model_path)
    task = asyncio.create_task(rollout.generate(GenerateRequest("s", [5, 6], {"max_tokens": 10_000,
                                                              "ignore_eos": True})))
    await until_generated(rollout, 2)
    await rollout.shutdown()
    assert (await task).stop_reason == "aborted"
    with pytest.raises(RuntimeError, match="shut down"):
        await rollout.generate(GenerateRequest("t", [5, 6], GREEDY))


async def test_a_long_step_yields_to_the_event_loop_between_layers(model_path, monkeypatch):
    import tandem.rollout.engine.async_engine as async_engine

    monkeypatch.setattr(async_engine, "YIELD_EVERY_S", 0.0)  # every step counts as long
    rollout = make(model_path)
    runner = rollout.runner
    real_forward = runner.forward_layers
    inside = []

    def watched(batch):
        inside.append(True)
        try:
            return (yield from real_forward(batch))
        finally:
            inside.clear()

    runner.forward_layers = watched
    ticks_inside = 0

    async def ticker():
        nonlocal ticks_inside
        while True:
            ticks_inside += bool(inside)
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    out = await rollout.generate(GenerateRequest("p", list(range(5, 45)), {"temperature": 0, "max_tokens": 1}))
    task.cancel()
    assert len(out.token_ids) == 1
    # the one step (prefill + sample) let other tasks run after each of its layers
    assert ticks_inside == len(runner.layers)


def test_a_loop_that_ends_mid_step_leaves_no_half_written_prefix_blocks(monkeypatch):
    import tandem.rollout.engine.async_engine as async_engine

    monkeypatch.setattr(async_engine, "YIELD_EVERY_S", 0.0)  # yield after every layer
    path = build_tiny_model(TinyModelSpec(num_hidden_layers=4))
    params = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}
    prompt = [7, 300, 41, 599, 12, 512, 77, 3, 640, 88, 21, 450, 19, 700, 5, 62, 333, 101, 250]
    expected = asyncio.run(make(path).generate(GenerateRequest("r", prompt, params)))
    rollout = make(path)

    async def torn() -> None:  # asyncio.run cancels the engine task at a layer boundary
        asyncio.create_task(rollout.generate(GenerateRequest("a", prompt, params)))
        for _ in range(3):
            await asyncio.sleep(0)

    asyncio.run(torn())
    again = asyncio.run(rollout.generate(GenerateRequest("b", prompt, params)))
    assert rollout.stats()["prompt_tokens_cached"] == 0  # nothing from the torn step was reused
    assert again.token_ids == expected.token_ids and again.log_probs == expected.log_probs


def test_stepping_in_another_thread_than_the_builder_warns_once(model_path, caplog):
    import threading

    caplog.set_level("WARNING", logger="tandem.rollout.engine.async_engine")
    rollout = make(model_path)  # built in this (live) thread
    asyncio.run(rollout.generate(GenerateRequest("same", [5, 6], GREEDY)))
    assert "OpenMP" not in caplog.text

    def elsewhere() -> None:
        for index in range(2):
            asyncio.run(rollout.generate(GenerateRequest(f"other{index}", [5, 6], GREEDY)))

    thread = threading.Thread(target=elsewhere)
    thread.start()
    thread.join()
    assert caplog.text.count("two OpenMP teams") == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_all_finite_finds_any_nan_or_inf(dtype):
    tensor = torch.linspace(-3.0, 3.0, 257, dtype=dtype).view(1, 257)
    assert all_finite(tensor) and all_finite(tensor[:, :0])
    for bad in (float("nan"), float("inf"), float("-inf")):
        for index in (0, 128, 256):
            broken = tensor.clone()
            broken[0, index] = bad
            assert not all_finite(broken), (bad, index)
