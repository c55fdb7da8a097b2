"""The vision example's data (`tandem make-data DIR --kind colours`, examples/colours.yaml):
pictures of one colour with pixel noise, each asked "What colour is it?", scored by the
`colour_name` reward; train and val rows as JSONL beside their PNG files."""

from __future__ import annotations

import json
import random
from pathlib import Path

from tandem.models.tiny_vl import COLOURS, QUESTION, colour_picture


def make_colour_datasets(directory: Path, train_size: int = 96, val_size: int = 24,
                         seed: int = 7) -> tuple[Path, Path]:
    """Write train.jsonl and val.jsonl (colours in turn) and their pictures under `directory`."""
    (directory / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    paths = []
    for split, size in (("train", train_size), ("val", val_size)):
        rows = []
        for index in range(size):
            colour = list(COLOURS)[index % len(COLOURS)]
            name = f"images/{split}{index}.png"
            colour_picture(colour, rng).save(directory / name)
            rows.append({"prompt": [{"role": "user", "content": f"<image>{QUESTION}"}],
                         "images": [name], "data_source": "colour_name",
                         "reward_model": {"ground_truth": colour}})
        path = directory / f"{split}.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        paths.append(path)
    return paths[0], paths[1]
