"""Weight updates of the native engine, all or nothing: a stream is checked and copied (staged)
without touching the engine, then swapped in between two steps (committed).

`WeightUpdates` is that part of AsyncEngine's API (the engine mixes it in): stage_weights,
commit_weights (a full or partial stream, a delta's patches, a merged adapter, or a flip to a
weight slot staged by slot_weights.py), update_weights (both at once) and the reads a delta sync
checks against (tensor parallel: gathered from the ranks between two steps). A tensor-parallel
engine stages each rank's slices (stage_shards; a delta's patches cut per rank): rank 0
checks its own at staging; the other ranks receive and check theirs at commit, and only when
every rank has staged does any install (rank_worker.RankWorkers.stage). An adapter is cut the
same way (stage_adapter_shards): each rank merges its slices of A and B into its own base slices.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import torch

from tandem.rollout.adapter_stream import is_adapter_name, peek_stream, read_adapter
from tandem.rollout.base import EMBED_NAMES, all_finite, check_coverage, checked_version
from tandem.rollout.engine.lora_merge import (LoraState, StagedAdapter, adapter_tensors,
                                              merge_adapter, stage_adapter)
from tandem.rollout.engine.tensor_parallel import ZEROS, reshard
from tandem.types import WeightPatch


@dataclass(frozen=True)
class StagedPatch:
    """A checked patch of a dense parameter, applied in place at commit if the parameter is
    still the tensor it was checked against (`stamp`: data pointer, version counter)."""

    patch: WeightPatch
    stamp: tuple[int, int]


@dataclass
class SlotStage:
    """A checked version in weight slot `index`, with the packed tensors made from it
    (slot_weights.stage_from_slot)."""

    index: int
    names: set[str]
    packed: dict[str, torch.Tensor] = field(default_factory=dict)
    lm_head: torch.Tensor | None = None  # the tied lm_head packed from the slot's embedding


@dataclass
class ShardedStage:
    """An update cut for a tensor-parallel replica: rank 0's checked slices (as stage_weights
    returns them, or its merged adapter) and, for ranks 1.., the host copies of their slices
    (of the weights, or of A and B), still to send and check."""

    local: dict[str, torch.Tensor] | StagedAdapter
    others: list[dict[str, torch.Tensor]]


def accepted_shapes(runner: Any) -> dict[str, torch.Size]:
    """HF name -> shape (this rank's slice under tensor parallelism) of every weight an update
    sets (dense and packed)."""
    shapes = {name: p.shape for name, p in runner.named_parameters().items()}
    shapes.update((name, linear.weight_shape) for name, linear in runner.packed_linears.items())
    return shapes


def embed_name(shapes: Mapping[str, Any]) -> str:
    """The HF name of the input embedding among `shapes`' names."""
    return next((name for name in EMBED_NAMES if name in shapes), EMBED_NAMES[0])


def weight_key(name: str, shapes: Mapping[str, torch.Size], model_config: Any) -> str:
    """The engine's name for HF weight `name`: a tied lm_head is served by the embedding."""
    if name not in shapes and name == "lm_head.weight" and getattr(model_config, "tie_word_embeddings", False):
        return embed_name(shapes)
    return name


def stage_weights(runner: Any, shapes: Mapping[str, torch.Size],
                  named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
                  ) -> dict[str, torch.Tensor]:
    """Copy the stream into fresh host tensors of the runner's dtype (packed linears' weights
    straight into their packed layout), checking every name, shape, dtype and value (NaN/inf
    rejected), so a stream that raises or a bad tensor leaves the engine on `version`; a
    WeightPatch is staged by stage_patch."""
    staged: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, tensor in named_tensors:
            key = weight_key(name, shapes, runner.config)
            shape = shapes.get(key)
            if shape is None:
                raise ValueError(f"update_weights: unknown weight {name!r} (expected HF "
                                 f"names such as {next(iter(shapes))!r})")
            if isinstance(tensor, WeightPatch):
                staged[key] = stage_patch(runner, key, name, tensor, version)
                continue
            if tuple(tensor.shape) != tuple(shape):
                raise ValueError(f"update_weights: {name!r} has shape {tuple(tensor.shape)},"
                                 f" the model expects {tuple(shape)}")
            if not tensor.is_floating_point():
                raise TypeError(f"update_weights: {name!r} has dtype {tensor.dtype}; "
                                "weights must be floating point")
            if key in runner.packed_linears:  # packing copies: no dense copy first
                copy = tensor.detach().to("cpu", runner.dtype).contiguous()
            else:
                # on the host even for CUDA engines: a staged full copy never doubles device memory
                copy = torch.empty(shape, dtype=runner.dtype).copy_(tensor)
            if not all_finite(copy):
                raise ValueError(f"update_weights: {name!r} holds NaN or inf values (in "
                                 f"{runner.dtype}); the engine keeps version {version}")
            staged[key] = runner.stage_form(key, copy)
    return staged


def stage_shards(runner: Any, shapes: Mapping[str, torch.Size],
                 named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> ShardedStage:
    """Reshard a full stream (tensor_parallel.reshard) as it arrives: rank 0's slice of each
    tensor is staged (checked) like a whole one, the other ranks' slices are copied to host
    tensors of the engine's dtype (a transport's buffers are reused) to be sent at commit; a
    delta's patch is cut into each rank's part the same way (its changes in that rank's slice)."""
    layouts = runner.tensor_parallel.layout.all_ranks()
    others: list[dict[str, torch.Tensor]] = [{} for _ in layouts[1:]]
    tied = weight_key("lm_head.weight", runner.full_shapes, runner.config)

    def rank_zero() -> Iterable[tuple[str, torch.Tensor]]:
        for key, parts in reshard(named_tensors, layouts, runner.full_shapes,
                                  {"lm_head.weight": tied}):
            for held, part in zip(others, parts[1:]):
                if isinstance(part, WeightPatch) or part is None:  # None: that rank holds zeros
                    if part is not None:
                        held[key] = part  # the index and values are the part's own
                    continue
                held[key] = (torch.empty(part.shape, dtype=runner.dtype).copy_(part)
                             if part.is_floating_point() else part.clone())
            if parts[0] is not None:
                yield key, parts[0]

    return ShardedStage(stage_weights(runner, shapes, rank_zero(), version), others)


def stage_adapter_shards(runner: Any, named_tensors: Iterable[tuple[str, torch.Tensor]],
                         state: LoraState) -> ShardedStage:
    """An adapter stream for a tensor-parallel replica: checked whole against the full shapes,
    cut per rank (ShardLayout.adapter_slices); rank 0 merges its slices now, ranks 1.. get
    theirs at commit. Rank 0 records the adapter as received (current_weight reads it)."""
    pairs = read_adapter(named_tensors, runner.full_shapes)
    layouts = runner.tensor_parallel.layout.all_ranks()
    cut = [{module: layout.adapter_slices(module, a, b) for module, (a, b) in pairs.items()}
           for layout in layouts]
    local = merge_adapter(runner, cut[0], state)
    local.adapter = adapter_tensors(pairs)
    others = [{name: part.clone(memory_format=torch.contiguous_format)
               for name, part in adapter_tensors(rank_pairs).items()} for rank_pairs in cut[1:]]
    return ShardedStage(local, others)


def stage_patch(runner: Any, key: str, name: str, patch: WeightPatch, version: int
                ) -> StagedPatch | torch.Tensor:
    """A delta sync's patch of weight `key` (its new values checked like a full tensor's): a
    StagedPatch for a contiguous dense parameter, else (packed linears) the patched weight in
    the form swap_weight installs."""
    if patch.values.dtype != runner.dtype:
        raise TypeError(f"update_weights: patch of {name!r} has dtype {patch.values.dtype}, the "
                        f"engine serves {runner.dtype}")
    if not all_finite(patch.values):
        raise ValueError(f"update_weights: {name!r} holds NaN or inf values (in "
                         f"{runner.dtype}); the engine keeps version {version}")
    weight = runner.dense_weight(key)
    packed = key in runner.packed_linears
    if packed or not weight.is_contiguous():  # no dense tensor to write into: patch a copy
        copy = weight.to("cpu", copy=not packed).contiguous()  # to_dense() is a copy already
        patch.apply_to(copy)
        return runner.stage_form(key, copy)
    on_device = WeightPatch(patch.index.to(weight.device), patch.values.to(weight.device))
    return StagedPatch(on_device, _stamp(weight))


def install_staged(runner: Any, staged: Mapping[str, torch.Tensor | StagedPatch]) -> None:
    """Install what stage_weights returned (runner.swap_weight; a StagedPatch in place), after
    checking that every patched parameter is still the tensor it was checked against, so a
    refusal installs nothing."""
    for key, item in staged.items():
        if isinstance(item, StagedPatch) and _stamp(runner.dense_weight(key)) != item.stamp:
            raise RuntimeError(f"update_weights: {key!r} changed after its delta patch was "
                               "checked; the engine keeps its version")
    with torch.no_grad():
        for key, item in staged.items():
            if isinstance(item, StagedPatch):
                item.patch.apply_to(runner.dense_weight(key))
            else:
                runner.swap_weight(key, item)


def _stamp(weight: torch.Tensor) -> tuple[int, int]:
    return weight.data_ptr(), weight._version


class WeightUpdates:
    """AsyncEngine's weight updates and reads (uses the engine's runner, step lock, version,
    weight state and LoRA state)."""

    def _accepted_shapes(self) -> dict[str, torch.Size]:
        """HF name -> shape of every weight update_weights accepts (dense and packed)."""
        if self.weights_state != "loaded":
            raise RuntimeError(self._weights_missing_message())
        return accepted_shapes(self.runner)

    def stage_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]
                      ) -> dict[str, torch.Tensor] | StagedAdapter | ShardedStage:
        """Checked host copies of the stream (stage_weights below), for an adapter stream the
        merged weights (lora_merge.stage_adapter), for a tensor-parallel engine each rank's
        slices (stage_shards, stage_adapter_shards); the engine itself is not touched and no rank
        is contacted, so it may run in another thread (commit_weights re-checks that the weights
        were not put to sleep meanwhile)."""
        adapter, stream = peek_stream(named_tensors)
        if stream is None:
            return {}
        shapes = self._accepted_shapes()  # raises while the weights sleep
        if adapter and self.unfilled_weights:  # dropped by sleep: there is no base to merge into
            raise RuntimeError(self._weights_missing_message())
        if self.ranks is not None:
            return (stage_adapter_shards(self.runner, stream, self.lora) if adapter
                    else stage_shards(self.runner, shapes, stream, self.version))
        return (stage_adapter(self.runner, shapes, stream, self.lora) if adapter
                else stage_weights(self.runner, shapes, stream, self.version))

    async def commit_weights(self, staged: Mapping[str, torch.Tensor] | StagedAdapter | SlotStage
                             | ShardedStage, version: int, partial: bool = False) -> float:
        """Swap staged tensors (stage_weights), merge a staged adapter, or flip to a staged slot
        (stage_slot_weights), under the step lock, and stamp `version` (an integer, never below
        the current one); the update must hold every weight unless `partial` (an adapter always
        is). A tensor-parallel engine first has every other rank receive and check its slices:
        if one refuses, this raises and no rank installs anything. Returns the seconds
        generation stood still (swap or flip plus KV invalidation; with tensor parallelism the
        other ranks' transfer too)."""
        self._ensure_loop()
        sharded = staged if isinstance(staged, ShardedStage) else None
        staged = sharded.local if sharded is not None else staged
        adapter = staged if isinstance(staged, StagedAdapter) else None
        staged = adapter.weights if adapter is not None else staged
        replaced: list[torch.Tensor] = []  # freed after the lock: a step need not wait for it
        async with self._lock:
            started = time.perf_counter()
            if self.weights_state != "loaded":
                raise RuntimeError(self._weights_missing_message())
            version = checked_version(version, self.version)
            slot = isinstance(staged, SlotStage)
            if slot:
                self._check_inactive_slot(staged.index)
            check_coverage(staged.names if slot else staged, self._accepted_shapes(),
                           (partial or adapter is not None) and not slot, version)
            deadline = self.config.checkpoint_engine.timeout_s  # a sync's, for every wait
            if sharded is not None:  # phase one on the other ranks; raises if one refuses
                self.ranks.stage(sharded.others, version, deadline)
            elif slot and self.ranks is not None:  # they check and pack their part of the slot
                self.ranks.stage_slot(staged.index, version, deadline)
            # nothing computed with the old weights is matched again; running requests recompute
            # their KV cache, unless a flip keeps it (rollout.in_flight_kv=keep)
            if not (slot and self.config.in_flight_kv == "keep"):
                self.scheduler.preempt_all()
            self.blocks.clear_prefix_cache()
            for request_id in list(self.held):  # KV of the old weights no decode may take
                self.release_prefilled(request_id)
            if slot:
                replaced = self._flip_to_slot(staged)
                if self.ranks is not None:  # before the next step: every rank on one version
                    self.ranks.flip(deadline)
            else:
                install_staged(self.runner, staged)  # swaps; a delta's patches in place
                if sharded is not None:
                    self.ranks.commit(deadline)
                self.unfilled_weights.difference_update(staged)
                self._forget_slots()
                self.lora.record(adapter if adapter is not None else staged)
            self.version = version
            self.whole_update = self.whole_update or (not partial and adapter is None)
            self._work.set()
            stood_still = time.perf_counter() - started
        del replaced
        return stood_still

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                             version: int, partial: bool = False) -> None:
        """All or nothing: stage and check the whole stream, then swap it in (the version is
        checked before the stream is read)."""
        checked_version(version, self.version)
        await self.commit_weights(self.stage_weights(named_tensors), version, partial)

    def current_weight(self, name: str) -> torch.Tensor:
        """A host copy of the HF-named weight now served (packed linears unpacked; a tensor-
        parallel engine's assembled from every rank's slice), or of an adapter tensor (lora_A /
        lora_B) as last received."""
        if is_adapter_name(name):
            if name not in self.lora.adapter:
                raise KeyError(f"current_weight: no adapter tensor {name!r} is served")
            return self.lora.adapter[name].clone()
        key = weight_key(name, self._accepted_shapes(), self.runner.config)
        if self.ranks is None:
            return self.runner.dense_weight(key).to("cpu", copy=True)
        return self._between_steps(lambda: self._assembled(key))

    def current_values(self, name: str, index: torch.Tensor) -> torch.Tensor:
        """Host copies of the served weight `name` at flat positions `index` (a delta sync's
        check: O(len(index)) for a dense weight; a packed linear is unpacked; a tensor-parallel
        engine asks each rank for the positions in its slice)."""
        key = weight_key(name, self._accepted_shapes(), self.runner.config)
        if key in self.unfilled_weights:  # dropped by sleep: what it holds is no version
            raise RuntimeError(self._weights_missing_message())
        if self.ranks is None:
            flat = self.runner.dense_weight(key).reshape(-1)
            return flat.index_select(0, index.to(self.device)).cpu()
        return self._between_steps(lambda: self._gathered_values(key, index.to(torch.int64)))

    def _assembled(self, key: str) -> torch.Tensor:
        """The full weight `key` from every rank's slice (ShardLayout.region)."""
        slices = [{key: self.runner.dense_weight(key).cpu()}] + self.ranks.weights([key])
        full = torch.empty(self.runner.full_shapes[key], dtype=self.runner.dtype)
        for layout, held in zip(self.runner.tensor_parallel.layout.all_ranks(), slices):
            where = layout.region(key)
            if where is None:  # replicated (or rank 0's whole row-parallel bias)
                return held[key].clone()
            if where != ZEROS:
                dim, indices = where
                full.narrow(dim, indices.start, indices.stop - indices.start).copy_(held[key])
        return full

    def _gathered_values(self, key: str, index: torch.Tensor) -> torch.Tensor:
        """The full weight `key` at flat positions `index`, each read from the first rank
        whose slice holds it (ShardLayout.positions), in the order of `index`."""
        shape = self.runner.full_shapes[key]
        values = torch.empty(index.shape, dtype=self.runner.dtype)
        filled = torch.zeros(index.shape, dtype=torch.bool)
        asked: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for layout in self.runner.tensor_parallel.layout.all_ranks():
            held = layout.positions(key, index, shape)
            if held is None:
                continue
            mask, local = held
            fresh = ~filled[mask]
            take = torch.zeros_like(filled)
            take[mask] = fresh
            filled |= take
            if layout.rank == 0:
                flat = self.runner.dense_weight(key).reshape(-1)
                values[take] = flat.index_select(0, local[fresh].to(self.device)).cpu()
            else:
                asked[layout.rank] = (take, local[fresh])
        if asked:
            replies = self.ranks.values(key, {rank: local for rank, (_, local) in asked.items()})
            for rank, (take, _) in asked.items():
                values[take] = replies[rank - 1]
        return values

    def _between_steps(self, read: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Run `read`, which talks to the tensor-parallel ranks, while no step does: under the
        step lock on the engine's loop when called from another thread (a sync's receiver),
        directly when no loop runs or the caller is the loop itself between steps."""
        loop = self._loop
        if loop is None or loop.is_closed() or not loop.is_running():
            return read()
        try:
            caller = asyncio.get_running_loop()
        except RuntimeError:
            caller = None
        if caller is loop:
            if self._lock.locked():
                raise RuntimeError("reading a tensor-parallel engine's weights from its own "
                                   "event loop while a step holds it; call it from another "
                                   "thread or between steps")
            return read()

        async def locked() -> torch.Tensor:
            async with self._lock:
                return read()

        future = asyncio.run_coroutine_threadsafe(locked(), loop)
        try:
            return future.result(self.config.checkpoint_engine.timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"reading the weights of a tensor-parallel engine: no step "
                               f"boundary within {self.config.checkpoint_engine.timeout_s} s "
                               "(rollout.checkpoint_engine.timeout_s)") from None

    def patches_in_place(self, name: str) -> bool:
        """Model weights (dense ones in place at commit, packed linears re-packed at staging);
        an adapter's tensors come as full copies (they are merged, not served)."""
        return not is_adapter_name(name)
