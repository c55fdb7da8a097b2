"""`delta` between real processes: exact results, ~1% of the bytes for 1% changed, full sync
for a stale receiver, and a checksum that catches a receiver whose weights drifted; encoding
ahead of the sync (used only by the sync it was made for, pending until it succeeds) and
receivers that take patches to apply in place."""

from __future__ import annotations

import pytest
import torch

from tandem.config.schema import RolloutConfig
from tandem.rollout.native import NativeRollout
from tandem.types import WeightPatch
from tandem.weight_sync.base import SyncPlan, WeightSyncError
from tandem.weight_sync.delta import DeltaCheckpointEngine, byte_sum, changed_indices
from weight_sync_procs import (Worker, build_sender, encode_ahead, random_state, run_receiver,
                               run_sender, same_bits, sender_base_version)

ANSWER_S = 60


@pytest.fixture(scope="module")
def workers():
    pool = [Worker() for _ in range(3)]
    yield pool
    for worker in pool:
        worker.close()


def sync(workers, key, kwargs, state, version, receiver_versions, currents, ahead_as=None,
         in_place=False):
    """One sync from the kept sender engine `key` to receivers holding `currents` (version,
    dict); ahead_as: the sender first encodes `state` ahead as that version; in_place: the
    receivers take patches and apply them into their current weights after the commit."""
    sender, *receivers = workers
    if ahead_as is not None:
        sender.submit(encode_ahead, key, "delta", kwargs, state, ahead_as)
        sender.result(ANSWER_S)
    sender.submit(build_sender, key, "delta", kwargs, len(receivers), version, receiver_versions)
    plan = sender.result(ANSWER_S)
    sender.submit(run_sender, key, plan, state)
    for rank, (receiver, (current_version, current)) in enumerate(zip(receivers, currents), 1):
        receiver.submit(run_receiver, "delta", dict(kwargs, current_version=current_version),
                        plan, rank, current, None, in_place)
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


def full_sync(workers, state, version):
    """What a fresh sender's full sync delivers (to one receiver)."""
    kwargs = {"bucket_megabytes": 1, "timeout_s": 20.0, "transport": "shm"}
    _, sent, received = sync(workers[:2], f"fresh-{version}", kwargs, state, version, None,
                             [(0, None)])
    assert not sent["error"] and not received[0]["error"]
    return received[0]["tensors"]


@pytest.mark.parametrize("transport", ["shm", "gloo"])
def test_encoded_ahead_gives_the_bits_of_a_fresh_full_sync(workers, transport):
    kwargs = {"bucket_megabytes": 1, "timeout_s": 20.0, "transport": transport}
    key = f"ahead-{transport}"
    first = random_state(0)
    plan, sent, received = sync(workers, key, kwargs, first, 1, None, [(0, None), (0, None)],
                                ahead_as=1)
    assert plan.encoded_ahead and plan.details["base_version"] is None  # no copy yet: all dense
    assert_exact(received, first)
    full_bytes = sent["bytes_sent"]
    second = change(first, 0.01, seed=4)
    plan, sent, (patched, _) = sync(workers, key, kwargs, second, 2, [1, 1],
                                    [(1, first), (1, first)], ahead_as=2, in_place=True)
    assert plan.encoded_ahead and plan.details["base_version"] == 1 and not sent["error"], sent
    assert sent["bytes_sent"] < 0.03 * full_bytes
    fresh = full_sync(workers, second, 2)
    assert not patched["error"], patched
    for name in second:
        assert same_bits(patched["tensors"][name], fresh[name]), name
    workers[0].submit(sender_base_version, key)
    assert workers[0].result(ANSWER_S) == 2  # committed once the sync succeeded
    third = change(second, 0.01, seed=12)  # receivers that take patched copies instead
    plan, sent, (copied, _) = sync(workers, key, kwargs, third, 3, [2, 2],
                                   [(2, second), (2, second)], ahead_as=3)
    assert plan.encoded_ahead and plan.details["base_version"] == 2 and not sent["error"]
    fresh = full_sync(workers, third, 3)
    assert not copied["error"], copied
    for name in third:
        assert same_bits(copied["tensors"][name], fresh[name]), name


def test_a_receiver_on_another_version_drops_the_encoding_and_gets_a_full_sync(workers):
    kwargs = {"bucket_megabytes": 1, "timeout_s": 20.0, "transport": "shm"}
    first = random_state(0)
    _, sent, _ = sync(workers, "ahead-stale", kwargs, first, 1, None, [(0, None), (0, None)])
    full_bytes = sent["bytes_sent"]
    second = change(first, 0.01, seed=5)
    plan, sent, received = sync(workers, "ahead-stale", kwargs, second, 2, [1, 0],
                                [(1, first), (0, None)], ahead_as=2, in_place=True)
    assert not plan.encoded_ahead and plan.details["base_version"] is None
    assert not sent["error"] and sent["bytes_sent"] == full_bytes
    assert_exact(received, second)
    third = change(second, 0.01, seed=6)  # the full sync made version 2 the kept copy again
    plan, sent, received = sync(workers, "ahead-stale", kwargs, third, 3, [2, 2],
                                [(2, second), (2, second)], ahead_as=3, in_place=True)
    assert plan.encoded_ahead and plan.details["base_version"] == 2 and not sent["error"]
    assert sent["bytes_sent"] < 0.03 * full_bytes
    assert_exact(received, third)


