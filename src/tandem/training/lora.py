"""LoRA on the actor through peft: wrapping, the adapter-only weight stream, the merged model.

Wire format of an adapter stream (what every checkpoint engine carries and every rollout
backend reads: rollout/adapter_stream.py): for each targeted linear `<module>` (its HF name,
e.g. model.layers.0.self_attn.q_proj), `<module>.lora_A.weight` [rank, in] and
`<module>.lora_B.weight` [out, rank] with the scale alpha / rank already folded into B, so the
served weight is `W + B @ A` and a receiver needs no adapter config.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from tandem.config.schema import LoraConfig
from tandem.training.export import iter_full_weights
from tandem.training.fsdp import dp_rank_and_size

ADAPTER = "default"  # peft's name for the one adapter the actor trains
_PEFT_PREFIX = "base_model.model."


# a vision-language model's vision tower (Qwen2.5-VL's MLPs share the decoder's projection
# names): the adapters are the language model's; the engines merge none into the tower
VISION_TOWER_MODULES = r"(.*\.)?visual\..*"


def apply_lora(model: nn.Module, lora: LoraConfig) -> nn.Module:
    """The HF model wrapped by peft with fresh adapters (B = 0, so it still computes the base
    model) on the targeted linears outside a vision tower; only the adapter parameters require
    gradients."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    tower = hasattr(getattr(model, "model", None), "visual")  # peft warns on a pattern unused
    config = PeftLoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                            target_modules=list(lora.target_modules), bias="none",
                            exclude_modules=VISION_TOWER_MODULES if tower else None,
                            task_type="CAUSAL_LM")
    return get_peft_model(model, config, adapter_name=ADAPTER)


def is_lora_model(model: nn.Module) -> bool:
    """Whether `model` is peft-wrapped (FSDP2 keeps the wrapper's class)."""
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


def lora_scale(model: nn.Module) -> float:
    """alpha / rank of the actor's adapter."""
    config = model.peft_config[ADAPTER]
    return config.lora_alpha / config.r


def hf_name(peft_name: str) -> str:
    """The HF name of a peft parameter: no wrapper prefix, no `.base_layer`, no adapter name."""
    name = peft_name.removeprefix(_PEFT_PREFIX)
    return name.replace(".base_layer.", ".").replace(f".{ADAPTER}.", ".")


def iter_adapter_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The adapter stream (module docstring): (`<module>.lora_A.weight`, A) and
    (`<module>.lora_B.weight`, scale x B), full tensors; a collective under FSDP2."""
    scale = lora_scale(model)
    for name, tensor in model.named_parameters():
        if ".lora_A." not in name and ".lora_B." not in name:
            continue
        full = (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach()
        yield hf_name(name), (full * scale if ".lora_B." in name else full)


def adapter_bytes(model: nn.Module) -> int:
    """Bytes of one adapter stream (what a sync moves)."""
    return sum(t.numel() * t.element_size() for n, t in model.named_parameters()
               if ".lora_A." in n or ".lora_B." in n)


def iter_merged_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(hf_name, tensor) of the base model with the adapter merged in (W + B @ A, computed in
    float32), under the names a plain HF model of the base has; the actor is not changed."""
    weights = dict(iter_full_weights(model))
    adapters = dict(iter_adapter_weights(model))
    for name, tensor in weights.items():
        if ".lora_A." in name or ".lora_B." in name:
            continue
        key = hf_name(name)
        module = key.removesuffix(".weight")
        a, b = adapters.get(f"{module}.lora_A.weight"), adapters.get(f"{module}.lora_B.weight")
        if a is not None and b is not None:
            tensor = (tensor.float() + b.float() @ a.float()).to(tensor.dtype)
        yield key, tensor


def save_adapter(model: nn.Module, directory: Path, base_path: str | None = None) -> None:
    """peft's format (adapter_config.json + adapter_model.safetensors, loadable by
    `PeftModel.from_pretrained(base, directory)`); a collective under FSDP2, rank 0 writes."""
    from safetensors.torch import save_file

    scale = lora_scale(model)
    tensors = {_PEFT_PREFIX + name: (tensor / scale if ".lora_B." in name else tensor).contiguous()
               for name, tensor in iter_adapter_weights(model)}
    if dp_rank_and_size()[0] == 0:
        directory.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
        config = copy.copy(model.peft_config[ADAPTER])
        config.base_model_name_or_path = base_path
        config.save_pretrained(str(directory))


def save_merged(model: nn.Module, directory: Path) -> None:
    """The merged model as a plain HF folder (model.safetensors + config.json); a collective
    under FSDP2, rank 0 writes."""
    from safetensors.torch import save_file

    tensors = {name: tensor.contiguous() for name, tensor in iter_merged_weights(model)}
    if dp_rank_and_size()[0] == 0:
        directory.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
        model.get_base_model().config.save_pretrained(str(directory))
