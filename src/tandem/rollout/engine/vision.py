"""The vision side of the native engine, for Qwen2-VL-family models (docs/engine.md,
"Images"): a request's images become the vision tower's embeddings at their `<|image_pad|>`
tokens, its prompt gets Qwen2-VL's 3-D rotary positions, and its image tokens prefix-cache keys
of the image's content.

`VisionTower.prepare` reads a request's images with the model's image processor, checks them
against the prompt's runs of image tokens (one run per image, of its token count) and computes
the prompt's positions with the model's own `get_rope_index`; the tower runs once per sequence,
at the first step that computes one of its image tokens (`VisionTower.embed`), all its images
in one call. `step_vision` gives a step's per-token 3-D positions and the embedding rows that
replace the image tokens' own. After the prompt, every position is the token's index plus the
prompt's shift (`delta`), the same on all three axes, as in HF's generation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tandem.multimodal import (VISION_FAMILIES, ImageInputs, image_runs, image_types,
                               process_images, requested_images)


@dataclass
class SequenceImages:
    """A prompt's images inside the engine: their inputs, the (start, length) of each one's
    tokens, the prompt's positions [3, P], the shift after it, and the tower's embeddings
    [image tokens, hidden] once computed."""

    inputs: ImageInputs
    spans: list[tuple[int, int]]
    positions: torch.Tensor
    delta: int
    embeds: torch.Tensor | None = None
    keys: dict[int, tuple[bytes, int]] = field(default_factory=dict)  # prompt index -> key

    def __post_init__(self) -> None:
        for (start, length), digest in zip(self.spans, self.inputs.digests):
            for offset in range(length):
                self.keys[start + offset] = (digest, offset)

    def positions_of(self, start: int, end: int) -> list[list[int]]:
        """The (t, h, w) positions of tokens [start, end), as three lists."""
        prompt = self.positions.shape[1]
        inside = self.positions[:, start:min(end, prompt)].tolist()
        after = list(range(max(start, prompt) + self.delta, end + self.delta))
        return [axis + after for axis in inside]

    def key_tokens(self, tokens: list[int], start: int) -> tuple:
        """The prefix-cache key of tokens[start:...]: an image token is its image's digest and
        its place in the image (two images never share a block; the same image always can)."""
        return tuple(self.keys.get(start + offset, token) for offset, token in enumerate(tokens))

    def rows(self, start: int, end: int) -> list[tuple[int, torch.Tensor]]:
        """(offset from start, embedding rows) of the image tokens among [start, end)."""
        found, row = [], 0
        for span_start, length in self.spans:
            low, high = max(start, span_start), min(end, span_start + length)
            if low < high:
                found.append((low - start, self.embeds[row + low - span_start:
                                                       row + high - span_start]))
            row += length
        return found

    def overlaps(self, start: int, end: int) -> bool:
        return any(s < end and start < s + n for s, n in self.spans)


class VisionTower:
    """A Qwen2-VL model's vision tower, image processor and 3-D positions, for the runner."""

    def __init__(self, model: Any, model_path: str | Path) -> None:
        from transformers import AutoImageProcessor

        if model.config.model_type not in VISION_FAMILIES:
            raise NotImplementedError(f"{model.config.model_type}: the native engine serves the "
                                      f"vision-language families {list(VISION_FAMILIES)} (their "
                                      "vision tower and 3-D positions); this one is not built")
        self.model = model.model  # Qwen2VLModel: .visual, get_image_features, get_rope_index
        self.pad_id = model.config.image_token_id
        try:
            self.processor = AutoImageProcessor.from_pretrained(str(model_path))
        except (OSError, ValueError) as error:
            raise ValueError(f"{model_path}: a vision-language model needs its image processor "
                             f"(preprocessor_config.json) beside the weights ({error})") from None

    def prepare(self, request_id: str, prompt: list[int], data: Any) -> SequenceImages:
        """The request's images checked against its prompt's image tokens, processed, with the
        prompt's 3-D positions; a ValueError naming the request and the mismatch."""
        where = f"request {request_id!r}"
        images = requested_images(data, where)
        runs = image_runs(prompt, self.pad_id, len(images), where)
        inputs = process_images(self.processor, images, where)
        for index, ((_, length), count) in enumerate(zip(runs, inputs.token_counts)):
            if length != count:
                raise ValueError(f"{where}: image {index} takes {count} tokens, its run in the "
                                 f"prompt has {length}; expand each <|image_pad|> to its image's "
                                 "count (tandem.multimodal.expand_image_pads)")
        ids = torch.tensor([prompt])
        positions, delta = self.model.get_rope_index(ids, image_types(len(prompt), runs)[None],
                                                     image_grid_thw=inputs.grid_thw)
        return SequenceImages(inputs, runs, positions[:, 0], int(delta.reshape(-1)[0]))

    @torch.inference_mode()
    def embed(self, images: SequenceImages) -> None:
        """Run the tower on the sequence's images once (all of them, one call)."""
        if images.embeds is None:
            device = self.model.visual.device
            output = self.model.get_image_features(images.inputs.pixel_values.to(device),
                                                   images.inputs.grid_thw.to(device))
            images.embeds = torch.cat(list(output.pooler_output))


def step_vision(ordered: list[Any], tower: VisionTower | None
                ) -> tuple[list[list[int]] | None, list[tuple[int, torch.Tensor]] | None]:
    """A step's per-token 3-D positions (None when no scheduled sequence has images: the 1-D
    positions are the same) and the (flat index, rows) of its image tokens' embeddings."""
    if tower is None or all(item.seq.images is None for item in ordered):
        return None, None
    axes: list[list[int]] = [[], [], []]
    rows: list[tuple[int, torch.Tensor]] = []
    flat = 0
    for item in ordered:
        seq, start, end = item.seq, item.start, item.start + item.num_new
        images = seq.images
        if images is None:
            for axis in axes:
                axis.extend(range(start, end))
        else:
            for axis, part in zip(axes, images.positions_of(start, end)):
                axis.extend(part)
            if images.overlaps(start, end):
                tower.embed(images)
                rows.extend((flat + offset, part) for offset, part in images.rows(start, end))
        flat += item.num_new
    return axes, rows
