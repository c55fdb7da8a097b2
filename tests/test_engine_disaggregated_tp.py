"""A prefill/decode replica of tensor-parallel engines (rollout.disaggregation.kv_transfer=shm:
every rank's KV cache a file in /dev/shm, each decode rank copying its KV heads from the prefill
rank that holds them, process to process) against a plain one-rank engine on a tiny fp32 model
(4 query heads, 2 KV heads): the same greedy tokens, log-probs within the float32 bound, only a
turn's new blocks moved, the heads re-split between different TP sizes, a sleep that re-allocates
the caches, a decode rank's process killed mid-decode, and no file left behind."""

from __future__ import annotations

import asyncio
import dataclasses
import glob
import os
import signal

import pytest
import torch
from transformers import AutoModelForCausalLM

from float_bounds import assert_within, token_logprob_bounds
from test_engine_disaggregated import GREEDY, PLAIN, assert_nothing_held, run_sessions, sessions
from tandem.config.schema import DisaggregationConfig
from tandem.models import build_tiny_model
from tandem.rollout.disaggregated import DisaggregatedRollout
from tandem.rollout.engine.shared_kv import SharedCache, head_plan
from tandem.rollout.native import NativeRollout
from tandem.types import GenerateRequest


def pd_config(prefill_tp: int, decode_tp: int, decodes: int = 1, kv_transfer: str = "shm"):
    return dataclasses.replace(PLAIN, disaggregation=DisaggregationConfig(
        enabled=True, prefill_tensor_parallel_size=prefill_tp, decode_tensor_parallel_size=decode_tp,
        decode_replicas=decodes, kv_transfer=kv_transfer))


@pytest.fixture(scope="module")
def model_path():
    return build_tiny_model()


def own_kv_files() -> list[str]:
    """Every shared KV file (the name holds the creator's pid)."""
    return glob.glob("/dev/shm/tandem-kv-*")


def test_each_decode_head_comes_from_a_prefill_rank_that_holds_it():
    # 2 KV heads: TP 2 -> TP 2 rank to rank; TP 2 -> TP 1 both heads from two ranks
    assert head_plan([(0,), (1,)], (1,)) == [(1, 0, 0)]
    assert head_plan([(0,), (1,)], (0, 1)) == [(0, 0, 0), (1, 0, 1)]
    # TP 4 over 2 KV heads replicates each on two ranks: the first holder serves
    assert head_plan([(0,), (0,), (1,), (1,)], (1,)) == [(2, 0, 0)]
    assert head_plan([(0, 1)], (1,)) == [(0, 1, 0)]
    with pytest.raises(ValueError, match="no prefill rank holds KV head 3"):
        head_plan([(0, 1)], (3,))


def test_a_shared_cache_is_a_file_of_zeros_unlinked_on_close(tmp_path):
    cache = SharedCache(2, (1, 3, 4, 8), torch.float32, (1,), str(tmp_path))
    path = cache.share.path
    assert os.path.getsize(path) == cache.share.nbytes == 2 * 2 * 3 * 4 * 8 * 4
    assert all(t.abs().sum() == 0 for t in cache.key_caches + cache.value_caches)
    cache.value_caches[1][0, 2].fill_(7.0)  # the last layer's values are the file's end
    assert torch.frombuffer(bytearray(open(path, "rb").read()[-4 * 4 * 8:]),
                            dtype=torch.float32).eq(7.0).all()
    cache.close()
    assert not os.path.exists(path)


@pytest.mark.parametrize("prefill_tp, decode_tp", [
    (2, 1), pytest.param(2, 2, marks=pytest.mark.slow), pytest.param(1, 2, marks=pytest.mark.slow)])
async def test_tensor_parallel_sides_equal_a_plain_engine(model_path, prefill_tp, decode_tp):
    """8 two-turn sessions one at a time, then all 16 prompts at once: a plain engine's greedy
    tokens; log-probs within the float32 bound of the exact ones (TP sums in another order);
    the second turns move only their new blocks; nothing held or recomputed."""
    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    plan = sessions(8, hf.config.vocab_size, seed=11)
    plain = NativeRollout.create(model_path, PLAIN)
    pd = DisaggregatedRollout.create(model_path, pd_config(prefill_tp, decode_tp))
    try:
        assert [e.config.tensor_model_parallel_size for e in pd.engines] == [prefill_tp, decode_tp]
        assert len(pd.prefill_engine.kv_shares) == prefill_tp
        expected = await run_sessions(plain, plan, "s")
        got = await run_sessions(pd, plan, "s")
        for (prompt, want), (_, have) in zip(expected, got):
            assert have.token_ids == want.token_ids
            exact, bound = token_logprob_bounds(hf, prompt, have.token_ids)
            assert_within(torch.tensor(have.log_probs), exact, bound, "PD TP vs exact")
        stats = pd.stats()
        assert stats["handoffs_recomputed"] == 0 and stats["kv_transfer_blocks"] > 0
        # every block of every layer's K and V, each head once: bytes = blocks x block bytes
        block = pd.prefill_engine.runner.block_bytes(PLAIN.block_size) * prefill_tp
        assert stats["kv_transfer_bytes"] == stats["kv_transfer_blocks"] * block
        assert_nothing_held(pd)
        prompts = [prompt for prompt, _ in expected]
        at_once = await asyncio.gather(*(pd.generate(GenerateRequest(f"b{i}", p, GREEDY))
                                         for i, p in enumerate(prompts)))
        assert [o.token_ids for o in at_once] == [o.token_ids for _, o in expected]
        assert_nothing_held(pd)
    finally:
        await plain.shutdown()
        await pd.shutdown()


