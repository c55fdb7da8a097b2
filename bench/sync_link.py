"""Two simulated hosts for bench/sync.py: network namespaces `tsync-a` and `tsync-b` joined by a
veth pair that `tc tbf` shapes to one rate (both directions), the sender in one, the receiver in
the other, each a process of its own; a gloo full sync vs delta over gloo across that link.

Needs root, `ip` and `tc` (FACTS.md); every address lives inside the two namespaces, which are
deleted at the end (and before, if an earlier run left them). The two processes talk over a Unix
socket file (those cross network namespaces); gloo traffic goes over the veth pair only.

    sudo .venv/bin/python bench/sync_link.py --size 500 --rate 1gbit   # also run by bench/sync.py
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Client, Listener
from pathlib import Path

NAMESPACES = ("tsync-a", "tsync-b")
VETHS = ("tsync-va", "tsync-vb")
ADDRESSES = ("10.231.0.1", "10.231.0.2")
HERE = Path(__file__).resolve().parent


def unavailable() -> str | None:
    """Why the shaped link cannot be built here, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and tc)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    return f"needs {' and '.join(missing)} (iproute2)" if missing else None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def teardown() -> None:
    """Delete the two namespaces (their veth ends go with them); absent ones are fine."""
    for namespace in NAMESPACES:
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True)


def setup(rate: str) -> None:
    """The two namespaces, the veth pair between them, addresses and `tc tbf` at `rate` on
    both ends."""
    teardown()
    for namespace in NAMESPACES:
        _ip("netns", "add", namespace)
    _ip("link", "add", VETHS[0], "netns", NAMESPACES[0], "type", "veth", "peer", "name", VETHS[1],
        "netns", NAMESPACES[1])
    for namespace, veth, address in zip(NAMESPACES, VETHS, ADDRESSES):
        _ip("-n", namespace, "addr", "add", f"{address}/24", "dev", veth)
        _ip("-n", namespace, "link", "set", veth, "up")
        _ip("-n", namespace, "link", "set", "lo", "up")
        subprocess.run(["tc", "-n", namespace, "qdisc", "add", "dev", veth, "root", "tbf", "rate",
                        rate, "burst", "256kb", "latency", "50ms"], check=True, capture_output=True)


def _in_namespace(index: int, *args: str) -> list[str]:
    return ["ip", "netns", "exec", NAMESPACES[index], sys.executable, str(Path(__file__)), *args]


def _environment(index: int) -> dict[str, str]:
    # gloo binds the interface its hostname resolves to unless told: the veth end of this side
    return {**os.environ, "GLOO_SOCKET_IFNAME": VETHS[index],
            "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent / "src"),
                                           os.environ.get("PYTHONPATH", "")])}


def run_link(size: int, tensor_megabytes: int, bucket_megabytes: int, repeats: int,
             threads: int, rate: str = "1gbit") -> dict:
    """Full gloo vs delta-over-gloo (1% changed) across the shaped link: their best sync times
    (delta's without its encode_ahead, which is reported apart with the receiver's patch-apply
    time inside delta's), bytes sent, and whether the receiver ended with the sender's bits."""
    setup(rate)
    socket_dir = tempfile.mkdtemp(prefix="tsync-")
    socket_path = os.path.join(socket_dir, "control")
    receiver = None
    try:
        sender = subprocess.Popen(_in_namespace(0, "sender", socket_path, json.dumps(
            [size, tensor_megabytes, bucket_megabytes, repeats, threads])),
            env=_environment(0), stdout=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while not os.path.exists(socket_path):
            if sender.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("sync_link: the sender never listened")
            time.sleep(0.05)
        receiver = subprocess.Popen(_in_namespace(1, "receiver", socket_path, str(threads)),
                                    env=_environment(1))
        output, _ = sender.communicate(timeout=1800)
        if sender.returncode:
            raise RuntimeError(f"sync_link: the sender failed (exit {sender.returncode})")
        return json.loads(output.strip().splitlines()[-1])
    finally:
        if receiver is not None:
            try:
                receiver.wait(60)
            except subprocess.TimeoutExpired:
                receiver.kill()
        shutil.rmtree(socket_dir, ignore_errors=True)
        teardown()


def _sender(socket_path: str, arguments: str) -> None:
    import sync  # bench/sync.py, on PYTHONPATH

    size, tensor_megabytes, bucket_megabytes, repeats, threads = json.loads(arguments)
    listener = Listener(socket_path, "AF_UNIX")
    receiver = sync.Receiver(threads, conn=listener.accept())
    state = sync.make_state(size, tensor_megabytes)
    receiver.call("allocate", {name: t.numel() for name, t in state.items()})
    receiver.wait()
    kwargs = {"bucket_megabytes": bucket_megabytes, "timeout_s": 600.0, "master_addr": ADDRESSES[0]}
    full = sync.time_remote("gloo", kwargs, state, receiver, repeats, threads=threads)
    full_exact = receiver.checksum() == sync._checksum(state)
    delta = sync.time_remote("delta", dict(kwargs, transport="gloo"), state, receiver, repeats,
                             0.01, threads)
    delta_exact = receiver.checksum() == sync._checksum(state)
    receiver.close()
    nbytes = sum(t.numel() * 4 for t in state.values())
    print(json.dumps({"bytes": nbytes, "full_s": full["send_s"], "full_bytes": full["bytes_sent"],
                      "delta_s": delta["send_s"], "delta_bytes": delta["bytes_sent"],
                      "encode_s": delta["encode_s"], "load_s": delta["load_s"],
                      "exact": full_exact and delta_exact}), flush=True)


def _receiver(socket_path: str, threads: str) -> None:
    import sync

    sync.receiver_main(Client(socket_path, "AF_UNIX"), int(threads), "cpu")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ("sender", "receiver"):
        (_sender if sys.argv[1] == "sender" else _receiver)(*sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=500, help="MB")
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    if (reason := unavailable()) is not None:
        raise SystemExit(f"sync_link.py: {reason}")
    result = run_link(args.size, 25, 64, args.repeats, 1, args.rate)
    print(json.dumps(result))
    print(f"encoded ahead in {result['encode_s'] * 1e3:.0f} ms (not in the sync time)")
    print(f"DELTA_RATIO {result['delta_s'] / result['full_s']:.3f} delta / full gloo, 1% changed, "
          f"{args.size} MB, {args.rate} shaped link (delta encoded ahead, not counted)")


if __name__ == "__main__":
    main()
