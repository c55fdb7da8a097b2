"""Serving a LoRA adapter: merge it into a working copy of the targeted linears, base kept.

An adapter stream (training/lora.py's wire format: `<module>.lora_A.weight` [rank, in] and
`<module>.lora_B.weight` [out, rank], the scale folded into B) is staged as whole merged
weights `W_base + B @ A` (float32 sums, then the engine dtype, packed where the linear is),
so it swaps in through the engine's usual all-or-nothing commit and decoding runs at full
speed. The base of every module ever merged is kept on the host (`LoraState.base`), so the
next adapter merges against the base, never against the last merge, and a module the new
adapter leaves out returns to its base weight. Why merge, not LoRA in the linears:
docs/engine.md, "LoRA".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import torch

from tandem.rollout.engine.weight_staging import all_finite

SUFFIXES = (".lora_A.weight", ".lora_B.weight")


def is_adapter_name(name: str) -> bool:
    """Whether `name` is a tensor of an adapter stream."""
    return name.endswith(SUFFIXES)


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


@dataclass
class StagedAdapter:
    """A checked adapter ready to commit: the stage_form of every weight to swap, the base
    copies taken now (modules merged for the first time) and the adapter tensors."""

    weights: dict[str, torch.Tensor]
    new_base: dict[str, torch.Tensor]
    adapter: dict[str, torch.Tensor]


def _read_pairs(named_tensors: Iterable[tuple[str, torch.Tensor]]
                ) -> dict[str, dict[str, torch.Tensor]]:
    """module -> {"A": ..., "B": ...}, host copies (a transport may reuse its buffers)."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in named_tensors:
        if not is_adapter_name(name):
            raise ValueError(f"update_weights: {name!r} in an adapter stream; an update holds "
                             "either adapter tensors (lora_A / lora_B) or model weights")
        if not tensor.is_floating_point():
            raise TypeError(f"update_weights: adapter tensor {name!r} has dtype {tensor.dtype}")
        copy = tensor.detach().to("cpu", copy=True)
        if not all_finite(copy):
            raise ValueError(f"update_weights: adapter tensor {name!r} holds NaN or inf values")
        module, kind = name.rsplit(".lora_", 1)
        pairs.setdefault(module, {})[kind[0]] = copy
    return pairs


def stage_adapter(runner: Any, shapes: Mapping[str, torch.Size],
                  named_tensors: Iterable[tuple[str, torch.Tensor]], state: LoraState
                  ) -> StagedAdapter:
    """Check the whole adapter stream and merge it (module docstring); the engine is not
    touched, so any error leaves the previous adapter serving."""
    staged, new_base, adapter = {}, {}, {}
    with torch.no_grad():
        for module, pair in _read_pairs(named_tensors).items():
            key = f"{module}.weight"
            if key not in shapes or len(shapes[key]) != 2:
                raise ValueError(f"update_weights: the adapter targets {module!r}, which is not a "
                                 "linear layer of this model")
            if set(pair) != {"A", "B"}:
                raise ValueError(f"update_weights: the adapter of {module!r} lacks "
                                 f"lora_{'B' if 'A' in pair else 'A'}.weight")
            a, b = pair["A"], pair["B"]
            out_features, in_features = shapes[key]
            if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_features or \
                    b.shape[0] != out_features or a.shape[0] != b.shape[1]:
                raise ValueError(f"update_weights: the adapter of {module!r} has A "
                                 f"{tuple(a.shape)} and B {tuple(b.shape)}; the linear is "
                                 f"[{out_features}, {in_features}], so A must be [rank, "
                                 f"{in_features}] and B [{out_features}, rank]")
            base = state.base.get(key)
            if base is None:  # served unmerged until now: what it serves is the base
                base = new_base[key] = runner.dense_weight(key).to("cpu", copy=True)
            merged = (base.float() + b.float() @ a.float()).to(runner.dtype)
            if not all_finite(merged):
                raise ValueError(f"update_weights: merging the adapter into {key!r} gives NaN "
                                 "or inf values")
            staged[key] = runner.stage_form(key, merged)
            adapter[f"{module}.lora_A.weight"], adapter[f"{module}.lora_B.weight"] = a, b
        for key in state.merged_keys() - set(staged):  # left out by this adapter: back to base
            staged[key] = runner.stage_form(key, state.base[key].clone())
    return StagedAdapter(staged, new_base, adapter)
