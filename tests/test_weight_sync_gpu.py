"""The CUDA paths: NCCL broadcast and shm over CUDA IPC handles (run on a CUDA machine:
`pytest -m gpu tests/test_weight_sync_gpu.py`)."""

from __future__ import annotations

import pytest
import torch

from weight_sync_procs import Worker, build_sender, random_state, run_receiver, run_sender, same_bits

pytestmark = pytest.mark.gpu
ANSWER_S = 120


def _workers(n: int) -> list[Worker]:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return [Worker() for _ in range(n)]


def _sync(workers, engine, kwargs, devices, die_after=None):
    from weight_sync_procs import use_cuda

    sender, *receivers = workers
    for worker, device in zip(workers, devices):
        worker.submit(use_cuda, device)
        worker.result(ANSWER_S)
    sender.submit(build_sender, engine, engine, kwargs, len(receivers), 1, None)
    plan = sender.result(ANSWER_S)
    state = random_state(0, big_elements=2_000_000)
    sender.submit(run_sender, engine, plan, state, None, "cuda")
    for rank, receiver in enumerate(receivers, 1):
        receiver.submit(run_receiver, engine, kwargs, plan, rank, None,
                        die_after if rank == len(receivers) else None)
    answering = receivers if die_after is None else receivers[:-1]  # the last one dies
    return state, sender.result(ANSWER_S), [receiver.result(ANSWER_S) for receiver in answering]


def test_nccl_broadcast_is_exact():
    if torch.cuda.device_count() < 2:
        pytest.skip("NCCL needs one GPU per rank: 2 GPUs")
    workers = _workers(2)
    try:
        state, sent, (received,) = _sync(workers, "nccl", {"bucket_megabytes": 1, "timeout_s": 30.0},
                                         [0, 1])
        assert not sent["error"] and not received["error"], (sent, received)
        assert all(same_bits(received["tensors"][n], t) for n, t in state.items())
    finally:
        for worker in workers:
            worker.close()


def test_shm_over_cuda_ipc_is_exact_for_two_receivers_on_one_gpu():
    workers = _workers(3)
    try:
        kwargs = {"bucket_megabytes": 1, "timeout_s": 30.0, "device": "cuda"}
        state, sent, received = _sync(workers, "shm", kwargs, [0, 0, 0])
        assert not sent["error"], sent
        for result in received:
            assert not result["error"], result
            assert all(same_bits(result["tensors"][n], t) for n, t in state.items())
    finally:
        for worker in workers:
            worker.close()


def test_shm_over_cuda_ipc_receiver_killed_fails_the_sender():
    workers = _workers(3)
    try:
        kwargs = {"bucket_megabytes": 1, "timeout_s": 5.0, "device": "cuda"}
        _, sent, _ = _sync(workers, "shm", kwargs, [0, 0, 0], die_after=1)
        assert sent["error"] and sent["phase"] == "send" and sent["peer"] == "receiver 2", sent
    finally:
        for worker in workers:
            worker.close()
