"""Cross-process transports (gloo, shm): exact bytes to every receiver, and bounded failures."""

from __future__ import annotations

import os

import pytest
import torch

from tandem.weight_sync.base import WeightSyncError
from tandem.weight_sync.bucketing import Unpacker, fill_bucket, tensor_buckets
from tandem.weight_sync.registry import get_checkpoint_engine_class
from weight_sync_procs import (Worker, build_sender, random_state, run_receiver, run_sender,
                               same_bits)

ANSWER_S = 60  # how long the test waits for a worker; far above any deadline below
KWARGS = {"bucket_megabytes": 1, "timeout_s": 20.0}
FAULT_TIMEOUT_S = 10.0  # short enough to wait out, long enough for a busy 2-core box
SLACK_S = 15.0  # scheduling slack on top of a deadline


@pytest.fixture(scope="module")
def workers():
    """A sender and two receivers, spawned once for the module."""
    pool = [Worker() for _ in range(3)]
    yield pool
    for worker in pool:
        worker.close()


def sync(workers, engine, state, kwargs=KWARGS, key=None, receiver_kwargs=None):
    sender, *receivers = workers
    sender.submit(build_sender, key or engine, engine, kwargs, len(receivers), 1, None)
    plan = sender.result(ANSWER_S)
    sender.submit(run_sender, key or engine, plan, state)
    for rank, receiver in enumerate(receivers, 1):
        receiver.submit(run_receiver, engine, receiver_kwargs or kwargs, plan, rank)
    return sender.result(ANSWER_S), [receiver.result(ANSWER_S) for receiver in receivers]


@pytest.mark.parametrize("engine", ["gloo", "shm"])
def test_every_receiver_gets_the_exact_state(workers, engine):
    state = random_state()
    sent, received = sync(workers, engine, state)
    assert not sent["error"], sent
    total = sum(t.numel() * t.element_size() for t in state.values())
    assert total <= sent["bytes_sent"] < total + 64 * len(state) + 64  # alignment padding only
    for result in received:
        assert not result["error"], result
        assert list(result["tensors"]) == list(state)
        for name, tensor in state.items():
            assert same_bits(result["tensors"][name], tensor), name


def test_a_second_sync_reuses_nothing_stale(workers):
    """Two syncs in a row through the same sender engine (a new store and buffers each time)."""
    for seed in (1, 2):
        state = random_state(seed, big_elements=1000)
        sent, received = sync(workers, "shm", state)
        assert not sent["error"] and not any(r["error"] for r in received), (sent, received)
        assert all(same_bits(r["tensors"]["embed.weight"], state["embed.weight"]) for r in received)


def test_bucketing_splits_and_rejoins_in_process():
    state = random_state(3)
    buffer = torch.empty(1 << 20, dtype=torch.uint8)
    unpacker, out = Unpacker(), {}
    big_pieces = 0
    for bucket in tensor_buckets(state.items(), 1 << 20):
        chunks = fill_bucket(buffer, bucket)
        big_pieces += sum(chunk.name == "layers.0.big" for chunk in chunks)
        out.update((n, t.clone()) for n, t in unpacker.unpack(buffer, chunks))
    assert big_pieces == 2 and not unpacker.check_complete()  # 1.6 MB spans two 1 MiB buckets
    assert all(same_bits(out[name], tensor) for name, tensor in state.items())


