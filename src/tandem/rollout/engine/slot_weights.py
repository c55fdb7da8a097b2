"""The native engine's weights in two shared-memory slots (the double-buffered handoff).

The server gives the engine two sets of views, one per slot (weight_sync/slots.py owns the
files); `map_into` copies the served weights into the active slot once and makes every dense
parameter a view of it. A sync writes the other slot while steps go on; `stage_from_slot`
checks it (names, finiteness) and packs what the forward needs packed, off the event loop;
`flip` then re-points the parameters between two steps.

Packed linears (CPU fp32, oneDNN) cannot run on a slot: their weight lives only in oneDNN's
blocked layout, which no sender writes. For them the slot holds the dense weight the sender
wrote, and staging packs it from the slot into a new packed tensor while generation continues;
the flip swaps the packed tensors. Memory: those linears are held three times (two dense slots
and the packed copy), every other weight twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import torch

from tandem.rollout.engine.weight_staging import all_finite, weight_key


@dataclass
class SlotStage:
    """A checked version in slot `index`, with the packed tensors made from it."""

    index: int
    names: set[str]
    packed: dict[str, torch.Tensor] = field(default_factory=dict)
    lm_head: torch.Tensor | None = None  # the tied lm_head packed from the slot's embedding


def slot_specs(runner: Any, shapes: Mapping[str, torch.Size]
               ) -> tuple[list[tuple[str, tuple[int, ...], torch.dtype]], dict[str, str]] | None:
    """(name, shape, dtype) of every weight a slot holds, and the HF aliases senders may use
    (a tied lm_head); None where slots cannot serve (a CUDA engine: the slots are host memory)."""
    if runner.device.type != "cpu":
        return None
    specs = [(name, tuple(shape), runner.dtype) for name, shape in shapes.items()]
    aliases = {}
    if "lm_head.weight" not in shapes and getattr(runner.config, "tie_word_embeddings", False):
        aliases["lm_head.weight"] = "model.embed_tokens.weight"
    return specs, aliases


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
        if runner.tied_lm_head and "model.embed_tokens.weight" in stage.names:
            stage.lm_head = type(runner.lm_head).pack(views["model.embed_tokens.weight"])
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
