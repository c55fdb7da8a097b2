"""Checking and copying a weight stream before the engine swaps it in (all or nothing)."""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch

from tandem.rollout.base import all_finite


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
    rejected), so a stream that raises or a bad tensor leaves the engine on `version`."""
    staged: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, tensor in named_tensors:
            key = weight_key(name, shapes, runner.config)
            shape = shapes.get(key)
            if shape is None:
                raise ValueError(f"update_weights: unknown weight {name!r} (expected HF "
                                 f"names such as {next(iter(shapes))!r})")
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
