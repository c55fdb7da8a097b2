"""Checkpoints that resume exactly: safetensors weights, optimizer + scheduler state, step, RNG.

Layout of a checkpoint directory:
  model.safetensors   full weights under their HF names (tied aliases stored once) + config.json
  optimizer.pt        full optimizer state keyed by parameter name, and the lr scheduler state
  trainer_state.json  {"step": int, "extra": {...}}
  rng_rank{r}.pt      each data-parallel rank's torch / python / numpy RNG states
Rank 0 writes the shared files; every rank reads them whole and keeps its own shard.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

from tandem.training.export import named_weights
from tandem.training.fsdp import dp_rank_and_size

_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def save_checkpoint(directory: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                    scheduler: Any | None, step: int, extra: dict[str, Any] | None = None) -> Path:
    """Write a checkpoint (collective under FSDP: every rank must call it)."""
    directory = Path(directory)
    rank, _ = dp_rank_and_size()
    weights = get_model_state_dict(model, options=_FULL)
    optimizer_state = get_optimizer_state_dict(model, optimizer, options=_FULL) if optimizer else None
    if rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
        names = [name for name, _ in named_weights(model)]
        save_file({name: weights[name].contiguous() for name in names}, str(directory / "model.safetensors"),
                  metadata={"format": "pt"})
        config = getattr(model, "config", None)
        if config is not None:
            config.save_pretrained(directory)
        if optimizer is not None:
            torch.save({"optimizer": optimizer_state,
                        "scheduler": scheduler.state_dict() if scheduler is not None else None},
                       directory / "optimizer.pt")
        (directory / "trainer_state.json").write_text(json.dumps({"step": step, "extra": extra or {}}))
    if dist.is_initialized():
        dist.barrier()  # the directory exists before ranks > 0 write their RNG files
    torch.save(_rng_state(), directory / f"rng_rank{rank}.pt")
    return directory


def load_checkpoint(directory: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                    scheduler: Any | None) -> dict[str, Any]:
    """Restore what save_checkpoint wrote; returns {"step": ..., "extra": ...}."""
    directory = Path(directory)
    if not (directory / "trainer_state.json").exists():
        raise FileNotFoundError(f"load_checkpoint: {directory} is not a tandem checkpoint "
                                "(no trainer_state.json); point trainer.resume at a saved step directory")
    rank, _ = dp_rank_and_size()
    weights = load_file(str(directory / "model.safetensors"))
    expected = {name for name, _ in named_weights(model)}
    if set(weights) != expected:
        missing, unexpected = sorted(expected - set(weights))[:5], sorted(set(weights) - expected)[:5]
        raise ValueError(f"load_checkpoint: weights in {directory} do not match the model: missing "
                         f"{missing}, unexpected {unexpected}")
    # strict=False: tied aliases (lm_head.weight) are stored once, under the name they share
    set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True, strict=False))
    if optimizer is not None:
        saved = torch.load(directory / "optimizer.pt", weights_only=False)
        set_optimizer_state_dict(model, optimizer, saved["optimizer"],
                                 options=StateDictOptions(full_state_dict=True))
        if scheduler is not None and saved["scheduler"] is not None:
            scheduler.load_state_dict(saved["scheduler"])
    rng_file = directory / f"rng_rank{rank}.pt"
    if rng_file.exists():
        _set_rng_state(torch.load(rng_file, weights_only=False))
    return json.loads((directory / "trainer_state.json").read_text())


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