def test_only_tensors_larger_than_a_bucket_split_and_rejoin_in_a_reused_scratch():
    """A tensor that fits a bucket starts the next one rather than splitting (a re-join costs a
    copy); split ones re-join in a scratch buffer that the next sync's unpacker reuses, while
    an unpacker running at the same time gets its own."""
    state = {"a": torch.randn(150_000), "b": torch.randn(150_000), "big": torch.randn(400_000)}
    buckets = [[(chunk.name, chunk.length) for chunk, _ in bucket]
               for bucket in tensor_buckets(state.items(), 1 << 20)]
    # a (600 kB) fits the first bucket; b does not fit beside it: it starts the second bucket
    # instead of splitting; big (1.6 MB) is larger than a bucket and splits: the rest of the
    # second bucket, a whole third one, and the remainder in a fourth
    assert buckets[0] == [("a", 600_000)] and buckets[1][0] == ("b", 600_000)
    assert [sum(name == "big" for name, _ in bucket) for bucket in buckets] == [0, 1, 1, 1]

    def sync() -> tuple[dict, int]:
        unpacker, out, pointer = Unpacker(), {}, None
        buffer = torch.empty(1 << 20, dtype=torch.uint8)
        for bucket in tensor_buckets(state.items(), 1 << 20):
            for name, tensor in unpacker.unpack(buffer, fill_bucket(buffer, bucket)):
                out[name] = tensor.clone()
                pointer = tensor.data_ptr() if name == "big" else pointer
        unpacker.close()
        return out, pointer

    first, first_pointer = sync()
    second, second_pointer = sync()
    assert all(same_bits(first[n], t) and same_bits(second[n], t) for n, t in state.items())
    assert first_pointer == second_pointer  # the scratch came back from the pool
    holder = Unpacker()
    held = holder._borrow(1_600_000, torch.device("cpu"))
    _, third_pointer = sync()
    assert third_pointer != held.data_ptr()  # never two unpackers on one scratch
    holder.close()


def _fresh(workers, index):
    workers[index].close()
    workers[index] = Worker()


@pytest.mark.parametrize("engine", ["gloo", "shm"])
def test_receiver_killed_mid_transfer_fails_the_sender_in_phase_send(workers, engine):
    kwargs = dict(KWARGS, timeout_s=FAULT_TIMEOUT_S)
    sender, first, second = workers
    sender.submit(build_sender, f"{engine}-kill", engine, kwargs, 2, 1, None)
    plan = sender.result(ANSWER_S)
    state = random_state(4, big_elements=2_000_000)  # 8 MB: several buckets
    sender.submit(run_sender, f"{engine}-kill", plan, state)
    first.submit(run_receiver, engine, kwargs, plan, 1)
    second.submit(run_receiver, engine, kwargs, plan, 2, None, 1)  # dies after one tensor
    sent = sender.result(ANSWER_S)
    assert sent["error"] and sent["phase"] == "send", sent
    assert sent["elapsed_s"] < FAULT_TIMEOUT_S + SLACK_S
    if engine == "shm":
        assert sent["peer"] == "receiver 2", sent  # shm knows exactly who stopped answering
    other = first.result(ANSWER_S)
    assert other["error"] and other["phase"] == "receive" and other["peer"] == "sender"
    _fresh(workers, 2)


@pytest.mark.parametrize("engine", ["gloo", "shm"])
def test_sender_killed_mid_transfer_fails_every_receiver(workers, engine):
    kwargs = dict(KWARGS, timeout_s=FAULT_TIMEOUT_S)
    sender, *receivers = workers
    sender.submit(build_sender, f"{engine}-die", engine, kwargs, 2, 1, None)
    plan = sender.result(ANSWER_S)
    sender.submit(run_sender, f"{engine}-die", plan, random_state(5, big_elements=2_000_000), 2)
    for rank, receiver in enumerate(receivers, 1):
        receiver.submit(run_receiver, engine, kwargs, plan, rank)
    for receiver in receivers:
        result = receiver.result(ANSWER_S)
        assert result["error"] and result["phase"] == "receive", result
        assert result["peer"] == "sender" and result["elapsed_s"] < FAULT_TIMEOUT_S + SLACK_S
    _fresh(workers, 0)
    if engine == "shm":  # a killed sender cannot unlink its buffers; the next sender does
        from tandem.weight_sync.shm import ShmCheckpointEngine

        left = plan.details["paths"]
        assert all(map(os.path.exists, left))
        successor = ShmCheckpointEngine(1, 5.0)
        successor.build_topology(1, 1)
        successor.finalize()
        successor.close()
        assert not any(map(os.path.exists, left))


