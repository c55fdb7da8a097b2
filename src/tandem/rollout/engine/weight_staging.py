"""Checking and copying a weight stream before the engine swaps it in (all or nothing)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import torch

from tandem.rollout.base import all_finite
from tandem.types import WeightPatch


@dataclass(frozen=True)
class StagedPatch:
    """A checked patch of a dense parameter, applied in place at commit if the parameter is
    still the tensor it was checked against (`stamp`: data pointer, version counter)."""

    patch: WeightPatch
    stamp: tuple[int, int]


def weight_key(name: str, shapes: Mapping[str, torch.Size], model_config: Any) -> str:
    """The engine's name for HF weight `name`: a tied lm_head is served by the embedding."""
    if name not in shapes and name == "lm_head.weight" and getattr(model_config, "tie_word_embeddings", False):
        return "model.embed_tokens.weight"
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
