"""Rollout record and replay (trainer.debug): one step's scored trajectories to and from
`step_<k>.pt` in a folder, tensors as tensors and the rest as JSON text, read back with
`torch.load(weights_only=True)` (no pickled code runs)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from tandem.batch.trajectory import Trajectory
from tandem.multimodal import ImageInputs
from tandem.types import KeptSets

FORMAT = 1
JSON_FIELDS = ("reward_extra", "ground_truth", "metadata")


def step_file(folder: str | Path, step: int) -> Path:
    """Where step `step` (1-based, the version the step trains to) is kept."""
    return Path(folder) / f"step_{step:06d}.pt"


def save_rollouts(folder: str | Path, step: int, trajectories: list[Trajectory]) -> Path:
    """Write one step's trajectories (rewards included) atomically; returns the file."""
    records = []
    for trajectory in trajectories:
        record = dataclasses.asdict(trajectory)
        for name in JSON_FIELDS:
            record[name] = json.dumps(record[name], default=str)
        records.append(record)
    path = step_file(folder, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    torch.save({"format": FORMAT, "step": step, "trajectories": records}, partial)
    partial.replace(path)
    return path


def load_rollouts(folder: str | Path, step: int) -> list[Trajectory]:
    """The trajectories save_rollouts wrote for `step`; FileNotFoundError naming the file and
    the field when that run had no such step."""
    path = step_file(folder, step)
    if not path.is_file():
        raise FileNotFoundError(f"trainer.debug.load_rollouts: {path} does not exist; the run that "
                                f"saved {folder} stopped before step {step} (lower "
                                "trainer.total_steps or save more steps)")
    saved = torch.load(path, weights_only=True)
    if saved.get("format") != FORMAT or saved.get("step") != step:
        raise ValueError(f"trainer.debug.load_rollouts: {path} is not step {step} in format "
                         f"{FORMAT} (it says step {saved.get('step')}, format {saved.get('format')})")
    trajectories = []
    for record in saved["trajectories"]:
        for name in JSON_FIELDS:
            record[name] = json.loads(record[name])
        if record.get("kept_sets") is not None:  # asdict wrote the record as a dict of tensors
            record["kept_sets"] = KeptSets(**record["kept_sets"])
        if record.get("images") is not None:  # a vision-language run's pixel values and grids
            record["images"] = ImageInputs(**record["images"])
        trajectories.append(Trajectory(**record))
    return trajectories
