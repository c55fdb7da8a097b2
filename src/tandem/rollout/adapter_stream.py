"""Reading an adapter-only weight stream, for every backend that serves LoRA.

The wire format is training/lora.py's: for each targeted linear `<module>` (HF name),
`<module>.lora_A.weight` [rank, in] and `<module>.lora_B.weight` [out, rank], the scale
alpha / rank folded into B, so the served weight is `W + B @ A`. The native engine merges it
(engine/lora_merge.py); vLLM and SGLang load it from a folder in peft's format
(`write_peft_adapter`, alpha = rank so peft's scale is 1).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Iterable, Iterator, Mapping

import torch

from tandem.rollout.base import all_finite

SUFFIXES = (".lora_A.weight", ".lora_B.weight")
PEFT_PREFIX = "base_model.model."


def is_adapter_name(name: str) -> bool:
    """Whether `name` is a tensor of an adapter stream."""
    return name.endswith(SUFFIXES)


def peek_stream(named_tensors: Iterable[tuple[str, torch.Tensor]]
                ) -> tuple[bool, Iterator[tuple[str, torch.Tensor]] | None]:
    """(whether the stream is an adapter stream, the whole stream; None when it is empty): its
    first name decides, and nothing is consumed."""
    stream = iter(named_tensors)
    first = next(stream, None)
    if first is None:
        return False, None
    return is_adapter_name(first[0]), itertools.chain([first], stream)


def read_adapter(named_tensors: Iterable[tuple[str, torch.Tensor]],
                 shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """module -> (A, B), host copies (a transport may reuse its buffers), every pair checked
    against the linear `<module>.weight` of `shapes` [out, in]; any fault raises before the
    caller touches its engine (ValueError / TypeError naming the tensor)."""
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
    checked = {}
    for module, pair in pairs.items():
        shape = shapes.get(f"{module}.weight")
        if shape is None or len(shape) != 2:
            raise ValueError(f"update_weights: the adapter targets {module!r}, which is not a "
                             "linear layer of this model")
        if set(pair) != {"A", "B"}:
            raise ValueError(f"update_weights: the adapter of {module!r} lacks "
                             f"lora_{'B' if 'A' in pair else 'A'}.weight")
        a, b = pair["A"], pair["B"]
        out_features, in_features = shape
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_features or \
                b.shape[0] != out_features or a.shape[0] != b.shape[1]:
            raise ValueError(f"update_weights: the adapter of {module!r} has A {tuple(a.shape)} "
                             f"and B {tuple(b.shape)}; the linear is [{out_features}, "
                             f"{in_features}], so A must be [rank, {in_features}] and B "
                             f"[{out_features}, rank]")
        checked[module] = (a, b)
    if not checked:
        raise ValueError("update_weights: the adapter stream held no tensor")
    return checked


def write_peft_adapter(adapter: Mapping[str, tuple[torch.Tensor, torch.Tensor]], directory: Path,
                       base_path: str, max_rank: int) -> None:
    """`adapter` (read_adapter's) as a peft LoRA folder: adapter_model.safetensors +
    adapter_config.json with lora_alpha = r (the scale is already in B)."""
    from safetensors.torch import save_file

    ranks = {a.shape[0] for a, _ in adapter.values()}
    if len(ranks) != 1 or next(iter(ranks)) > max_rank:
        raise ValueError(f"update_weights: adapter ranks {sorted(ranks)}; the engine was started "
                         f"for one rank of at most {max_rank} (rollout.lora_rank, from "
                         "actor.lora.rank)")
    rank = ranks.pop()
    tensors = {}
    for module, (a, b) in adapter.items():
        tensors[f"{PEFT_PREFIX}{module}.lora_A.weight"] = a.contiguous()
        tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"] = b.contiguous()
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
    targets = sorted({module.rsplit(".", 1)[-1] for module in adapter})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": rank,
              "lora_dropout": 0.0, "bias": "none", "target_modules": targets,
              "base_model_name_or_path": base_path}
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=1))
