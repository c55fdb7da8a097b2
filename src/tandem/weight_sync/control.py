"""The control channel of one sync: a TCPStore served by the sender on the address receivers
reach it at (its node's IP across hosts), the rendezvous every transport starts with, and
bounded waits that name the peers that did not show up."""

from __future__ import annotations

import socket
from datetime import timedelta

import torch.distributed as dist

from tandem.weight_sync.base import SyncPlan, WeightSyncError


def serve_store(host: str, timeout_s: float) -> tuple[dist.TCPStore, dict]:
    """Start a store on a free port in this (the sender's) process; returns it and its address."""
    store = dist.TCPStore(host, 0, None, True, timedelta(seconds=timeout_s),
                          wait_for_workers=False)
    return store, {"master_addr": host, "master_port": store.port}


def connect_store(details: dict, timeout_s: float) -> dist.TCPStore:
    """Connect a receiver to the sender's store (phase init_process_group)."""
    try:
        return dist.TCPStore(details["master_addr"], details["master_port"], None, False,
                             timedelta(seconds=timeout_s))
    except (RuntimeError, OSError) as error:
        raise WeightSyncError("init_process_group", "sender",
                              f"cannot reach the sync store at {details['master_addr']}:"
                              f"{details['master_port']} ({error})") from error


def rendezvous(store: dist.TCPStore | None, plan: SyncPlan, rank: int) -> dist.TCPStore:
    """init_process_group's meeting: a receiver connects to the sender's store; every rank says
    it joined; the sender waits for every receiver, a receiver for the sender. Returns the
    store (the sender passes the one build_topology served)."""
    if rank == 0:
        if store is None:
            raise RuntimeError("init_process_group(rank=0) needs this engine's build_topology first")
    else:
        store = connect_store(plan.details, plan.timeout_s)
    put(store, f"joined/{rank}", b"1", "init_process_group")
    peers = ({f"joined/{r}": f"receiver {r}" for r in range(1, plan.n_receivers + 1)} if rank == 0
             else {"joined/0": "sender"})
    wait_keys(store, peers, plan.timeout_s, "init_process_group")
    return store


def local_address_towards(host: str, port: int) -> str:
    """This process's IP on the interface that routes to host:port (a UDP connect sends no
    packet): where a receiver's transport must listen for the sender to reach it."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))
        return probe.getsockname()[0]


def put(store: dist.TCPStore, key: str, value: bytes, phase: str) -> None:
    """store.set; losing the store means its owner, the sender, is gone."""
    try:
        store.set(key, value)
    except (RuntimeError, OSError) as error:
        raise WeightSyncError(phase, "sender", f"lost the sync store ({error})") from error


def take(store: dist.TCPStore, key: str, phase: str) -> bytes:
    """store.get of a key known to exist, with put's error."""
    try:
        return store.get(key)
    except (RuntimeError, OSError) as error:
        raise WeightSyncError(phase, "sender", f"lost the sync store ({error})") from error


def wait_keys(store: dist.TCPStore, keys: dict[str, str], timeout_s: float, phase: str) -> None:
    """Wait until every key exists; `keys` maps key -> the peer that sets it (for the error)."""
    try:
        store.wait(list(keys), timedelta(seconds=timeout_s))
    except (RuntimeError, OSError) as error:  # a timeout, or the store's owner is gone
        missing = _missing(store, keys)
        if missing is None:  # the store itself is unreachable: its owner, the sender, died
            raise WeightSyncError(phase, "sender", f"lost the sync store ({error})") from error
        raise WeightSyncError(phase, ", ".join(missing),
                              f"no word within {timeout_s:g} s (waiting for "
                              f"{', '.join(k for k in keys if keys[k] in missing)}): {error}") from error


def _missing(store: dist.TCPStore, keys: dict[str, str]) -> list[str] | None:
    try:
        return sorted({peer for key, peer in keys.items() if not store.check([key])})
    except (RuntimeError, OSError):
        return None


def commit(store: dist.TCPStore, n_receivers: int, timeout_s: float) -> None:
    """Sender, after its last byte: wait until every receiver has everything, say so, and keep
    the store up until every receiver has read that (its owner's exit would cut them off)."""
    receivers = range(1, n_receivers + 1)
    wait_keys(store, {f"done/{r}": f"receiver {r}" for r in receivers}, timeout_s, "send")
    put(store, "commit", b"1", "send")
    wait_keys(store, {f"ack/{r}": f"receiver {r}" for r in receivers}, timeout_s, "send")


def await_commit(store: dist.TCPStore, rank: int, timeout_s: float) -> None:
    """Receiver, after its last byte: report it, then wait for the sender's word that every
    receiver has it too (so no receiver loads weights from a sync that failed elsewhere)."""
    put(store, f"done/{rank}", b"1", "receive")
    wait_keys(store, {"commit": "sender"}, timeout_s, "receive")
    try:
        store.set(f"ack/{rank}", b"1")
    except (RuntimeError, OSError):  # the sender saw every ack and closed its store: all is done
        pass
