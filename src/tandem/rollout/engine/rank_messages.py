"""The messages between rank 0 and the worker ranks of a tensor-parallel replica, over its gloo
control group (rank_worker.py): pickled commands broadcast by rank 0, and replies sent point to
point back to it."""

from __future__ import annotations

import pickle
from datetime import timedelta
from typing import Any

import torch

# An idle worker waits this long for its next command (rank 0 may have nothing to do for
# hours); rank 0's exit closes the sockets and ends the wait at once.
IDLE_WAIT = timedelta(days=365)
# Most commands (a decode step's plan) fit in one broadcast of this many bytes.
COMMAND_BYTES = 16 << 10


def broadcast_command(group: Any, command: tuple, timeout: timedelta | None = None) -> None:
    """Rank 0: one pickled command to every rank, in one broadcast when it fits COMMAND_BYTES
    (a send completes once every rank posted its receive: `timeout` bounds that wait)."""
    payload = pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL)
    first = torch.zeros(COMMAND_BYTES, dtype=torch.uint8)
    first[:8] = torch.tensor([len(payload)], dtype=torch.int64).view(torch.uint8)
    head = payload[:COMMAND_BYTES - 8]
    first[8:8 + len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
    group.broadcast(first, 0, timeout).wait()
    if len(payload) > len(head):
        rest = torch.frombuffer(bytearray(payload[len(head):]), dtype=torch.uint8)
        group.broadcast(rest, 0, timeout).wait()


def receive_command(group: Any) -> tuple:
    """Ranks >= 1: the next command of rank 0 (waits as long as rank 0 lives)."""
    first = torch.empty(COMMAND_BYTES, dtype=torch.uint8)
    group.broadcast(first, 0, IDLE_WAIT).wait()
    length = int(first[:8].view(torch.int64))
    payload = first[8:8 + min(length, COMMAND_BYTES - 8)].numpy().tobytes()
    if length > COMMAND_BYTES - 8:
        rest = torch.empty(length - (COMMAND_BYTES - 8), dtype=torch.uint8)
        group.broadcast(rest, 0).wait()
        payload += rest.numpy().tobytes()
    return pickle.loads(payload)


def send_reply(group: Any, reply: Any) -> None:
    payload = torch.frombuffer(bytearray(pickle.dumps(reply)), dtype=torch.uint8)
    group.send([torch.tensor([payload.numel()], dtype=torch.int64)], 0, 0).wait()
    group.send([payload], 0, 1).wait()


def receive_reply(group: Any, rank: int, timeout: timedelta | None = None) -> Any:
    """Rank 0: `rank`'s reply to the last command; each wait bounded by `timeout` if given."""
    length = torch.empty(1, dtype=torch.int64)
    wait_for(group.recv([length], rank, 0), timeout)
    payload = torch.empty(int(length), dtype=torch.uint8)
    wait_for(group.recv([payload], rank, 1), timeout)
    return pickle.loads(payload.numpy().tobytes())


def wait_for(work: Any, timeout: timedelta | None) -> None:
    """Wait for a collective's work, at most `timeout` when given."""
    if timeout is None:
        work.wait()
    else:
        work.wait(timeout)
