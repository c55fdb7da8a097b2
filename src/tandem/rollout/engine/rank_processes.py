"""The processes of a tensor-parallel replica's worker ranks (rank_worker.py): started as fresh
interpreters that die with rank 0's process, their exit codes read when the replica fails, and
stopped."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from typing import Iterable

import torch

WORKER_MAIN = ("import json, sys; from tandem.rollout.engine.rank_worker import run_worker; "
               "run_worker(*json.loads(sys.argv[1]))")


def spawn_workers(ranks: range, size: int, store_host: str, port: int, model_path: str,
                  dtype: str, devices: list[torch.device], shared: bool, threads: int | None,
                  bind_host: str) -> list[subprocess.Popen]:
    """Start worker processes for `ranks` of a replica of `size` on this node, one per device
    of `devices` (`shared`: they share one GPU over gloo): they join the store at
    store_host:port, bind their collectives to bind_host, load their slices and die with this
    process."""
    # a fresh interpreter per rank (not multiprocessing's spawn, which re-imports the caller's
    # __main__: a script without a main guard would start engines recursively)
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    processes = []
    for rank, rank_device in zip(ranks, devices):
        arguments = [rank, size, store_host, port, str(model_path), dtype, str(rank_device),
                     shared, threads, os.getpid(), bind_host]
        processes.append(subprocess.Popen(
            [sys.executable, "-c", WORKER_MAIN, json.dumps(arguments)], env=environment))
    return processes


def exit_codes(processes: list[subprocess.Popen], grace_s: float) -> dict[int, int]:
    """Rank -> exit code of the workers that exited, waiting up to `grace_s` in all (a killed
    rank's sockets close a moment before the kernel reaps it)."""
    deadline = time.monotonic() + grace_s
    for process in processes:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    return {rank: process.returncode for rank, process in enumerate(processes, start=1)
            if process.returncode is not None}


def terminate(processes: Iterable[subprocess.Popen]) -> None:
    for process in processes:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)


def die_with(parent: int) -> None:
    """Have the kernel kill this worker when rank 0's process ends (Linux), even while it is
    still loading and not yet connected to rank 0's sockets."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        return
    if os.getppid() != parent:  # rank 0 ended before the request took effect
        os._exit(1)

