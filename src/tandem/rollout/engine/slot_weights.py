"""The native engine's weights in two shared-memory slots (the double-buffered handoff;
docs/weight_sync.md).

`map_into` copies the served weights into the active slot once and makes every dense parameter a
view of it. A sync writes the other slot while steps go on; `stage_from_slot` checks it and packs
what the forward needs packed (oneDNN linears have no dense weight to serve from a slot), off the
event loop; `flip` then re-points the parameters between two steps. `SlotServing` is that part of
AsyncEngine's API (the engine mixes it in).

A tensor-parallel replica lays every rank's slices out in the same two files (rank r's entries
named "<HF name>@<r>", rank 0's plain), each entry with the region of the full tensor the sender
writes into it; the workers map the files too, check and pack their part of a written slot when
rank 0 commits, and all ranks flip together between two steps (rank_worker.py).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch

from tandem.rollout.base import all_finite
from tandem.rollout.engine.tensor_parallel import ZEROS
from tandem.rollout.engine.weight_staging import SlotStage, embed_name, weight_key
from tandem.weight_layout import Chunk

RANK_SEPARATOR = "@"  # a worker rank's slot entries: "<HF name>@<rank>"


class SlotServing:
    """AsyncEngine's weight slots: serve dense weights from one, stage a version a sender wrote
    into the other, flip between steps (uses the engine's runner, step lock and weight state)."""

    _slot_views: list[dict[str, torch.Tensor]] | None = None  # both slots' weights by name
    weight_slot_active: int | None = None  # the slot dense weights are views of

    def weight_slot_specs(self) -> tuple | None:
        """(name, shape, dtype) of every weight and the aliases senders may use (tensor
        parallel: every rank's slices, and the region of the full tensor each holds), for the
        two slots the server lays out; None when the engine cannot serve from slots now
        (weights dropped, or an adapter merged: slots hold full versions)."""
        if self.weights_state != "loaded" or self.unfilled_weights or self.lora.adapter:
            return None
        specs = slot_specs(self.runner, self._accepted_shapes())
        if specs is None or self.ranks is None:
            return specs
        return rank_slot_specs(self.runner, *specs)

    async def map_weight_slots(self, views: list[dict[str, torch.Tensor]], active: int,
                               files: tuple[tuple[str, str], list[Chunk], int] | None = None
                               ) -> None:
        """Copy the served weights into slot `active` and serve dense weights from it (once;
        a pause of one copy); `views` are both slots' weights by name, `files` their (paths,
        entries, bytes), which a tensor-parallel replica's workers map too."""
        self._ensure_loop()
        async with self._lock:
            if self.weights_state != "loaded":
                raise RuntimeError(self._weights_missing_message())
            own = [{name: tensor for name, tensor in slot.items() if RANK_SEPARATOR not in name}
                   for slot in views]
            map_into(self.runner, own[active])
            if self.ranks is not None:
                paths, entries, nbytes = files
                self.ranks.map_slots(paths, nbytes, entries_by_rank(entries), active)
            self._slot_views, self.weight_slot_active = own, active

    def stage_slot_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], index: int
                           ) -> SlotStage:
        """Check the version a sender wrote into inactive slot `index` (the stream yields views
        of it) and pack what the forward needs packed; may run in another thread. Tensor
        parallel: rank 0's entries only (the workers check theirs at commit_weights)."""
        self._check_inactive_slot(index)
        if self.ranks is not None:
            named_tensors = ((name, tensor) for name, tensor in named_tensors
                             if RANK_SEPARATOR not in name)
        return stage_from_slot(self.runner, self._accepted_shapes(), named_tensors,
                               self._slot_views[index], index, self.version)

    def _check_inactive_slot(self, index: int) -> None:
        if self._slot_views is None or index == self.weight_slot_active:
            raise RuntimeError(f"slot {index} is not this engine's inactive slot (active: "
                               f"{self.weight_slot_active})")

    def _flip_to_slot(self, stage: SlotStage) -> list[torch.Tensor]:
        """Serve the staged slot (under the step lock); a full version is its own new base.
        Returns the packed tensors it replaced (see flip)."""
        replaced = flip(self.runner, stage, self._slot_views[stage.index])
        self.weight_slot_active = stage.index
        self.lora.drop(stage.names)
        return replaced

    def _forget_slots(self) -> None:
        """The parameters are no slot views any more (fresh tensors, or dropped)."""
        self._slot_views = self.weight_slot_active = None