def test_a_receiver_that_never_joins_names_itself_within_the_deadline(workers):
    sender, first, _ = workers
    kwargs = dict(KWARGS, timeout_s=FAULT_TIMEOUT_S)
    sender.submit(build_sender, "gloo-absent", "gloo", kwargs, 2, 1, None)
    plan = sender.result(ANSWER_S)
    sender.submit(run_sender, "gloo-absent", plan, random_state(6))
    first.submit(run_receiver, "gloo", kwargs, plan, 1)
    sent = sender.result(ANSWER_S)
    assert sent["error"] and sent["phase"] == "init_process_group" and sent["peer"] == "receiver 2"
    joined = first.result(ANSWER_S)
    assert joined["error"] and joined["phase"] in ("init_process_group", "receive")


def test_error_and_registry_messages():
    error = WeightSyncError("send", "receiver 2", "boom")
    assert "phase send" in str(error) and "receiver 2" in str(error)
    with pytest.raises(ValueError, match="unknown weight-sync phase"):
        WeightSyncError("load_weights", None, "x")
    with pytest.raises(ValueError, match="registered: naive, gloo, nccl, shm, delta"):
        get_checkpoint_engine_class("ipc")
    if not torch.distributed.is_nccl_available():
        with pytest.raises(ValueError, match="'nccl' is unavailable here: this torch build has no NCCL"):
            get_checkpoint_engine_class("nccl")
    with pytest.raises(ValueError, match="engine_kwargs"):
        get_checkpoint_engine_class("gloo")(transport="shm")


def test_shm_buffers_outlive_a_sync_until_close_and_orphans_are_removed(tmp_path):
    from tandem.weight_sync.shm import ShmCheckpointEngine

    orphan = tmp_path / "tandem-sync-999999999-abc"  # a sender pid that cannot exist
    orphan.write_bytes(b"x")
    engine = ShmCheckpointEngine(1, 5.0, shm_dir=str(tmp_path))
    paths = engine.build_topology(1, 1).details["paths"]
    engine.finalize()
    assert not orphan.exists() and len(paths) == 2 and all(map(os.path.exists, paths))
    assert engine.build_topology(1, 2).details["paths"] == paths  # reused, not re-created
    engine.finalize()
    engine.close()
    assert not any(map(os.path.exists, paths))


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 2 MiB tmpfs, as Docker's small /dev/shm is (mounting needs root)."""
    import subprocess

    mount = tmp_path / "shm"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)],
                      capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


def test_a_shm_dir_too_small_for_the_ring_is_refused_naming_the_size_and_the_fix(workers,
                                                                                small_tmpfs):
    """Issue 42: writing the ring's sparse files past a full tmpfs was a SIGBUS that killed the
    sender. Now the first bucket is refused before a byte is written, the receivers hear of it
    at once (the sender's store goes), and a sync that fits still works after it."""
    kwargs = dict(KWARGS, bucket_megabytes=4, timeout_s=FAULT_TIMEOUT_S, shm_dir=str(small_tmpfs))
    sender, *receivers = workers
    sender.submit(build_sender, "shm-small", "shm", kwargs, 2, 1, None)
    plan = sender.result(ANSWER_S)
    sender.submit(run_sender, "shm-small", plan, random_state(7, big_elements=2_000_000))
    for rank, receiver in enumerate(receivers, 1):
        receiver.submit(run_receiver, "shm", kwargs, plan, rank)
    sent = sender.result(ANSWER_S)
    assert sent["error"] and sent["phase"] == "send", sent
    message = sent["message"]
    assert f"{small_tmpfs} has 2 MiB free, the shm transport's buffer 0 need 4 MiB" in message
    assert "--shm-size" in message and "engine_kwargs.shm_dir" in message, message
    for receiver in receivers:
        result = receiver.result(ANSWER_S)
        assert result["error"] and result["elapsed_s"] < FAULT_TIMEOUT_S, result
    small = {"w": torch.arange(1000, dtype=torch.float32)}  # 4 kB: fits
    sent, received = sync(workers, "shm", small, dict(kwargs), key="shm-small")
    assert not sent["error"] and all(not r["error"] for r in received), (sent, received)
