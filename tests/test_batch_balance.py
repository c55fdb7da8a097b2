"""Sample padding to lcm(dp, mini-batch) and sequence balancing across data-parallel ranks."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.batch.balance import balance_batch, balance_order, balanced_partition, token_imbalance
from tandem.batch.jagged import field_lengths, non_tensor_list, trajectories_to_batch
from tandem.batch.padding import pad_for_data_parallel
from tandem.batch.trajectory import Trajectory
from tandem.config.schema import TandemConfig
from tandem.trainer.rl_trainer import RLTrainer
from tandem.training.fsdp import shard_batch

EOS = 2


def trajectories(response_lengths, prompts: int = 1) -> list[Trajectory]:
    """One trajectory per length; consecutive ones share a prompt uid, `prompts` groups."""
    group = -(-len(response_lengths) // prompts)
    return [Trajectory(prompts=torch.arange(3, 7), responses=torch.arange(10, 10 + r),
                       response_mask=torch.ones(r, dtype=torch.long),
                       rollout_log_probs=torch.full((r,), -0.5), min_global_steps=0,
                       max_global_steps=0, uid=f"p{i // group}", reward=1.0)
            for i, r in enumerate(response_lengths)]


def trainer_with(n_devices: int, mini_batch_prompts: int, n: int) -> RLTrainer:
    """An RLTrainer with only what make_batch reads (its config and tokenizer)."""
    trainer = RLTrainer.__new__(RLTrainer)
    trainer.config = TandemConfig()
    trainer.config.trainer.n_devices = n_devices
    trainer.config.actor.ppo_mini_batch_size = mini_batch_prompts
    trainer.config.rollout.n = n
    trainer.tokenizer = SimpleNamespace(eos_token_id=EOS)
    return trainer


def real_per_rank(batch, world_size: int) -> list[int]:
    return [int((~shard_batch(batch, rank, world_size)["is_padding"]).sum())
            for rank in range(world_size)]


def test_two_devices_four_prompts_n4_mini_batch_4_stay_16_and_split_8_8():
    trainer = trainer_with(n_devices=2, mini_batch_prompts=4, n=4)
    batch = trainer.make_batch(trajectories([5 + 3 * i for i in range(16)], prompts=4))
    assert batch.batch_size[0] == 16  # lcm(2, 16), not 2 x 16 = 32
    assert not bool(batch["is_padding"].any())
    assert real_per_rank(batch, 2) == [8, 8]


def test_no_rank_trains_on_padding_only():
    # 6 real, mini-batch 16 over 2 ranks: padded to 16 (the product gave 32, and contiguous
    # shards gave rank 1 sixteen padding samples)
    trainer = trainer_with(n_devices=2, mini_batch_prompts=4, n=4)
    batch = trainer.make_batch(trajectories([4, 9, 2, 30, 7, 7], prompts=2))
    assert batch.batch_size[0] == 16
    assert real_per_rank(batch, 2) == [3, 3]
    # 4 ranks, 2 mini-batches of 8, 5 real: each rank has real samples
    trainer = trainer_with(n_devices=4, mini_batch_prompts=2, n=4)
    batch = trainer.make_batch(trajectories([4, 9, 2, 30, 7, 7, 1, 1, 5], prompts=3)[:5] +
                               trajectories([6] * 4, prompts=1)[:4] + trajectories([3] * 3)[:3])
    assert batch.batch_size[0] == 16
    assert sorted(real_per_rank(batch, 4)) == [3, 3, 3, 3]


def test_pad_for_data_parallel_uses_the_lcm():
    batch = trajectories_to_batch(trajectories([3] * 10))
    assert pad_for_data_parallel(batch, 4, 6, EOS).batch_size[0] == 12  # lcm 12, not 24
    assert pad_for_data_parallel(batch, 2, 5, EOS).batch_size[0] == 10
    with pytest.raises(ValueError, match="dp_size=0"):
        pad_for_data_parallel(batch, 0, 4, EOS)


def test_balanced_partition_on_skewed_lengths():
    rng = random.Random(0)
    # heavy tail: a few very long sequences among many short ones, sorted (the worst case for
    # a contiguous split)
    lengths = sorted([rng.randint(10, 40) for _ in range(56)] + [2000, 1500, 1200, 900, 700,
                                                                  600, 500, 400])
    parts = balanced_partition(lengths, [16, 16, 16, 16])
    assert sorted(i for part in parts for i in part) == list(range(64))  # each exactly once
    assert [len(part) for part in parts] == [16, 16, 16, 16]
    sums = [sum(lengths[i] for i in part) for part in parts]
    mean = sum(lengths) / 4
    contiguous = [sum(lengths[16 * r:16 * (r + 1)]) for r in range(4)]
    assert max(contiguous) / mean > 2.5  # what a contiguous split would do
    assert max(sums) / mean < 1.05
    assert max(sums) - min(sums) <= max(lengths)
    with pytest.raises(ValueError, match="do not add up"):
        balanced_partition([1, 2, 3], [1, 1])


@settings(max_examples=60, deadline=None)
@given(world_size=st.sampled_from([1, 2, 3, 4]), per_rank=st.integers(1, 4),
       mini_batches=st.integers(1, 4), data=st.data())
def test_balance_order_properties(world_size, per_rank, mini_batches, data):
    mini_batch = world_size * per_rank
    size = mini_batch * mini_batches
    real_count = data.draw(st.integers(1, size))
    lengths = data.draw(st.lists(st.integers(3, 500), min_size=real_count, max_size=real_count))
    lengths += [2] * (size - real_count)  # padding samples: [eos, eos]
    is_padding = [False] * real_count + [True] * (size - real_count)
    order = balance_order(lengths, is_padding, world_size, mini_batch)
    assert sorted(order) == list(range(size))
    # [rank][mini-batch] -> the indices there
    cells = [[order[rank * per_rank * mini_batches + k * per_rank:][:per_rank]
              for k in range(mini_batches)] for rank in range(world_size)]
    real_in = [[[i for i in cells[r][k] if not is_padding[i]] for k in range(mini_batches)]
               for r in range(world_size)]
    runs = []
    for k in range(mini_batches):
        counts = [len(real_in[r][k]) for r in range(world_size)]
        assert max(counts) - min(counts) <= 1
        runs.append(sorted(i for r in range(world_size) for i in real_in[r][k]))
    # mini-batch k holds the k-th contiguous run of real samples; runs differ by at most one
    assert [i for run in runs for i in run] == list(range(real_count))
    assert max(map(len, runs)) - min(map(len, runs)) <= 1
    if real_count >= world_size:
        assert all(any(real_in[r][k] for k in range(mini_batches)) for r in range(world_size))


def test_balance_batch_reorders_whole_samples_and_reports_the_imbalance():
    lengths = [400, 300, 5, 5, 5, 5, 5, 5]  # two long ones first (prompts are 4 tokens)
    batch = trajectories_to_batch(trajectories(lengths, prompts=2))
    before = token_imbalance(batch, 2, 8)
    assert before["balance/token_imbalance"] == pytest.approx(726 / 381)  # halves: 404 + 304 + 9 + 9, 4 x 9
    balanced = balance_batch(batch, 2, 8)
    after = token_imbalance(balanced, 2, 8)
    # 404 + 3 x 9 vs 304 + 3 x 9 tokens
    assert after["balance/token_imbalance"] == pytest.approx(431 / 381)
    assert after["balance/token_imbalance_worst_mini_batch"] == after["balance/token_imbalance"]
    uids = non_tensor_list(balanced, "uid")
    responses = [len(r) for r in balanced["responses"].unbind()]
    assert sorted(zip(responses, uids)) == sorted(zip(lengths, non_tensor_list(batch, "uid")))
    assert field_lengths(balanced["input_ids"]).tolist() == [r + 4 for r in responses]


def grouped_trajectories(response_lengths, n: int) -> list[Trajectory]:
    """Consecutive runs of n trajectories share a prompt (distinct prompt tokens per run)."""
    return [Trajectory(prompts=torch.tensor([3, 4, 5 + i // n]), responses=torch.arange(10, 10 + r),
                       response_mask=torch.ones(r, dtype=torch.long),
                       rollout_log_probs=torch.full((r,), -0.5), min_global_steps=0,
                       max_global_steps=0, uid=f"p{i // n}", reward=1.0)
            for i, r in enumerate(response_lengths)]


def test_keep_prompt_groups_puts_whole_groups_on_each_rank():
    lengths = [30, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]  # one long sample
    batch = pad_for_data_parallel(trajectories_to_batch(grouped_trajectories(lengths, 4)), 2, 16, EOS)
    grouped = balance_batch(batch, 2, 16, keep_prompt_groups=True)
    for rank in range(2):
        shard = shard_batch(grouped, rank, 2)
        uids = non_tensor_list(shard, "uid")
        assert len(uids) == 8 and all(uids.count(uid) == 4 for uid in set(uids)), uids
    # four groups, two per rank, still balanced on tokens
    assert token_imbalance(grouped, 2, 16)["balance/token_imbalance"] < 1.15
    # per sample (the default), the same batch has groups cut across the ranks
    plain = balance_batch(batch, 2, 16)
    cut = [non_tensor_list(shard_batch(plain, rank, 2), "uid") for rank in range(2)]
    assert any(uids.count(uid) != 4 for uids in cut for uid in set(uids))


def test_keep_prompt_groups_falls_back_to_samples_when_counts_do_not_divide():
    # groups of 3 cannot fill ranks of 4 real samples each: per-sample balancing, as without groups
    batch = pad_for_data_parallel(trajectories_to_batch(grouped_trajectories(list(range(2, 10)), 3)), 2, 8, EOS)
    lengths, padding = field_lengths(batch["input_ids"]).tolist(), batch["is_padding"].tolist()
    assert balance_order(lengths, padding, 2, 8, [i // 3 for i in range(8)]) == \
        balance_order(lengths, padding, 2, 8)
