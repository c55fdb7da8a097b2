"""Checkpoints that resume exactly: safetensors weights, optimizer + scheduler state, step, RNG.

Layout of a checkpoint directory:
  model.safetensors   full weights under their HF names (tied aliases stored once) + config.json;
                      a LoRA actor's adapter only (peft's names), next to adapter/ (peft's format)
                      and, with actor.lora.save_merged, merged/ (a plain HF model)
  optimizer.pt        full optimizer state keyed by parameter name, and the lr scheduler state
  trainer_state.json  {"step": int, "extra": {...}}
  rng_rank{r}.pt      each data-parallel rank's torch / python / numpy RNG states
  manifest.json       size and sha256 of every file above, written last (atomically)
Rank 0 writes the shared files; every rank reads them whole and keeps its own shard. Loading
verifies the manifest first, so a torn, truncated or overwritten file (or a save that never
finished) is an error naming the file, never NaN weights; weights that are not finite are
refused on save. A run's `latest` pointer is replaced atomically (write_latest).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

from tandem.training.export import named_weights
from tandem.training.fsdp import all_reduce, dp_rank_and_size
from tandem.training.lora import is_lora_model

_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
MANIFEST = "manifest.json"
STATE = "trainer_state.json"
FULL_BYTES = 1 << 20  # a write that fails with less free than this ran out of space


class CheckpointError(ValueError):
    """A checkpoint file is missing, incomplete, corrupt or holds non-finite weights; the
    message names the file."""


def save_checkpoint(directory: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                    scheduler: Any | None, step: int, extra: dict[str, Any] | None = None) -> Path:
    """Write a checkpoint (collective under FSDP: every rank must call it). Non-finite weights
    raise CheckpointError before anything is written."""
    directory = Path(directory)
    rank, _ = dp_rank_and_size()
    _check_finite_weights(model, directory)
    weights = get_model_state_dict(model, options=_FULL)
    optimizer_state = get_optimizer_state_dict(model, optimizer, options=_FULL) if optimizer else None
    if rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
        with full_disk_named(directory):
            (directory / MANIFEST).unlink(missing_ok=True)  # until the new one: incomplete
            names = checkpointed_names(model)
            save_file({name: weights[name].contiguous() for name in names},
                      str(directory / "model.safetensors"), metadata={"format": "pt"})
            config = getattr(model, "config", None)
            if config is not None:
                config.save_pretrained(directory)
            if optimizer is not None:
                torch.save({"optimizer": optimizer_state,
                            "scheduler": scheduler.state_dict() if scheduler is not None else None},
                           directory / "optimizer.pt")
            (directory / STATE).write_text(json.dumps({"step": step, "extra": extra or {}}))
    if dist.is_initialized():
        dist.barrier()  # the directory exists before ranks > 0 write their RNG files
    with full_disk_named(directory):
        torch.save(_rng_state(), directory / f"rng_rank{rank}.pt")
    if dist.is_initialized():
        dist.barrier()  # every RNG file is written before the manifest lists them
    if rank == 0:
        with full_disk_named(directory):
            write_manifest(directory)
    if dist.is_initialized():
        dist.barrier()  # no rank returns before the checkpoint is complete
    return directory


def checkpointed_names(model: torch.nn.Module) -> list[str]:
    """The weights a checkpoint holds: all of them, or a LoRA actor's adapter only (its frozen
    base is model.path)."""
    names = [name for name, _ in named_weights(model)]
    return [name for name in names if ".lora_" in name] if is_lora_model(model) else names


def load_checkpoint(directory: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                    scheduler: Any | None) -> dict[str, Any]:
    """Verify, then restore what save_checkpoint wrote; returns {"step": ..., "extra": ...}.

    Every file this rank reads is checked against the manifest first; a missing RNG file is an
    error (resuming without it would not replay the run exactly)."""
    directory = Path(directory)
    if not (directory / STATE).exists():
        raise FileNotFoundError(f"load_checkpoint: {directory} is not a tandem checkpoint "
                                f"(no {STATE}); point trainer.resume at a saved step directory")
    rank, _ = dp_rank_and_size()
    rng_name = f"rng_rank{rank}.pt"
    verify_manifest(directory, ["model.safetensors", STATE, rng_name]
                    + (["optimizer.pt"] if optimizer is not None else []))
    weights = _read(directory / "model.safetensors", lambda path: load_file(str(path)))
    expected = set(checkpointed_names(model))
    if set(weights) != expected:
        missing, unexpected = sorted(expected - set(weights))[:5], sorted(set(weights) - expected)[:5]
        raise CheckpointError(f"load_checkpoint: weights in {directory / 'model.safetensors'} do "
                              f"not match the model: missing {missing}, unexpected {unexpected}")
    shapes = {name: tuple(tensor.shape) for name, tensor in named_weights(model) if name in expected}
    wrong = [f"{name} {tuple(weights[name].shape)} (model {shapes[name]})" for name in sorted(shapes)
             if tuple(weights[name].shape) != shapes[name]]
    if wrong:
        raise CheckpointError(f"load_checkpoint: {directory / 'model.safetensors'} holds weights "
                              f"of another model: {', '.join(wrong[:3])}"
                              f"{f' and {len(wrong) - 3} more' if len(wrong) > 3 else ''}; "
                              "resume with the model it was trained from")
    bad = [name for name, tensor in weights.items() if not bool(torch.isfinite(tensor).all())]
    if bad:
        raise CheckpointError(f"{directory / 'model.safetensors'}: non-finite values in {bad[:5]}")
    # strict=False: tied aliases (lm_head.weight) are stored once, under the name they share
    set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True, strict=False))
    if optimizer is not None:
        saved = _read(directory / "optimizer.pt", lambda path: torch.load(path, weights_only=False))
        set_optimizer_state_dict(model, optimizer, saved["optimizer"],
                                 options=StateDictOptions(full_state_dict=True))
        if scheduler is not None and saved["scheduler"] is not None:
            scheduler.load_state_dict(saved["scheduler"])
    _set_rng_state(_read(directory / rng_name, lambda path: torch.load(path, weights_only=False)))
    return _read(directory / STATE, lambda path: json.loads(path.read_text()))


# -- integrity: manifests, atomic writes, the `latest` pointer --------------------------------

def write_manifest(directory: str | Path) -> None:
    """List size and sha256 of every file in `directory` (not its subdirectories) in
    manifest.json, written atomically: it exists only once the checkpoint is complete."""
    directory = Path(directory)
    files = {path.name: {"bytes": path.stat().st_size, "sha256": _sha256(path)}
             for path in sorted(directory.iterdir())
             if path.is_file() and path.name != MANIFEST and not path.name.startswith(".")}
    atomic_write_text(directory / MANIFEST, json.dumps({"files": files}, indent=1))


def verify_manifest(directory: str | Path, names: list[str]) -> None:
    """Raise CheckpointError naming the first of `names` that the manifest does not list, or
    that is missing, of another size or of another sha256 than listed."""
    directory = Path(directory)
    manifest_path = directory / MANIFEST
    if not manifest_path.exists():
        raise CheckpointError(f"{manifest_path} is missing: the save of {directory} did not finish "
                              "(or predates checksums); resume from an earlier complete step")
    listed = _read(manifest_path, lambda path: json.loads(path.read_text())["files"])
    for name in names:
        path = directory / name
        if name not in listed:
            raise CheckpointError(f"{path}: not part of this checkpoint (its manifest lists "
                                  f"{sorted(listed)}); it was saved with another number of ranks "
                                  "or without this role")
        if not path.exists():
            raise CheckpointError(f"{path} is missing; restore it or resume from another step")
        if path.stat().st_size != listed[name]["bytes"] or _sha256(path) != listed[name]["sha256"]:
            raise CheckpointError(f"{path} is corrupt: its size or sha256 differs from {MANIFEST}"
                                  " (overwritten or truncated); resume from another step")


def save_trainer_state(directory: str | Path, state: dict[str, Any]) -> None:
    """The driver's own trainer_state.json in a step directory, and that directory's manifest."""
    directory = Path(directory)
    with full_disk_named(directory):
        (directory / STATE).write_text(json.dumps(state))
        write_manifest(directory)


@contextmanager
def full_disk_named(directory: Path) -> Iterator[None]:
    """Writes into a checkpoint `directory`: a disk that fills up is a CheckpointError that says
    so and names the directory (torch reports it as "unexpected pos", safetensors as an I/O
    error); `latest` still points at the previous complete step."""
    try:
        yield
    except Exception as error:
        free = shutil.disk_usage(directory).free if directory.exists() else None
        chain = [error, *_causes(error)]
        no_space = any(getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT)
                       or "no space left" in str(e).lower() for e in chain)
        if not no_space and not (free is not None and free < FULL_BYTES):
            raise
        raise CheckpointError(f"{directory}: no space left on device while saving the checkpoint "
                              f"({'?' if free is None else free >> 20} MiB free; "
                              f"{type(error).__name__}: {error}); free space there, or set "
                              "trainer.output_dir to a disk with room. The previous checkpoint "
                              "stays the latest") from error


def _causes(error: BaseException) -> Iterator[BaseException]:
    while error.__cause__ or error.__context__:
        error = error.__cause__ or error.__context__
        yield error


def load_trainer_state(directory: str | Path) -> dict[str, Any]:
    """What save_trainer_state wrote, verified against the manifest."""
    directory = Path(directory)
    verify_manifest(directory, [STATE])
    return _read(directory / STATE, lambda path: json.loads(path.read_text()))


def atomic_write_text(path: str | Path, text: str) -> None:
    """Replace `path` by `text` all at once: a crash leaves the old content or the new, never a
    torn file (temp file in the same directory, fsync, os.replace, fsync of the directory)."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.tmp")
    with open(temporary, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def write_latest(checkpoints_dir: str | Path, step: int) -> None:
    """Point `checkpoints_dir/latest` at step_<step>, atomically."""
    atomic_write_text(Path(checkpoints_dir) / "latest", str(step))


def read_latest(checkpoints_dir: str | Path) -> int | None:
    """The step `latest` points at; None when no checkpoint was saved."""
    path = Path(checkpoints_dir) / "latest"
    if not path.exists():
        return None
    text = path.read_text().strip()
    if not text.isdigit():
        raise CheckpointError(f"{path} holds {text!r}, not a step number; write the step of an "
                              f"intact checkpoint into it (steps saved: {_saved_steps(path.parent)})")
    return int(text)


def _saved_steps(checkpoints_dir: Path) -> list[int]:
    names = [p.name.removeprefix("step_") for p in checkpoints_dir.glob("step_*")]
    return sorted(int(n) for n in names if n.isdigit())


def _sha256(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _read(path: Path, reader: Callable[[Path], Any]) -> Any:
    """reader(path), with the file's name in any error it raises."""
    try:
        return reader(path)
    except Exception as error:
        raise CheckpointError(f"{path} cannot be read: {type(error).__name__}: {error}") from error


def _check_finite_weights(model: torch.nn.Module, directory: Path) -> None:
    """Refuse to save NaN/inf weights (collective: every rank checks its shards)."""
    bad = [name for name, tensor in named_weights(model)
           if not bool(torch.isfinite(tensor.to_local() if hasattr(tensor, "to_local")
                                      else tensor).all())]
    if all_reduce([float(len(bad))])[0]:
        raise CheckpointError(f"{directory}: not saved, the weights hold non-finite values "
                              f"({bad[:5] or 'on another rank'}); the previous checkpoint stays "
                              "the latest")


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