def test_an_encoding_for_another_version_is_dropped_and_the_sync_is_full(workers):
    kwargs = {"bucket_megabytes": 1, "timeout_s": 20.0, "transport": "shm"}
    first = random_state(0)
    _, sent, _ = sync(workers, "ahead-version", kwargs, first, 1, None, [(0, None), (0, None)])
    full_bytes = sent["bytes_sent"]
    second = change(first, 0.01, seed=7)
    # encoded as version 2, but the sync is of version 3 (the weights may have moved since):
    # the kept copy is pending, so nothing is trusted and every tensor goes dense
    plan, sent, received = sync(workers, "ahead-version", kwargs, second, 3, [1, 1],
                                [(1, first), (1, first)], ahead_as=2)
    assert not plan.encoded_ahead and plan.details["base_version"] is None
    assert sent["bytes_sent"] == full_bytes
    assert_exact(received, second)


@pytest.mark.parametrize("in_place", [True, False])
def test_a_receiver_whose_base_differs_at_a_changed_position_is_caught(workers, in_place):
    kwargs = {"bucket_megabytes": 1, "timeout_s": 10.0, "transport": "shm"}
    key = f"ahead-drift-{in_place}"
    first = random_state(0)
    sync(workers, key, kwargs, first, 1, None, [(0, None), (0, None)])
    second = change(first, 0.01, seed=8)
    where = changed_indices(second["layers.0.big"], first["layers.0.big"])
    drifted = {name: tensor.clone() for name, tensor in first.items()}
    drifted["layers.0.big"][where[3]] += 0.5  # claims version 1, differs where a change lands
    _, sent, (good, bad) = sync(workers, key, kwargs, second, 2, [1, 1],
                                [(1, first), (1, drifted)], ahead_as=2, in_place=in_place)
    assert bad["error"] and bad["phase"] == "receive", bad
    assert "checksum mismatch for layers.0.big (the old values)" in bad["message"]
    assert sent["error"] and sent["peer"] == "receiver 2", sent
    assert good["error"] and good["peer"] == "sender"  # no commit: nobody loads


def test_a_drift_where_nothing_changed_is_not_seen_by_an_in_place_receiver(workers):
    """The sparse check's limit, as documented: positions the delta does not touch are not read."""
    kwargs = {"bucket_megabytes": 1, "timeout_s": 10.0, "transport": "shm"}
    first = random_state(0)
    sync(workers, "ahead-blind", kwargs, first, 1, None, [(0, None), (0, None)])
    second = change(first, 0.01, seed=9)
    unchanged = int(torch.nonzero(second["layers.0.big"] == first["layers.0.big"])[0])
    drifted = {name: tensor.clone() for name, tensor in first.items()}
    drifted["layers.0.big"][unchanged] = 123.0
    _, sent, (good, blind) = sync(workers, "ahead-blind", kwargs, second, 2, [1, 1],
                                  [(1, first), (1, drifted)], ahead_as=2, in_place=True)
    assert not sent["error"] and not good["error"] and not blind["error"]
    expected = second["layers.0.big"].clone()
    expected[unchanged] = 123.0  # the drift stays; every changed position is the sender's
    assert same_bits(blind["tensors"]["layers.0.big"], expected)


def test_a_failed_send_leaves_the_encoding_uncommitted_and_the_next_sync_full(workers):
    kwargs = {"bucket_megabytes": 1, "timeout_s": 10.0, "transport": "shm"}
    first = random_state(0)
    _, sent, _ = sync(workers, "ahead-fail", kwargs, first, 1, None, [(0, None), (0, None)])
    full_bytes = sent["bytes_sent"]
    second = change(first, 0.01, seed=10)
    drifted = {name: tensor.clone() for name, tensor in first.items()}
    drifted["layers.0.big"][changed_indices(second["layers.0.big"], first["layers.0.big"])[0]] += 1
    _, sent, _ = sync(workers, "ahead-fail", kwargs, second, 2, [1, 1],
                      [(1, first), (1, drifted)], ahead_as=2, in_place=True)
    assert sent["error"]
    sender = workers[0]
    sender.submit(sender_base_version, "ahead-fail")
    assert sender.result(ANSWER_S) is None  # pending, never committed: nothing is trusted
    third = change(second, 0.01, seed=11)
    plan, sent, received = sync(workers, "ahead-fail", kwargs, third, 3, [1, 1],
                                [(1, first), (1, first)], ahead_as=3, in_place=True)
    assert plan.encoded_ahead and plan.details["base_version"] is None
    assert not sent["error"] and sent["bytes_sent"] == full_bytes
    assert_exact(received, third)


