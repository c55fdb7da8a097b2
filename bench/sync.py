"""Weight-sync transports vs a plain memcpy of the same bytes, in one run.

For each total size, fp32 tensors of `--tensor-megabytes` each go from this process to one
receiver: `naive` in-process (the rollout copies each tensor into its parameters), `shm` and
`gloo` to a receiver in another process (which copies into its own parameters), and `delta`
(over shm; `delta-gloo` over gloo) with 1% and 10% of the elements changed since the receiver's
version, each next to the full sync of its transport. Each is timed
from send start to the sender's commit (every byte in the receiver's parameters), best of
`--repeats`; setup (build_topology + init_process_group) is reported apart. Delta finds the
changes ahead (`encode_ahead`, before a trainer would pause generation), timed apart; its time
runs from send start until the receiver has applied its patches in place (after the commit).
The two sides of a cross-process sync run `--peer-threads` torch threads each (default 1: each
is one process on its own core, as the trainer places a training worker and a rollout server
on this 2-core box; 2 + 2 threads on 2 cores oversubscribe them); memcpy and naive run at the
process's default. Each shm row also times a memcpy on the sender's threads right before each
of its syncs (so both see the same load on a shared machine) and compares with the best of
those: that is RATIO.

    .venv/bin/python bench/sync.py                       # 100 MB, 500 MB, 2 GB
    .venv/bin/python bench/sync.py --sizes 100 --repeats 2
    python3 bench/sync.py --device cuda --sizes 1000 --engines naive,shm   # one GPU (docs/gpu.md)

`--device cuda`: every tensor, the receiver's parameters and the shm buffers (CUDA IPC handles
instead of /dev/shm files) live on the one GPU, and memcpy is a device-to-device copy; gloo and
delta stay CPU transports here and are refused.
`shm-db-native` (bench/sync_native.py): the double-buffered handoff into a generating native
engine serving a ~500 MB model (`--tiny`: the tiny model), once with rollout.in_flight_kv=recompute
and once with keep; PAUSE_RATIO is then that engine's pause (keep), else the bench receiver's flip.
`delta-link` (bench/sync_link.py, root only): gloo full vs delta over gloo, 1% changed, between
two network namespaces joined by a veth pair shaped to `--link-rate` (two simulated hosts).
Last lines: PAUSE_RATIO <flip / one memcpy>, DELTA_RATIO <delta / full gloo across the shaped
link>, RATIO <shm GiB/s / GiB/s of a memcpy on the sender's threads> shm cross-process, each at
the size closest to 500 MB
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import threading
import time
from typing import Callable

import torch

import sync_link
import sync_native
from tandem import cpu_kernels
from tandem.models.tiny import TinyModelSpec
from tandem.types import WeightPatch
from tandem.weight_sync.registry import get_checkpoint_engine_class
from tandem.weight_sync.slots import WeightSlots, make_layout

GIB = 1 << 30


def make_state(total_megabytes: int, tensor_megabytes: int,
               device: str = "cpu") -> dict[str, torch.Tensor]:
    """fp32 tensors adding up to total_megabytes (10**6 bytes), each at most tensor_megabytes."""
    remaining, state, index = total_megabytes * 10**6 // 4, {}, 0
    per_tensor = tensor_megabytes * 10**6 // 4
    while remaining:
        count = min(per_tensor, remaining)
        state[f"layers.{index}.weight"] = torch.randn(count, device=device)
        remaining -= count
        index += 1
    return state


def receiver_main(conn, threads: int, device: str) -> None:
    """The rollout side: holds parameters, joins each sync it is sent, copies what arrives
    (double-buffered: its parameters are views of one of two weight slots; it checks the slot
    the sender wrote and flips to it, under a lock as an engine flips between two steps)."""
    torch.set_num_threads(threads)
    params: dict[str, torch.Tensor] = {}
    slots, active, step_lock = None, 0, threading.Lock()
    while (message := conn.recv()) is not None:
        kind, payload = message
        if kind == "allocate":
            params = {name: torch.zeros(numel, device=device) for name, numel in payload.items()}
            if slots is not None:
                slots.close()
                slots = None
            conn.send("ok")
            continue
        if kind == "slots":  # serve from slot `active` from now on (the engine's first sync)
            if slots is None:
                slots, active = WeightSlots(make_layout((name, tuple(t.shape), t.dtype)
                                                        for name, t in params.items())), 0
            for name, view in slots.views(active).items():
                view.copy_(params[name])
                params[name] = view
            conn.send(slots.descriptor(active))
            continue
        if kind == "checksum":  # the bits that arrived, to compare with the sender's
            conn.send(_checksum(params))
            continue
        engine_name, kwargs, plan, version = payload
        if engine_name == "delta":  # checks and yields patches, applied once all arrived
            kwargs = dict(kwargs, current_weights=params.__getitem__, current_version=version,
                          patches_in_place=lambda name: True)
        engine = get_checkpoint_engine_class(engine_name)(**kwargs)
        flip_s = load_s = None
        try:
            engine.init_process_group(plan, 1)
            if "slots" in plan.details:
                for _ in engine.receive_weights():  # each tensor's checksum checked in the slot
                    pass
                started = time.perf_counter()
                with step_lock:  # generation stands still only here
                    active = plan.details["slots"][0].inactive
                    params = slots.views(active)
                flip_s = time.perf_counter() - started
            else:
                load_s = _receive_into(params, engine.receive_weights(), step_lock)
            if device == "cuda":
                torch.cuda.synchronize()
        finally:
            engine.finalize()
        conn.send(("ok", flip_s, slots.descriptor(active) if flip_s is not None else None, load_s))


def _receive_into(params: dict[str, torch.Tensor], stream, step_lock: threading.Lock) -> float:
    """Copy full tensors into params as they arrive; keep patches until the stream ended (the
    sender committed), then apply them in place under the step lock. Returns that apply's
    seconds (after the sender's commit: part of the sync's time, not of the sender's)."""
    patches = []
    for name, item in stream:
        if isinstance(item, WeightPatch):
            patches.append((name, item))
        else:
            params[name].copy_(item)
    started = time.perf_counter()
    with step_lock:
        for name, patch in patches:
            patch.apply_to(params[name])
    return time.perf_counter() - started


def _checksum(state: dict[str, torch.Tensor]) -> list[int]:
    """Per tensor, the sum of its bits as int32 words: equal bits give equal sums."""
    return [int(state[name].view(torch.int32).sum(dtype=torch.int64)) for name in sorted(state)]


class Receiver:
    """A spawned receiver process driven over a pipe, or (conn given) one already running at
    the other end of that connection (bench/sync_link.py)."""

    def __init__(self, threads: int, device: str = "cpu", conn=None) -> None:
        self.conn, self.process = conn, None
        if conn is None:
            context = mp.get_context("spawn")
            self.conn, child = context.Pipe()
            self.process = context.Process(target=receiver_main, args=(child, threads, device),
                                           daemon=True)
            self.process.start()

    def call(self, kind: str, payload) -> None:
        self.conn.send((kind, payload))

    def wait(self):
        """The receiver's answer: "ok" (allocate, slots), or after a sync ("ok", flip seconds
        and its slots after a double-buffered one else None, None, seconds it applied patches
        after the commit or None)."""
        answer = self.conn.recv()
        if answer != "ok" and not (isinstance(answer, tuple) and answer[0] == "ok"):
            raise RuntimeError("receiver failed")
        return answer

    def checksum(self) -> list[int]:
        self.call("checksum", None)
        return self.conn.recv()

    def close(self) -> None:
        self.conn.send(None)
        if self.process is not None:
            self.process.join(30)


def time_memcpy(state: dict[str, torch.Tensor], destination: dict[str, torch.Tensor],
                repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for name, tensor in state.items():
            destination[name].copy_(tensor)
        _synchronize(tensor)
        best = min(best, time.perf_counter() - started)
    return best


def _synchronize(tensor: torch.Tensor) -> None:
    if tensor.is_cuda:  # CUDA copies are asynchronous: time them to completion
        torch.cuda.synchronize()


class CopyingRollout:
    """What `naive` hands the stream to: copies each tensor into its parameters."""

    def __init__(self, destination: dict[str, torch.Tensor]) -> None:
        self.destination = destination

    async def update_weights(self, named_tensors, version: int) -> None:
        for name, tensor in named_tensors:
            self.destination[name].copy_(tensor)
        _synchronize(tensor)


def time_naive(state, destination, repeats: int, bucket_megabytes: int) -> float:
    engine = get_checkpoint_engine_class("naive")(bucket_megabytes)
    rollout, best = CopyingRollout(destination), float("inf")
    for version in range(repeats):
        started = time.perf_counter()
        asyncio.run(engine.sync(state.items(), rollout, version))
        best = min(best, time.perf_counter() - started)
    return best


def time_remote(engine_name: str, kwargs: dict, state, receiver: Receiver, repeats: int,
                change_fraction: float | None = None, threads: int = 1,
                memcpy: Callable[[], float] | None = None) -> dict:
    """Best send time to the receiver process (plus setup and bytes of that sync), the sender on
    `threads` torch threads. For delta, a full sync comes first, then each timed one changes
    `change_fraction` of the elements. `memcpy` (timed on the same threads right before each
    sync, so both see the same load) gives `memcpy_s`, the best of those."""
    default_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _time_remote(engine_name, kwargs, state, receiver, repeats, change_fraction, memcpy)
    finally:
        torch.set_num_threads(default_threads)


def _time_remote(engine_name: str, kwargs: dict, state, receiver: Receiver, repeats: int,
                 change_fraction: float | None, memcpy: Callable[[], float] | None) -> dict:
    engine = get_checkpoint_engine_class(engine_name)(**kwargs)
    generator = torch.Generator().manual_seed(0)
    best = {"send_s": float("inf")}
    best_memcpy = float("inf")
    version = 0
    slots = None
    if kwargs.get("double_buffer"):
        receiver.call("slots", None)
        slots = receiver.conn.recv()
    for attempt in range(repeats + (1 if change_fraction else 0)):
        if change_fraction and attempt:
            for tensor in state.values():
                where = torch.randint(tensor.numel(), (int(tensor.numel() * change_fraction),),
                                      generator=generator)
                tensor[where] += 1.0
        if memcpy is not None:
            best_memcpy = min(best_memcpy, memcpy())
        started = time.perf_counter()
        engine.encode_ahead(state.items(), version + 1)  # delta: before generation would pause
        encode = time.perf_counter() - started
        started = time.perf_counter()
        plan = engine.build_topology(1, version + 1, [version], [slots] if slots else None)
        receiver.call("sync", (engine_name, kwargs, plan, version))
        engine.init_process_group(plan, 0)
        setup = time.perf_counter() - started
        started = time.perf_counter()
        asyncio.run(engine.send_weights(iter(()) if plan.encoded_ahead else state.items()))
        elapsed = time.perf_counter() - started
        sent = engine.bytes_sent
        engine.finalize()
        _, flip_s, descriptor, load_s = receiver.wait()
        elapsed += load_s or 0.0  # patches applied after the commit
        slots = descriptor if slots is not None else None
        version += 1
        if change_fraction and attempt == 0:
            continue  # the full sync that gives the receiver the base version
        if elapsed < best["send_s"]:
            best = {"send_s": elapsed, "setup_s": setup, "bytes_sent": sent, "flip_s": flip_s,
                    "encode_s": encode, "load_s": load_s or 0.0}
    return dict(best, memcpy_s=best_memcpy)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100,500,2000", help="total MB per run, comma-separated")
    parser.add_argument("--tensor-megabytes", type=int, default=25)
    parser.add_argument("--bucket-megabytes", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--engines", default="naive,shm,shm-db,gloo,delta,delta-gloo,delta-link,"
                        "shm-db-native", help="shm: the bucket ring; shm-db: double-buffered (the "
                        "receiver serves from two weight slots); delta runs over shm, delta-gloo "
                        "over gloo; delta-link: gloo full vs delta between two shaped network "
                        "namespaces; shm-db-native: double-buffered into a generating native "
                        "engine (~500 MB model, once, whatever --sizes)")
    parser.add_argument("--link-rate", default="1gbit", help="tc rate of the delta-link veth pair")
    parser.add_argument("--peer-threads", type=int, default=1,
                        help="torch threads of each side of a cross-process sync")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (one GPU, CUDA IPC)")
    parser.add_argument("--tiny", action="store_true",
                        help="--sizes 4 --tensor-megabytes 1 --bucket-megabytes 1 --repeats 1, the "
                        "tiny model for shm-db-native")
    args = parser.parse_args()
    if args.tiny:
        args.sizes, args.tensor_megabytes, args.bucket_megabytes, args.repeats = "4", 1, 1, 1
    engines = args.engines.split(",")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("sync.py: --device cuda but torch sees no CUDA device")
        engines = [e for e in engines if e != "delta-link"]  # a CPU bench between namespaces
        if set(engines) - {"naive", "shm"}:
            raise SystemExit(f"sync.py: --device cuda takes --engines naive,shm, not "
                             f"{','.join(sorted(set(engines) - {'naive', 'shm'}))}")
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}, bucket {args.bucket_megabytes} MiB, "
          f"tensors of {args.tensor_megabytes} MB, best of {args.repeats}, "
          f"{args.peer_threads} thread(s) per side of a cross-process sync, device {args.device}")
    if "shm" in engines:
        print("shm between processes through " + ("CUDA IPC handles of two device buffers"
              if args.device == "cuda" else "/dev/shm files (CUDA IPC needs --device cuda)"))
    if "shm-db" in engines and args.device == "cpu":  # the slot write's one pass (slots.py)
        fused = cpu_kernels.load() is not None
        print("shm-db writes with " + ("the fused copy+checksum kernel" if fused else
              f"torch copy then checksum ({cpu_kernels.unavailable_reason()})"))
    receiver = Receiver(args.peer_threads, args.device)
    shm_ratios: dict[int, dict[str, float]] = {}
    pause_ratios: dict[int, float] = {}
    delta_ratios: dict[int, float] = {}  # delta / full gloo across the shaped link
    kwargs = {"bucket_megabytes": args.bucket_megabytes, "timeout_s": 600.0,
              **({"device": "cuda"} if args.device == "cuda" else {})}
    for size in (int(s) for s in args.sizes.split(",")):
        state = make_state(size, args.tensor_megabytes, args.device)
        nbytes = sum(t.numel() * 4 for t in state.values())
        destination = {name: torch.zeros_like(t) for name, t in state.items()}
        receiver.call("allocate", {name: t.numel() for name, t in state.items()})
        receiver.wait()
        memcpy = time_memcpy(state, destination, args.repeats)
        memcpy_rate = nbytes / memcpy / GIB
        copy = "device-to-device copy" if args.device == "cuda" else "memcpy"
        print(f"{size} MB: {copy} {memcpy_rate:.2f} GiB/s ({memcpy * 1e3:.0f} ms)")

        def report(label: str, seconds: float, extra: str = "") -> float:
            rate = nbytes / seconds / GIB
            print(f"  {label:<10} {rate:7.2f} GiB/s  {rate / memcpy_rate:5.2f}x memcpy  "
                  f"{seconds * 1e3:7.0f} ms{extra}")
            return rate

        full_times: dict[str, float] = {}  # shm / gloo full-sync time, for the delta rows
        for engine in engines:
            if engine == "naive":
                report("naive", time_naive(state, destination, args.repeats, args.bucket_megabytes))
            elif engine in ("shm", "shm-db", "gloo"):
                transport = "gloo" if engine == "gloo" else "shm"
                engine_kwargs = dict(kwargs, double_buffer=True) if engine == "shm-db" else \
                    dict(kwargs, double_buffer=False) if engine == "shm" else kwargs
                result = time_remote(transport, engine_kwargs, state, receiver, args.repeats,
                                     threads=args.peer_threads, memcpy=lambda: time_memcpy(
                                         state, destination, 1))
                exact = receiver.checksum() == _checksum(state)
                flip = (f", pause (flip) {result['flip_s'] * 1e3:.3f} ms = "
                        f"{result['flip_s'] / memcpy:.4f}x one memcpy" if result["flip_s"] else "")
                same_threads = result["memcpy_s"] / result["send_s"]  # = rate / that memcpy's rate
                report(engine, result["send_s"], f"  (setup {result['setup_s'] * 1e3:.0f} "
                              f"ms, bits {'equal' if exact else 'DIFFER'}{flip}; {same_threads:.2f}x"
                              f" a memcpy on its {args.peer_threads} thread(s), interleaved)")
                full_times[engine] = result["send_s"]
                if not exact:
                    raise SystemExit(f"sync.py: {engine} delivered other bits than were sent")
                if engine in ("shm", "shm-db"):
                    shm_ratios.setdefault(size, {})[engine] = same_threads
                if result["flip_s"]:
                    pause_ratios[size] = result["flip_s"] / memcpy
            elif engine == "delta-link":
                if (reason := sync_link.unavailable()) is not None:
                    print(f"  delta-link skipped: {reason}")
                    continue
                link = sync_link.run_link(size, args.tensor_megabytes, args.bucket_megabytes,
                                          args.repeats, args.peer_threads, args.link_rate)
                if not link["exact"]:
                    raise SystemExit("sync.py: delta-link delivered other bits than were sent")
                report("link gloo", link["full_s"], f"  ({args.link_rate} shaped veth)")
                report("link delta", link["delta_s"], f"  (1% changed, bytes "
                       f"{link['delta_bytes'] / link['full_bytes']:.1%} of full, "
                       f"{link['delta_s'] / link['full_s']:.3f}x the full time; encoded "
                       f"{link['encode_s'] * 1e3:.0f} ms ahead, patches applied in "
                       f"{link['load_s'] * 1e3:.0f} ms)")
                delta_ratios[size] = link["delta_s"] / link["full_s"]
            elif engine in ("delta", "delta-gloo"):
                transport = "gloo" if engine == "delta-gloo" else "shm"
                for fraction in (0.01, 0.10):
                    result = time_remote("delta", dict(kwargs, transport=transport), state, receiver,
                                         args.repeats, fraction, args.peer_threads)
                    full = full_times.get(transport)
                    versus = f", {result['send_s'] / full:.2f}x the full {transport} time" if full else ""
                    report(f"{engine} {fraction:.0%}", result["send_s"],
                           f"  (bytes {result['bytes_sent'] / nbytes:.1%} of full{versus}; "
                           f"encoded {result['encode_s'] * 1e3:.0f} ms ahead)")
        del state, destination
    receiver.close()
    native_pause = None
    if "shm-db-native" in engines and args.device == "cpu":
        for policy in ("recompute", "keep"):
            native = sync_native.run_native(args.bucket_megabytes, policy,
                                            TinyModelSpec() if args.tiny else sync_native.SPEC)
            memcpy_s = native["memcpy_s"]
            print(f"shm-db into a generating native engine, {native['bytes'] / 1e6:.0f} MB, one "
                  f"thread each side, in_flight_kv={policy}: memcpy {memcpy_s * 1e3:.0f} ms; "
                  f"write + check {native['copy_s']:.2f} s, {native['tokens_during']} tokens "
                  f"generated meanwhile; flip (step lock) {native['flip_s'] * 1e3:.2f} ms; no "
                  f"token for {native['gap_s'] * 1e3:.0f} ms around it (a decode step "
                  f"{native['step_s'] * 1e3:.0f} ms): pause {native['pause_s'] * 1e3:.0f} ms = "
                  f"{native['pause_s'] / memcpy_s:.4f}x memcpy")
            native_pause = (native["pause_s"] / memcpy_s, round(native["bytes"] / 1e6), policy)
    print(f"load average at the end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if native_pause is not None:  # the engine's own pause, running requests keeping their KV
        print(f"PAUSE_RATIO {native_pause[0]:.4f} generation pause (the flip, or no token less "
              f"one decode step) of a double-buffered shm sync into a generating native engine / one memcpy, "
              f"{native_pause[1]} MB, in_flight_kv={native_pause[2]}, cpu")
    elif pause_ratios:
        size = min(pause_ratios, key=lambda s: abs(s - 500))
        print(f"PAUSE_RATIO {pause_ratios[size]:.4f} generation pause (flip) of a double-buffered "
              f"shm sync / one memcpy, {size} MB, {args.device}")
    if delta_ratios:
        size = min(delta_ratios, key=lambda s: abs(s - 500))
        print(f"DELTA_RATIO {delta_ratios[size]:.3f} delta / full gloo, 1% changed, {size} MB, "
              f"{args.link_rate} shaped link between two network namespaces (delta encoded "
              "ahead, not counted)")
    if shm_ratios:  # the default same-host path: double-buffered where it ran, else the ring
        size = min(shm_ratios, key=lambda s: abs(s - 500))
        path = "shm-db" if "shm-db" in shm_ratios[size] else "shm"
        print(f"RATIO {shm_ratios[size][path]:.2f} {path} cross-process / memcpy on the sender's "
              f"{args.peer_threads} thread(s), interleaved, {size} MB, {args.device}")


if __name__ == "__main__":
    main()
