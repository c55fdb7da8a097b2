"""Admission by free KV (rollout.admission=kv, the native default): the scheduler admits a
waiting sequence only while every admitted sequence's worst case (prompt + max_tokens) fits the
free blocks, times an overcommit learned from how much of it finished sequences used. Driven
here without a model: each step appends one token to every sampling sequence."""

from __future__ import annotations

import pytest

from tandem.config.load import ConfigError, load_config
from tandem.rollout.engine.block_manager import BlockManager
from tandem.rollout.engine.scheduler import Admission, Scheduler
from tandem.rollout.engine.sequence import Sequence
from tandem.types import SamplingParams

BLOCK = 16


def run(follow_kv: bool, sessions: int, prompt: int, max_tokens: int, stop_after: int,
        blocks: int) -> dict:
    """Serve `sessions` requests (each stops after `stop_after` tokens) to the end; counters."""
    manager = BlockManager(blocks, BLOCK, enable_prefix_caching=False)
    scheduler = Scheduler(manager, max_num_seqs=256, max_num_batched_tokens=4096,
                          follow_kv=follow_kv)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for index in range(sessions):
        token_ids = [1 + (index + i) % 50 for i in range(prompt)]
        scheduler.add(Sequence(f"s{index}", token_ids, params, frozenset(), 4096))
    steps, concurrency, computed = 0, [], 0
    while scheduler.has_work():
        steps += 1
        batch = scheduler.schedule()
        concurrency.append(len(scheduler.running))
        for item in batch:
            computed += item.num_new
            item.seq.num_computed_tokens = item.start + item.num_new
            if item.samples:
                item.seq.token_ids.append(7)
                if item.seq.num_generated >= stop_after:
                    item.seq.stop_reason = "completed" if stop_after < max_tokens else "length"
                    scheduler.finish(item.seq)
        assert steps < 10_000, "the scheduler made no progress"
    return {"preemptions": scheduler.num_preemptions, "steps": steps,
            "admitted": scheduler.num_admitted, "peak": max(concurrency), "computed": computed}


def test_a_cache_for_eight_sessions_with_sixty_four_submitted_preempts_nothing():
    # 8 + 56 tokens = 4 blocks each; 32 blocks hold 8 sessions' worst case
    fixed = run(False, 64, 8, 56, 56, blocks=32)
    following = run(True, 64, 8, 56, 56, blocks=32)
    assert fixed["preemptions"] > 64  # admitted on the prompt's block, then preempted
    assert following["preemptions"] == 0
    assert following["admitted"] == 64
    assert following["computed"] == 64 * (8 + 55)  # every token computed once
    assert fixed["computed"] > following["computed"]  # the preempted ones recomputed
    assert following["peak"] == 8  # the same length each: cohorts of 8 start and end together


def test_early_stops_teach_admission_to_overcommit():
    # max_tokens 56, but every answer stops after 8: the worst case overstates each by 3 blocks
    following = run(True, 64, 8, 56, 8, blocks=32)
    worst_only = run(True, 64, 8, 56, 56, blocks=32)
    assert following["peak"] > worst_only["peak"]  # more than the worst case would admit
    assert following["preemptions"] <= 2  # and it did not run into the wall for it


def test_overcommit_halves_on_a_preemption_and_recovers():
    admission = Admission()
    assert admission.overcommit == 1.0
    for _ in range(50):
        admission.finished(tokens=16, worst_tokens=64)  # a quarter of the worst case
    assert admission.overcommit == pytest.approx(4.0, rel=0.05)
    admission.stepped(preempted=True)
    assert admission.overcommit == pytest.approx(2.0, rel=0.05)
    for _ in range(10):
        admission.stepped(preempted=False)
    assert admission.overcommit == pytest.approx(4.0, rel=0.05)


def test_a_prefill_engine_admits_by_the_prompts_not_by_max_tokens():
    """A prefill-only sequence (a prefill/decode replica's prefill side) stops at its first
    token: its worst case is prompt + 1, so a cache for four such prompts takes four at once,
    where four full answers of max_tokens would fit one."""
    def admitted(prefill_only: bool) -> int:
        scheduler = Scheduler(BlockManager(12, BLOCK, enable_prefix_caching=False),
                              max_num_seqs=64, max_num_batched_tokens=4096, follow_kv=True)
        params = SamplingParams(max_tokens=2 * BLOCK * 6, ignore_eos=True)
        for index in range(4):
            seq = Sequence(f"p{index}", [3 + index] * (2 * BLOCK), params, frozenset(), 4096)
            seq.prefill_only = prefill_only
            scheduler.add(seq)
        scheduler.schedule()  # one sequence is always admitted
        scheduler.schedule()
        return len(scheduler.running)

    assert admitted(prefill_only=True) == 4  # 4 x 3 blocks (32 prompt tokens + 1) = 12
    assert admitted(prefill_only=False) == 1  # each may reach 224 tokens: 14 blocks


def test_admission_other_than_auto_is_refused_for_engines_with_their_own_scheduler():
    with pytest.raises(ConfigError, match="rollout.admission: is 'kv', but the vllm backend "
                                          "admits requests by its own scheduler"):
        load_config(overrides=["rollout.name=vllm", "rollout.admission=kv"])
    with pytest.raises(ConfigError, match="rollout.admission"):
        load_config(overrides=["rollout.admission=greedy"])
    assert load_config(overrides=["rollout.admission=fixed"]).rollout.admission == "fixed"


def test_a_handed_over_sequence_is_admitted_by_its_worst_case_too():
    """A prefill/decode handoff (reserve_computed) passes the same check as a waiting sequence:
    with the running sequences' worst cases filling the cache it is held back (the decode side
    then recomputes it in line), and with room it is placed."""
    manager = BlockManager(8, BLOCK, enable_prefix_caching=False)
    scheduler = Scheduler(manager, max_num_seqs=16, max_num_batched_tokens=4096, follow_kv=True)
    params = SamplingParams(max_tokens=40, ignore_eos=True)  # 8 + 40 tokens: 3 blocks each
    for index in range(2):
        scheduler.add(Sequence(f"r{index}", [1 + index] * 8, params, frozenset(), 4096))
    scheduler.schedule()
    assert len(scheduler.running) == 2 and manager.num_free_blocks == 6
    handed = Sequence("h", [9] * 8, params, frozenset(), 4096)
    assert scheduler.reserve_computed(handed, 8) is None  # 3 x 3 blocks > 8
    assert scheduler.num_held_back == 1 and manager.num_free_blocks == 6
    roomy = Sequence("small", [9] * 8, SamplingParams(max_tokens=8, ignore_eos=True),
                     frozenset(), 4096)
    assert scheduler.reserve_computed(roomy, 8) == 0  # 3 + 3 + 1 blocks fit
