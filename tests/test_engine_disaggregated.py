"""A prefill/decode replica (rollout/disaggregated.py: one prefill and two decode native engines,
KV blocks handed over by engine/kv_handoff.py) against a plain engine on a tiny fp32 model:
greedy tokens and log-probs on 32 prompts of two-turn sessions (the second turn's prompt holds
the first turn's answer and a tool's tokens), only a turn's new blocks moved, a sync between
prefill and decode, an abort mid-decode, a failed transfer, and no block left held."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from float_bounds import assert_within, token_logprob_bounds
from test_engine_tensor_parallel import perturbed_model
from tandem.config.schema import DisaggregationConfig, RolloutConfig
from tandem.rollout.base import ReplicaFailedError
from tandem.models import build_tiny_model
from tandem.rollout.disaggregated import DisaggregatedRollout
from tandem.rollout.engine.kv_transfer import InProcessTransfer, MooncakeTransfer, block_runs
from tandem.rollout.native import NativeRollout
from tandem.types import GenerateRequest

BLOCK = 4
PLAIN = RolloutConfig(kv_cache_memory_bytes=8 << 20, block_size=BLOCK)
PD = dataclasses.replace(PLAIN, disaggregation=DisaggregationConfig(enabled=True,
                                                                     decode_replicas=2))
GREEDY = {"temperature": 0, "max_tokens": 12, "ignore_eos": True, "logprobs": True}


@pytest.fixture(scope="module")
def model_path():
    return build_tiny_model()


def sessions(count: int, vocab: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """(first prompt, the tool's tokens appended after the first answer) per session."""
    rng = random.Random(seed)
    return [([rng.randrange(10, vocab) for _ in range(rng.randint(3, 30))],
             [rng.randrange(10, vocab) for _ in range(rng.randint(1, 9))]) for _ in range(count)]


async def run_sessions(engine, plan, prefix: str) -> list:
    """Both turns of every session, one request at a time; the second turn's prompt is the first
    prompt + its answer + the tool's tokens (the same request id: one session)."""
    outputs = []
    for index, (prompt, tool) in enumerate(plan):
        first = await engine.generate(GenerateRequest(f"{prefix}{index}", prompt, GREEDY))
        second_prompt = prompt + first.token_ids + tool
        second = await engine.generate(GenerateRequest(f"{prefix}{index}", second_prompt, GREEDY))
        outputs += [(prompt, first), (second_prompt, second)]
    return outputs


@contextlib.asynccontextmanager
async def pd_and_plain(model_path, config=PD):
    """A prefill/decode replica of `config` and a plain engine, both shut down after."""
    pd = DisaggregatedRollout.create(model_path, config)
    plain = NativeRollout.create(model_path, PLAIN)
    try:
        yield pd, plain
    finally:
        await pd.shutdown()
        await plain.shutdown()


def assert_nothing_held(pd: DisaggregatedRollout) -> None:
    for engine in pd.engines:
        assert engine.held == {} and engine.requests == {}
        assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


async def test_a_pd_replica_equals_a_plain_engine_on_32_prompts_of_two_turn_sessions(
        model_path):
    """One at a time, a first turn's tokens and log-probs are bit-equal (the same shapes on
    both); a second turn's prompt is partly read from the prefix caches, in other chunks
    on each side, so its log-probs agree within the float32 bound of the exact ones. All 32
    at once: greedy tokens equal."""
    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    plan = sessions(16, hf.config.vocab_size, seed=3)
    plain = NativeRollout.create(model_path, PLAIN)
    pd = DisaggregatedRollout.create(model_path, PD)
    try:
        expected = await run_sessions(plain, plan, "s")
        got = await run_sessions(pd, plan, "s")
        assert len(got) == 32
        for turn, ((prompt, want), (_, have)) in enumerate(zip(expected, got)):
            assert have.token_ids == want.token_ids, turn
            assert have.extra_fields["version_runs"] == [[0, 12]]
            if turn % 2 == 0:
                assert have.log_probs == want.log_probs, turn
            else:
                exact, bound = token_logprob_bounds(hf, prompt, have.token_ids)
                assert_within(torch.tensor(have.log_probs), exact, bound, "PD vs exact")
                assert_within(torch.tensor(want.log_probs), exact, bound, "plain vs exact")
        stats = pd.stats()
        assert stats["handoffs_recomputed"] == 0 and stats["kv_transfer_blocks"] > 0
        # both decode engines took sessions; each session stayed on one
        assert all(engine.counters["handoff_blocks"] > 0 for engine in pd.decode_engines)
        assert_nothing_held(pd)
        prompts = [prompt for prompt, _ in expected]
        at_once = await asyncio.gather(*(pd.generate(GenerateRequest(f"b{i}", p, GREEDY))
                                         for i, p in enumerate(prompts)))
        assert [o.token_ids for o in at_once] == [o.token_ids for _, o in expected]
        assert_nothing_held(pd)
    finally:
        await plain.shutdown()
        await pd.shutdown()


async def test_a_second_turn_moves_only_its_new_blocks(model_path):
    """The decode engine's prefix cache holds the first turn (prompt and answer), the prefill
    engine's the first prompt: the second turn computes and moves only what they lack."""
    pd = DisaggregatedRollout.create(model_path, PD)
    prefill = pd.prefill_engine
    try:
        prompt, tool = list(range(10, 27)), [40, 41, 42, 43, 44]  # 17 prompt tokens
        first = await pd.generate(GenerateRequest("session", prompt, GREEDY))
        decode = next(e for e in pd.decode_engines if e.counters["handoff_blocks"])
        assert decode.counters["handoff_blocks"] == -(-17 // BLOCK)  # all 5 blocks, cold
        second_prompt = prompt + first.token_ids + tool  # 34 tokens
        computed = prefill.counters["prompt_tokens_computed"]
        moved = decode.counters["handoff_blocks"]
        await pd.generate(GenerateRequest("session", second_prompt, GREEDY))
        # prefill: its cache has the first prompt's 4 full blocks (16 tokens)
        assert prefill.counters["prompt_tokens_computed"] - computed == 34 - 16
        # decode: its cache has the 7 full blocks of turn one's 28 computed tokens (17 + 11:
        # the last answer token's KV is never computed); 9 blocks cover 34 tokens: 2 move
        assert decode.counters["handoff_blocks"] - moved == -(-34 // BLOCK) - (17 + 11) // BLOCK
        assert_nothing_held(pd)
    finally:
        await pd.shutdown()


async def test_a_sync_between_prefill_and_decode_recomputes_with_the_new_weights(
        model_path, tmp_path):
    """KV computed with version 0 is never decoded with version 1 (invariant 3): the decode
    engine recomputes the prompt; the first token keeps its version, the rest are the new
    weights' continuation."""
    state = perturbed_model(model_path, tmp_path, seed=1)  # saved in tmp_path
    pd = DisaggregatedRollout.create(model_path, PD)
    fresh = NativeRollout.create(tmp_path, PLAIN)
    try:
        request = GenerateRequest("r", list(range(10, 23)), GREEDY)
        prefilled = await pd.prefill_engine.prefill(request)
        await pd.update_weights(state.items(), version=1)
        assert [engine.weight_version for engine in pd.engines] == [1, 1, 1]
        assert pd.prefill_engine.held == {}  # the sync's preemption keeps nothing of version 0
        output = await pd.decode_engines[0].generate_prefilled(request, prefilled,
                                                               pd.prefill_engine, pd.transfer)
        assert pd.decode_engines[0].counters["handoffs_recomputed"] == 1
        assert output.extra_fields["version_runs"] == [[0, 1], [1, 11]]
        assert output.token_ids[0] == prefilled.token
        tail = await fresh.generate(GenerateRequest("t", request.prompt_ids + [prefilled.token],
                                                    {**GREEDY, "max_tokens": 11}))
        assert output.token_ids[1:] == tail.token_ids
        assert_nothing_held(pd)
    finally:
        await pd.shutdown()
        await fresh.shutdown()


async def test_an_abort_mid_decode_and_a_failed_transfer_lose_nothing(model_path):
    async with pd_and_plain(model_path) as (pd, plain):
        long = {**GREEDY, "max_tokens": 400}
        running = asyncio.ensure_future(pd.generate(GenerateRequest("long", [5, 6, 7], long)))
        while not any(engine.requests.get("long") for engine in pd.decode_engines):
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.05)
        await pd.abort("long")
        aborted = await running
        assert aborted.stop_reason == "aborted" and 1 <= len(aborted.token_ids) < 400
        assert len(aborted.log_probs) == len(aborted.token_ids)
        assert_nothing_held(pd)

        class Broken:
            blocks_moved = bytes_moved = 0

            def move(self, *args):
                raise OSError("link down")

        pd.transfer = Broken()  # the request's transfer fails: the decode side recomputes
        request = GenerateRequest("again", list(range(30, 45)), GREEDY)
        output = await pd.generate(request)
        assert output.token_ids == (await plain.generate(request)).token_ids
        assert sum(e.counters["handoffs_recomputed"] for e in pd.decode_engines) == 1
        assert_nothing_held(pd)


async def until_decoding(engine, count: int) -> None:
    """Wait until `engine` decodes `count` requests that each have some tokens beyond the first."""
    while sum(len(seq.token_ids) > seq.num_prompt_tokens + 2
              for seq in engine.requests.values()) < count:
        await asyncio.sleep(0.001)


async def test_a_decode_engine_killed_mid_transfer_or_mid_decode_loses_no_request(model_path,
                                                                                  tmp_path):
    """Killed mid-transfer (the copy fails as the engine stops), the request is decoded on the
    other decode engine; killed while decoding 4 requests, each is decoded again there from its
    prefill. Every output equals a plain engine's, none aborted or cut; the lost engine gets no
    more requests or weights; the replica fails only when no decode engine is left."""
    three = dataclasses.replace(PD, disaggregation=DisaggregationConfig(enabled=True,
                                                                        decode_replicas=3))
    async with pd_and_plain(model_path, three) as (pd, plain):
        first, second, third = pd.decode_engines
        class KillsItsTarget(InProcessTransfer):
            def copy(self, source, source_blocks, target, target_blocks):
                engine = next(e for e in pd.decode_engines if e.runner is target)
                asyncio.get_running_loop().create_task(engine.shutdown())
                super().copy(source, source_blocks[:1], target, target_blocks[:1])
                raise ConnectionError("the decode engine went away mid-transfer")

        pd.transfer = KillsItsTarget()
        request = GenerateRequest("mid-transfer", list(range(30, 50)), GREEDY)
        output = await pd.generate(request)
        assert output.token_ids == (await plain.generate(request)).token_ids
        assert output.log_probs == pytest.approx((await plain.generate(request)).log_probs, abs=1e-5)
        assert pd.lost == {1: "shut down"} and pd.requests_moved == 1  # engine 0 is the prefill
        pd.transfer = InProcessTransfer()

        long = {**GREEDY, "max_tokens": 60}
        requests = [GenerateRequest(f"r{i}", [11 + i, 40, 7 + 3 * i, 99], long) for i in range(8)]
        running = [asyncio.ensure_future(pd.generate(r)) for r in requests]
        await until_decoding(second, 2)
        await until_decoding(third, 2)
        await second.shutdown()  # killed with its requests part-decoded
        outputs = await asyncio.gather(*running)
        expected = [await plain.generate(r) for r in requests]
        assert [o.token_ids for o in outputs] == [e.token_ids for e in expected]
        assert all(o.stop_reason == "length" and len(o.token_ids) == 60 for o in outputs)
        assert pd.lost.keys() == {1, 2} and pd.requests_moved >= 1 + 2
        stats = pd.stats()
        assert stats["replica_engines_lost"] == 2 and stats["replica_requests_moved"] == pd.requests_moved

        # a sync after the losses reaches the prefill and the one decode engine left
        await pd.update_weights(perturbed_model(model_path, tmp_path).items(), version=3)
        assert [e.weight_version for e in pd.engines] == [3, 0, 0, 3]
        assert pd.weight_version == 3

        await third.shutdown()
        with pytest.raises(ReplicaFailedError, match="every decode engine stopped.*engine 3: shut down"):
            await pd.generate(GenerateRequest("none left", [5, 6, 7], GREEDY))


async def test_with_its_prefill_engine_stopped_the_decode_engines_serve_whole_requests(model_path):
    async with pd_and_plain(model_path) as (pd, plain):
        request = GenerateRequest("p", list(range(20, 33)), GREEDY)
        before = await pd.generate(request)
        await pd.prefill_engine.shutdown()
        after = await pd.generate(request)
        assert before.token_ids == after.token_ids == (await plain.generate(request)).token_ids
        assert pd.lost == {0: "shut down"} and pd.weight_version == 0


def mooncake_or_skip():
    """Mooncake's transfer engine (the pd extra; `make ibverbs` installs libibverbs1 where it
    can), or a skip naming the fix."""
    try:
        return MooncakeTransfer()
    except ImportError as error:
        pytest.skip(str(error))


async def test_mooncake_moves_the_blocks_and_the_tokens_are_a_plain_engines(model_path):
    """rollout.disaggregation.kv_transfer=mooncake: the blocks go through Mooncake's transfer
    engine (TCP on loopback), one write per run of each KV head, into the registered cache."""
    mooncake_or_skip()
    mooncake = dataclasses.replace(PD, disaggregation=dataclasses.replace(
        PD.disaggregation, kv_transfer="mooncake"))
    plan = sessions(4, 700, seed=8)
    plain = NativeRollout.create(model_path, PLAIN)
    pd = DisaggregatedRollout.create(model_path, mooncake)
    try:
        assert isinstance(pd.transfer, MooncakeTransfer)
        expected = await run_sessions(plain, plan, "m")
        got = await run_sessions(pd, plan, "m")
        assert [o.token_ids for _, o in got] == [o.token_ids for _, o in expected]
        assert [o.log_probs for _, o in got[::2]] == [o.log_probs for _, o in expected[::2]]
        stats = pd.stats()
        assert stats["handoffs_recomputed"] == 0 and stats["kv_transfer_blocks"] > 0
        runner = pd.prefill_engine.runner
        block_bytes = 2 * len(runner.key_caches) * runner.key_caches[0][:, 0].numel() * 4
        assert stats["kv_transfer_bytes"] == stats["kv_transfer_blocks"] * block_bytes
        assert_nothing_held(pd)
    finally:
        await plain.shutdown()
        await pd.shutdown()


@pytest.mark.parametrize("make", [InProcessTransfer, mooncake_or_skip], ids=["in_process",
                                                                           "mooncake"])
def test_a_transfer_copies_each_block_into_its_place_in_runs(make):
    class Cache:  # a runner's KV caches: [kv heads, blocks, block size, head dim] per layer
        def __init__(self, fill):
            self.block_size = 2
            self.key_caches = [fill(l).contiguous() for l in range(2)]
            self.value_caches = [(-fill(l)).contiguous() for l in range(2)]

    source = Cache(lambda layer: torch.arange(3 * 8 * 2 * 4.0).reshape(3, 8, 2, 4) + layer)
    target = Cache(lambda layer: torch.zeros(3, 8, 2, 4))
    src, dst = [1, 2, 3, 6, 0], [4, 5, 6, 0, 7]
    assert block_runs(src, dst) == [(1, 4, 3), (6, 0, 1), (0, 7, 1)]
    transfer = make()
    moved = transfer.copy(source, src, target, dst)
    assert moved == 2 * 2 * 5 * 3 * 2 * 4 * 4 and transfer.blocks_moved == 5
    for layer in range(2):
        for held, into in ((source.key_caches[layer], target.key_caches[layer]),
                           (source.value_caches[layer], target.value_caches[layer])):
            assert torch.equal(into[:, dst], held[:, src])
            untouched = [b for b in range(8) if b not in dst]
            assert torch.equal(into[:, untouched], torch.zeros(3, len(untouched), 2, 4))
    with pytest.raises(ValueError, match="2 source blocks for 1 target blocks"):
        transfer.copy(source, [0, 1], target, [0])


class PausingServer:
    """What the resumable client talks to, over a PD replica: after the trainer's abort, a
    re-ask waits until generation resumes (as the rollout server holds it during a sync)."""

    def __init__(self, pd: DisaggregatedRollout) -> None:
        self.pd, self.resumed = pd, asyncio.Event()
        self.resumed.set()

    async def generate(self, request):
        await self.resumed.wait()
        return await self.pd.generate(request)


async def test_a_partial_rollout_resumes_across_a_sync_on_the_new_weights(model_path, tmp_path):
    """A request aborted mid-decode by a sync is asked again by the resumable client with its
    tokens appended: the first part is version 0, the rest version 1 and exactly what the new
    weights continue from the same tokens (no KV of version 0 is decoded after the sync)."""
    from tandem.serving.resumable_client import ResumableClient

    state = perturbed_model(model_path, tmp_path, seed=2)  # saved in tmp_path
    pd = DisaggregatedRollout.create(model_path, PD)
    fresh = NativeRollout.create(tmp_path, PLAIN)
    server = PausingServer(pd)
    try:
        request = GenerateRequest("partial", list(range(40, 58)),
                                  {**GREEDY, "max_tokens": 60})
        running = asyncio.ensure_future(ResumableClient(server).generate(request))
        await until_decoding(pd.decode_engines[0], 1)
        server.resumed.clear()
        await pd.abort_all()  # the trainer's sync: abort, update, resume
        await pd.update_weights(state.items(), version=1)
        server.resumed.set()
        output = await running
        assert output.stop_reason == "length" and len(output.token_ids) == 60
        [[v0, before], [v1, after]] = output.extra_fields["version_runs"]
        assert (v0, v1) == (0, 1) and before >= 3 and before + after == 60
        assert output.extra_fields["resumes"] == 1
        tail = await fresh.generate(GenerateRequest(
            "t", request.prompt_ids + output.token_ids[:before], {**GREEDY, "max_tokens": after}))
        assert output.token_ids[before:] == tail.token_ids
        assert_nothing_held(pd)
    finally:
        await pd.shutdown()
        await fresh.shutdown()
