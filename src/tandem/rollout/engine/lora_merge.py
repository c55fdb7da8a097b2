"""Serving a LoRA adapter: merge it into a working copy of the targeted linears, base kept
(docs/engine.md, "LoRA"). An adapter stream is staged as whole merged weights `W_base + B @ A`
(float32 sums, then the engine dtype, packed where the linear is), so it swaps in through the
engine's all-or-nothing commit and decodes at full speed. The base of every module ever merged is
kept on the host (`LoraState.base`): the next adapter merges against it, never against the last
merge, and a module it leaves out returns to its base. A tensor-parallel replica does this per
rank: each keeps the base of its own slices and merges its slices of A and B
(weight_staging.stage_adapter_shards)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import torch

from tandem.rollout.adapter_stream import is_adapter_name, read_adapter
from tandem.rollout.base import all_finite

__all__ = ["LoraState", "StagedAdapter", "adapter_tensors", "is_adapter_name", "merge_adapter",
           "stage_adapter"]


@dataclass
class LoraState:
    """What the engine serves of an adapter: base copies of the merged modules and the adapter
    tensors as received (a delta sync applies its changes to those)."""

    base: dict[str, torch.Tensor] = field(default_factory=dict)  # "<module>.weight" -> base
    adapter: dict[str, torch.Tensor] = field(default_factory=dict)  # wire name -> tensor

    def merged_keys(self) -> set[str]:
        return {name.rsplit(".lora_", 1)[0] + ".weight" for name in self.adapter}

    def drop(self, keys: Iterable[str]) -> None:
        """Forget the base and the adapter of weights that model weights just replaced."""
        for key in keys:
            self.base.pop(key, None)
        self.adapter = {name: tensor for name, tensor in self.adapter.items()
                        if name.rsplit(".lora_", 1)[0] + ".weight" in self.base}

    def record(self, installed: "StagedAdapter | Mapping[str, Any]") -> None:
        """After a commit: a merged adapter's new base copies and tensors, or model weights
        (their own new base)."""
        if isinstance(installed, StagedAdapter):
            self.base.update(installed.new_base)
            self.adapter = installed.adapter
        else:
            self.drop(installed)


@dataclass
class StagedAdapter:
    """A checked adapter ready to commit: the stage_form of every weight to swap, the base
    copies taken now (modules merged for the first time) and the adapter tensors."""

    weights: dict[str, torch.Tensor]
    new_base: dict[str, torch.Tensor]
    adapter: dict[str, torch.Tensor]


def adapter_tensors(pairs: Mapping[str, tuple[torch.Tensor, torch.Tensor]]
                    ) -> dict[str, torch.Tensor]:
    """module -> (A, B) as the wire names them (`<module>.lora_A.weight`, `.lora_B.weight`)."""
    named = {}
    for module, (a, b) in pairs.items():
        named[f"{module}.lora_A.weight"], named[f"{module}.lora_B.weight"] = a, b
    return named


def stage_adapter(runner: Any, shapes: Mapping[str, torch.Size],
                  named_tensors: Iterable[tuple[str, torch.Tensor]], state: LoraState
                  ) -> StagedAdapter:
    """Check the whole adapter stream against `shapes` and merge it (merge_adapter); the engine
    is not touched, so any error leaves the previous adapter serving."""
    return merge_adapter(runner, read_adapter(named_tensors, shapes), state)


def merge_adapter(runner: Any, pairs: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
                  state: LoraState) -> StagedAdapter:
    """Stage W_base + B @ A for every checked pair (module docstring), and the base of every
    module `state` merged before but `pairs` leaves out; with tensor parallelism W, A and B are
    this rank's slices."""
    staged, new_base = {}, {}
    with torch.no_grad():
        for module, (a, b) in pairs.items():
            key = f"{module}.weight"
            base = state.base.get(key)
            if base is None:  # served unmerged until now: what it serves is the base
                base = new_base[key] = runner.dense_weight(key).to("cpu", copy=True)
            merged = (base.float() + b.float() @ a.float()).to(runner.dtype)
            if not all_finite(merged):
                raise ValueError(f"update_weights: merging the adapter into {key!r} gives NaN "
                                 "or inf values")
            staged[key] = runner.stage_form(key, merged)
        for key in state.merged_keys() - set(staged):  # left out by this adapter: back to base
            staged[key] = runner.stage_form(key, state.base[key].clone())
    return StagedAdapter(staged, new_base, adapter_tensors(pairs))