def slot_specs(runner: Any, shapes: Mapping[str, torch.Size]
               ) -> tuple[list[tuple[str, tuple[int, ...], torch.dtype]], dict[str, str]] | None:
    """(name, shape, dtype) of every weight a slot holds, and the HF aliases senders may use
    (a tied lm_head); None where slots cannot serve (a CUDA engine: the slots are host memory)."""
    if runner.device.type != "cpu":
        return None
    specs = [(name, tuple(shape), runner.dtype) for name, shape in shapes.items()]
    aliases = {}
    if "lm_head.weight" not in shapes and getattr(runner.config, "tie_word_embeddings", False):
        aliases["lm_head.weight"] = embed_name(shapes)
    return specs, aliases


def rank_slot_specs(runner: Any, specs: list[tuple[str, tuple[int, ...], torch.dtype]],
                    aliases: dict[str, str]) -> tuple[list, dict[str, str], dict[str, tuple]]:
    """slot_specs of a tensor-parallel rank 0 grown to the whole replica: rank r's slices as
    "<name>@<r>" (a zero bias, never sent, is left out), and the region (source, dim, start,
    stop) of the full tensor every entry holds."""
    layouts = runner.tensor_parallel.layout.all_ranks()
    names = [name for name, _, _ in specs]
    regions: dict[str, tuple] = {}
    specs = list(specs)
    for layout in layouts:
        for name in names:
            where, full = layout.region(name), runner.full_shapes[name]
            if where == ZEROS:
                continue
            dim, indices = where if where is not None else (0, slice(0, full[0]))
            entry = name if layout.rank == 0 else f"{name}{RANK_SEPARATOR}{layout.rank}"
            regions[entry] = (name, dim, indices.start, indices.stop)
            if layout.rank:
                shape = list(full)
                shape[dim] = indices.stop - indices.start
                specs.append((entry, tuple(shape), runner.dtype))
    return specs, aliases, regions


def entries_by_rank(entries: Iterable[Chunk]) -> dict[int, list[Chunk]]:
    """A replica's slot entries by worker rank, under the rank's own (HF) names."""
    ranks: dict[int, list[Chunk]] = {}
    for entry in entries:
        name, separator, rank = entry.name.rpartition(RANK_SEPARATOR)
        if separator:
            ranks.setdefault(int(rank), []).append(entry._replace(name=name))
    return ranks


def map_into(runner: Any, views: Mapping[str, torch.Tensor]) -> None:
    """Copy the served weights into `views` (the active slot) and serve dense ones from it."""
    with torch.no_grad():
        for name, destination in views.items():
            destination.copy_(runner.dense_weight(name))
            if name not in runner.packed_linears:
                runner.model.get_parameter(name).data = destination
    if runner.tied_lm_head:
        runner.lm_head_source = _version_key(runner.embed_tokens.weight)


def stage_from_slot(runner: Any, shapes: Mapping[str, torch.Size],
                    stream: Iterable[tuple[str, torch.Tensor]], views: Mapping[str, torch.Tensor],
                    index: int, version: int) -> SlotStage:
    """Check each weight the transport wrote into slot `index` (it yields views of that slot)
    and pack the packed linears from it; the served slot is not touched."""
    stage = SlotStage(index, set())
    with torch.no_grad():
        for name, tensor in stream:
            key = weight_key(name, shapes, runner.config)
            slot_view = views.get(key)
            if slot_view is None:
                raise ValueError(f"update_weights: unknown weight {name!r} in slot {index}")
            if tensor.data_ptr() != slot_view.data_ptr() or tensor.shape != slot_view.shape:
                raise ValueError(f"update_weights: {name!r} was not delivered into slot {index}")
            if not all_finite(slot_view):
                raise ValueError(f"update_weights: {name!r} holds NaN or inf values (in "
                                 f"{runner.dtype}); the engine keeps version {version}")
            if key in runner.packed_linears:
                stage.packed[key] = runner.stage_form(key, slot_view)
            stage.names.add(key)
        embedding = embed_name(views)
        if runner.tied_lm_head and embedding in stage.names:
            stage.lm_head = type(runner.lm_head).pack(views[embedding])
    return stage


def flip(runner: Any, stage: SlotStage, views: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    """Serve slot `stage.index`: re-point dense parameters, swap packed tensors (no copy).
    Returns the packed tensors it replaced: the caller drops them after the step lock, since
    freeing hundreds of MB (munmap) takes tens of milliseconds."""
    replaced = []
    for name in stage.names:
        if name in runner.packed_linears:
            replaced.append(runner.packed_linears[name].packed)
            runner.packed_linears[name].packed = stage.packed[name]
        else:
            runner.model.get_parameter(name).data = views[name]
    if stage.lm_head is not None:
        replaced.append(runner.lm_head.packed)
        runner.lm_head.packed = stage.lm_head
        runner.lm_head_source = _version_key(runner.embed_tokens.weight)
    return replaced


def _version_key(tensor: torch.Tensor) -> tuple[int, int]:
    return tensor.data_ptr(), tensor._version