def test_the_records_and_the_patch_hold_exactly_the_changes():
    """In one process, no transport: the sums the sender's records carry, and the patch a
    receiver that patches in place yields, checked against its values at the changed positions."""
    base = torch.arange(10, dtype=torch.float32)
    new = base.clone()
    new[[2, 7]] = torch.tensor([-1.0, -2.0])
    sender = DeltaCheckpointEngine(1, 5.0, transport="gloo")
    sender._base, sender._base_version = {"w": base.clone()}, 1
    sender.encode_ahead([("w", new)], 2)
    records = dict(sender._ahead.records)
    assert records["w\x00index"].tolist() == [2, 7]
    assert records["w\x00value"].tolist() == [-1.0, -2.0]
    sums = [int(byte_sum(base[[2, 7]])), int(byte_sum(new[[2, 7]])), int(byte_sum(new))]
    assert records["w\x00sum"].tolist() == sums
    assert torch.equal(sender._base["w"], new) and sender._base_version is None  # pending
    receiver = DeltaCheckpointEngine(1, 5.0, transport="gloo", current_version=1,
                                     current_weights={"w": base}.__getitem__,
                                     patches_in_place=lambda name: True)
    receiver.plan = SyncPlan("delta", 2, 1, 1 << 20, 5.0, {"base_version": 1})
    received = WeightPatch(records["w\x00index"].long(), records["w\x00value"])
    patch = receiver._checked("w", received, sums)
    assert patch is received
    target = base.clone()
    patch.apply_to(target)
    assert torch.equal(target, new)
    with pytest.raises(WeightSyncError, match=r"checksum mismatch for w \(the old values\)"):
        receiver._checked("w", received, [sums[0] + 1, *sums[1:]])
    with pytest.raises(WeightSyncError, match=r"checksum mismatch for w \(the new values\)"):
        receiver._checked("w", received, [sums[0], sums[1] + 1, sums[2]])


# ---- the native engine: patches staged, applied in place at commit, all or nothing ----------

DENSE, PACKED = "model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight"
ROLLOUT = RolloutConfig(kv_cache_memory_bytes=8 << 20, block_size=16)


@pytest.fixture(scope="module")
def tiny_model():
    from tandem.models import build_tiny_model

    return build_tiny_model()


def plus_one_at(rollout: NativeRollout, name: str, index: list[int]
                ) -> tuple[WeightPatch, torch.Tensor]:
    """A patch adding 1 at `index` of the served `name`, and the weight it makes."""
    where = torch.tensor(index)
    values = rollout.current_values(name, where) + 1.0
    expected = rollout.current_weight(name)
    expected.view(-1)[where] = values
    return WeightPatch(where, values), expected


async def test_the_native_engine_applies_a_patch_in_place_at_commit(tiny_model):
    rollout = NativeRollout.create(tiny_model, ROLLOUT)
    assert rollout.patches_in_place(DENSE) and rollout.patches_in_place(PACKED)
    assert not rollout.patches_in_place("model.layers.0.self_attn.q_proj.lora_A.weight")
    assert PACKED in rollout.runner.packed_linears  # CPU fp32: re-packed at staging
    dense_patch, dense_expected = plus_one_at(rollout, DENSE, [0, 5, 17])
    packed_patch, packed_expected = plus_one_at(rollout, PACKED, [3, 40])
    parameter = rollout.runner.named_parameters()[DENSE]
    address, original = parameter.data_ptr(), rollout.current_weight(DENSE)
    staged = rollout.stage_weights([(DENSE, dense_patch), (PACKED, packed_patch)])
    assert torch.equal(rollout.current_weight(DENSE), original)  # staging writes nothing
    await rollout.commit_weights(staged, 1, partial=True)
    assert rollout.weight_version == 1
    assert parameter.data_ptr() == address  # written in place, not swapped for a copy
    assert torch.equal(rollout.current_weight(DENSE), dense_expected)
    assert torch.equal(rollout.current_weight(PACKED), packed_expected)
    await rollout.shutdown()


async def test_a_failed_delta_stream_leaves_the_native_engine_untouched(tiny_model):
    rollout = NativeRollout.create(tiny_model, ROLLOUT)
    before = {name: rollout.current_weight(name) for name in (DENSE, PACKED)}
    good, _ = plus_one_at(rollout, DENSE, [1, 2])
    bad = WeightPatch(torch.tensor([4]), torch.tensor([float("nan")]))
    with pytest.raises(ValueError, match="NaN or inf"):
        await rollout.update_weights([(DENSE, good), (PACKED, bad)], 1, partial=True)
    assert rollout.weight_version == 0
    assert all(torch.equal(rollout.current_weight(name), before[name]) for name in before)
    staged = rollout.stage_weights([(DENSE, good)])
    full = [(DENSE, torch.zeros_like(before[DENSE]))]
    await rollout.update_weights(full, 1, partial=True)  # the weight moved after the check
    with pytest.raises(RuntimeError, match="changed after its delta patch was checked"):
        await rollout.commit_weights(staged, 2, partial=True)
    assert rollout.weight_version == 1
    assert torch.equal(rollout.current_weight(DENSE), torch.zeros_like(before[DENSE]))
    assert torch.equal(rollout.current_weight(PACKED), before[PACKED])
    await rollout.shutdown()
