"""`delta` between real processes: exact results, ~1% of the bytes for 1% changed, full sync
for a stale receiver, and a checksum that catches a receiver whose weights drifted."""

from __future__ import annotations

import pytest
import torch

from tandem.weight_sync.delta import byte_sum, changed_indices
from weight_sync_procs import Worker, build_sender, random_state, run_receiver, run_sender, same_bits

ANSWER_S = 60


@pytest.fixture(scope="module")
def workers():
    pool = [Worker() for _ in range(3)]
    yield pool
    for worker in pool:
        worker.close()


def sync(workers, key, kwargs, state, version, receiver_versions, currents):
    """One sync from the kept sender engine `key` to receivers holding `currents` (version, dict)."""
    sender, *receivers = workers
    sender.submit(build_sender, key, "delta", kwargs, len(receivers), version, receiver_versions)
    plan = sender.result(ANSWER_S)
    sender.submit(run_sender, key, plan, state)
    for rank, (receiver, (current_version, current)) in enumerate(zip(receivers, currents), 1):
        receiver.submit(run_receiver, "delta", dict(kwargs, current_version=current_version),
                        plan, rank, current)
    return plan, sender.result(ANSWER_S), [receiver.result(ANSWER_S) for receiver in receivers]


def change(state, fraction, seed):
    """A copy of state with `fraction` of the big tensor's elements changed."""
    generator = torch.Generator().manual_seed(seed)
    new = {name: tensor.clone() for name, tensor in state.items()}
    big = new["layers.0.big"]
    where = torch.randperm(big.numel(), generator=generator)[:int(big.numel() * fraction)]
    big[where] += 1.0
    return new


def assert_exact(results, state, dtype=None):
    for result in results:
        assert not result["error"], result
        assert list(result["tensors"]) == list(state)
        for name, tensor in state.items():
            expected = tensor.to(dtype).contiguous() if dtype else tensor
            assert same_bits(result["tensors"][name], expected), name


@pytest.mark.parametrize("transport", ["shm", "gloo"])
def test_one_percent_changed_sends_about_one_percent(workers, transport):
    kwargs = {"bucket_megabytes": 1, "timeout_s": 20.0, "transport": transport}
    key = f"delta-{transport}"
    first = random_state(0)
    plan, sent, received = sync(workers, key, kwargs, first, 1, None, [(0, None), (0, None)])
    assert plan.details["base_version"] is None and not sent["error"]  # unknown versions: full
    assert_exact(received, first)
    full_bytes = sent["bytes_sent"]

    second = change(first, 0.01, seed=1)
    plan, sent, received = sync(workers, key, kwargs, second, 2, [1, 1], [(1, first), (1, first)])
    assert plan.details["base_version"] == 1 and not sent["error"], sent
    assert_exact(received, second)
    changed = int(0.01 * first["layers.0.big"].numel())
    # 4-byte index + 4-byte value per changed element, plus 64-byte-aligned small records
    assert 8 * changed <= sent["bytes_sent"] <= 8 * changed + 4 * 64 * len(first)
    assert sent["bytes_sent"] < 0.03 * full_bytes

    third = change(second, 0.01, seed=2)  # receiver 2 is stale: everyone gets a full sync
    plan, sent, received = sync(workers, key, kwargs, third, 3, [2, 1], [(2, second), (1, first)])
    assert plan.details["base_version"] is None and sent["bytes_sent"] == full_bytes
    assert_exact(received, third)


def test_checksum_catches_a_receiver_whose_weights_drifted(workers):
    kwargs = {"bucket_megabytes": 1, "timeout_s": 10.0, "transport": "shm"}
    first = random_state(0)
    sync(workers, "delta-drift", kwargs, first, 1, None, [(0, None), (0, None)])
    drifted = {name: tensor.clone() for name, tensor in first.items()}
    drifted["layers.0.big"][7] += 1.0  # claims version 1 but holds something else
    second = change(first, 0.01, seed=3)
    _, sent, (good, bad) = sync(workers, "delta-drift", kwargs, second, 2, [1, 1],
                                [(1, first), (1, drifted)])
    assert bad["error"] and bad["phase"] == "receive", bad
    assert "checksum mismatch for layers.0.big" in bad["message"]
    assert sent["error"] and sent["phase"] == "send" and sent["peer"] == "receiver 2", sent
    assert good["error"] and good["peer"] == "sender"  # no commit: the good one must not load
    # the failed sync made the sender forget its copy: the next one is full and exact
    plan, sent, received = sync(workers, "delta-drift", kwargs, second, 3, [1, 1],
                                [(1, first), (1, drifted)])
    assert plan.details["base_version"] is None and not sent["error"]
    assert_exact(received, second)


def test_bf16_rollout_compares_at_bf16(workers):
    kwargs = {"bucket_megabytes": 1, "timeout_s": 20.0, "transport": "shm", "dtype": "bfloat16"}
    first = {"w": torch.randn(200_000, generator=torch.Generator().manual_seed(0))}
    _, sent, received = sync(workers, "delta-bf16", kwargs, first, 1, None, [(0, None), (0, None)])
    assert_exact(received, first, torch.bfloat16)
    held = {"w": first["w"].to(torch.bfloat16)}
    second = {"w": first["w"] * (1 + 1e-4)}  # under bf16's 2**-8 relative step: mostly unchanged
    moved = changed_indices(second["w"].to(torch.bfloat16), held["w"]).numel()
    assert 0 < moved < 0.1 * second["w"].numel()
    _, sent, received = sync(workers, "delta-bf16", kwargs, second, 2, [1, 1], [(1, held), (1, held)])
    assert_exact(received, second, torch.bfloat16)
    assert 6 * moved <= sent["bytes_sent"] <= 6 * moved + 3 * 64  # int32 index + bf16 value


def test_byte_sum_and_changed_indices_are_bitwise():
    a = torch.tensor([0.0, float("nan"), 1.0])
    b = torch.tensor([-0.0, float("nan"), 1.0])
    assert changed_indices(a, b).tolist() == [0]  # -0.0 differs; equal NaN bits do not
    assert changed_indices(a, a.double()) is None
    assert int(byte_sum(a)) != int(byte_sum(b))
    odd = torch.arange(5, dtype=torch.uint8)  # 5 bytes: the tail path
    assert int(byte_sum(odd)) == int.from_bytes(bytes([0, 1, 2, 3, 4]), "little")
    assert int(byte_sum(torch.tensor(2.5))) == int(torch.tensor(2.5).view(torch.int32))
