"""The shm transport's double-buffered mode: the sender writes each receiver's inactive weight
slot (slots.py) directly, cast to the slot's dtype in the same pass (an entry with a region: that
slice of the tensor, e.g. each tensor-parallel rank's), and announces the written
tensors with their checksums in groups of about ANNOUNCE_BYTES (at most `bucket_bytes`;
`ready/<rank>/<k>`, an empty value ends the stream), so the receiver checks each group just
behind the writer. A receiver yields views of its inactive slot; its iterator ends only after
every weight of its layout arrived and the sender committed (control.py), so a sender that dies
part-way leaves nothing the engine would flip to.
"""

from __future__ import annotations

import pickle
from typing import Iterator

import torch.distributed as dist

from tandem.weight_layout import view
from tandem.weight_sync.base import NamedTensors, SyncPlan, WeightSyncError
from tandem.weight_sync.control import await_commit, commit, put, take, wait_keys
from tandem.weight_sync.slots import SlotsDescriptor, byte_sum, mapped, write_and_sum

ANNOUNCE_BYTES = 4 << 20


def map_slots(plan: SyncPlan, rank: int) -> None:
    """Map the slots this participant writes (sender) or checks (receiver) before the transfer,
    so page-table set-up is part of init_process_group, once per process and slot."""
    targets = plan.details["slots"] if rank == 0 else [plan.details["slots"][rank - 1]]
    for target in targets:
        mapped(target.paths[target.inactive], target.layout.nbytes)


def send_into_slots(store: dist.TCPStore, plan: SyncPlan, named_tensors: NamedTensors) -> int:
    """Write the stream into every receiver's inactive slot; returns the bytes written."""
    targets: list[SlotsDescriptor] = plan.details["slots"]
    slots = [mapped(d.paths[d.inactive], d.layout.nbytes) for d in targets]
    layouts = [d.layout.targets() for d in targets]
    aliases = [dict(d.layout.aliases) for d in targets]
    pending: list[list[tuple[str, int]]] = [[] for _ in targets]
    pending_bytes = [0] * len(targets)
    groups = [0] * len(targets)
    filled: list[set[str]] = [set() for _ in targets]
    written = 0
    group_bytes = min(plan.bucket_bytes, ANNOUNCE_BYTES)
    for name, tensor in named_tensors:
        for index, (slot, layout) in enumerate(zip(slots, layouts)):
            rank = index + 1
            places = layout.get(aliases[index].get(name, name))
            if places is None:
                raise WeightSyncError("send", f"receiver {rank}", f"weight {name!r} is not in "
                                      f"the receiver's slot layout (e.g. {next(iter(layout))!r})")
            for entry, region in places:
                if entry.name in filled[index]:
                    continue  # a tied weight already written under its own name
                filled[index].add(entry.name)
                part = tensor if region is None else \
                    tensor.narrow(region.dim, region.start, region.stop - region.start)
                if tuple(part.shape) != entry.shape:
                    raise WeightSyncError("send", f"receiver {rank}", f"{name!r} gives shape "
                                          f"{tuple(part.shape)}, the receiver's slot entry "
                                          f"{entry.name!r} holds {entry.shape}")
                pending[index].append((entry.name, write_and_sum(view(slot, entry), part)))
                pending_bytes[index] += entry.nbytes
                written += entry.nbytes
            if pending_bytes[index] >= group_bytes:
                _announce(store, rank, groups[index], pending[index])
                groups[index] += 1
                pending[index], pending_bytes[index] = [], 0
    for index in range(len(targets)):
        rank = index + 1
        if pending[index]:
            _announce(store, rank, groups[index], pending[index])
            groups[index] += 1
        put(store, f"ready/{rank}/{groups[index]}", b"", "send")
    commit(store, plan.n_receivers, plan.timeout_s)
    return written


def _announce(store: dist.TCPStore, rank: int, group: int, records: list[tuple[str, int]]) -> None:
    put(store, f"ready/{rank}/{group}", pickle.dumps(records), "send")


def receive_slot(store: dist.TCPStore, plan: SyncPlan, rank: int
                 ) -> Iterator[tuple[str, "object"]]:
    """Yield (name, view of the inactive slot) for each weight whose checksum matched."""
    target: SlotsDescriptor = plan.details["slots"][rank - 1]
    slot = mapped(target.paths[target.inactive], target.layout.nbytes)
    layout = target.layout.by_name()
    arrived: set[str] = set()
    group = 0
    while True:
        wait_keys(store, {f"ready/{rank}/{group}": "sender"}, plan.timeout_s, "receive")
        header = take(store, f"ready/{rank}/{group}", "receive")
        if not header:
            break
        for name, checksum in pickle.loads(header):
            weight = view(slot, layout[name])
            if byte_sum(weight) != checksum:
                raise WeightSyncError("receive", "sender", f"checksum mismatch for {name!r} in "
                                      f"slot {target.inactive}: the slot was written by someone "
                                      "else, or the write did not land")
            arrived.add(name)
            yield name, weight
        group += 1
    missing = sorted(set(layout) - arrived)
    if missing:
        raise WeightSyncError("receive", "sender", f"the stream ended without {len(missing)} "
                              f"weights of the slot (e.g. {missing[:3]}); not flipping")
    await_commit(store, rank, plan.timeout_s)