@pytest.mark.slow  # rank processes start for each
async def test_a_second_turn_moves_only_its_new_blocks_between_tp_engines(model_path):
    pd = DisaggregatedRollout.create(model_path, pd_config(2, 2))
    try:
        first = list(range(10, 30))  # 20 tokens: 5 blocks of 4
        answer = await pd.generate(GenerateRequest("s", first, GREEDY))
        moved = pd.transfer.blocks_moved
        assert moved == 5  # the prompt's blocks (the first token is computed on the decode side)
        second = first + answer.token_ids + [40, 41, 42, 43]  # 36 tokens: 9 blocks
        await pd.generate(GenerateRequest("s", second, GREEDY))
        # the decode engine computed 31 tokens (the prompt and 11 of the 12 sampled): its
        # prefix cache holds their 7 full blocks; blocks 8 and 9 of the new prompt move
        assert pd.transfer.blocks_moved - moved == 2
    finally:
        await pd.shutdown()


@pytest.mark.slow  # rank processes start for each
async def test_a_sleep_reallocates_the_shared_caches_and_handoffs_follow(model_path):
    """After sleep/wake of the KV cache each rank publishes a new file, the decode ranks map it
    (dropping the old), and handoffs still move blocks; shutdown leaves no file."""
    before = set(own_kv_files())
    pd = DisaggregatedRollout.create(model_path, pd_config(2, 2))
    try:
        assert len(set(own_kv_files()) - before) == 4  # two ranks per side
        request = GenerateRequest("r", list(range(10, 27)), GREEDY)
        want = await pd.generate(request)
        old = [share.path for share in pd.prefill_engine.kv_shares]
        await pd.sleep(["kv_cache"])
        assert pd.prefill_engine.kv_shares is None
        assert pd.transfer.maps.maps == {}  # nothing keeps the freed files' pages
        await pd.wake_up(["kv_cache"])
        assert [share.path for share in pd.prefill_engine.kv_shares] != old
        assert not any(os.path.exists(path) for path in old)
        moved = pd.transfer.blocks_moved
        again = await pd.generate(GenerateRequest("r2", list(range(10, 27)), GREEDY))
        assert again.token_ids == want.token_ids and pd.transfer.blocks_moved > moved
        assert list(pd.transfer.maps.maps) == [pd.prefill_engine.kv_shares[0].path,
                                               pd.prefill_engine.kv_shares[1].path]
    finally:
        await pd.shutdown()
    assert set(own_kv_files()) <= before


@pytest.mark.slow  # rank processes start for each
async def test_a_decode_rank_process_killed_mid_decode_loses_no_request(model_path):
    """SIGKILL of a decode engine's worker rank while it decodes: that engine is lost (its
    processes stopped), its requests are decoded again on the other one from their prefill,
    every output a plain engine's. The killed rank could not unlink its KV file: the next
    engine that creates one removes it (its creator's pid is gone)."""
    pd = DisaggregatedRollout.create(model_path, pd_config(1, 2, decodes=2))
    plain = NativeRollout.create(model_path, PLAIN)
    try:
        first, second = pd.decode_engines
        long = {**GREEDY, "max_tokens": 40}
        requests = [GenerateRequest(f"r{i}", [11 + i, 40, 7 + 3 * i, 99], long) for i in range(6)]
        running = [asyncio.ensure_future(pd.generate(r)) for r in requests]
        while not (len(first.requests) and len(second.requests)
                   and any(len(s.token_ids) > s.num_prompt_tokens + 2
                           for s in first.requests.values())):
            await asyncio.sleep(0.001)
        os.kill(first.ranks.processes[0].pid, signal.SIGKILL)
        outputs = await asyncio.gather(*running)
        expected = [await plain.generate(r) for r in requests]
        assert [o.token_ids for o in outputs] == [e.token_ids for e in expected]
        assert all(o.stop_reason == "length" for o in outputs)
        assert list(pd.lost) == [1] and pd.requests_moved >= 1
        killed = first.ranks.processes[0]
        assert killed.poll() is not None
        orphan = glob.glob(f"/dev/shm/tandem-kv-{killed.pid}-*")
        assert len(orphan) == 1
        SharedCache(1, (1, 1, 1, 1), torch.float32, (0,)).close()
        assert not os.path.exists(orphan[0])
    finally:
        await pd.shutdown()
        await plain.shutdown()


def test_tp_engines_are_refused_without_the_shm_transfer(model_path):
    with pytest.raises(ValueError, match="kv_transfer='in_process' moves KV between engines of "
                                         "TP 1; tensor-parallel engines need shm"):
        DisaggregatedRollout.create(model_path, pd_config(2, 1, kv_transfer="in_process"))
