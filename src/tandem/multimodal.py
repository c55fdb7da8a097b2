"""Images for vision-language policies (the Qwen2-VL family), shared by the engine, the data
path and the batches: reading an image, the model's image processor's pixel values and grids,
each image's token count and content digest, and Qwen2-VL's `<|image_pad|>` expansion.

A prompt carries each image as a run of `<|image_pad|>` tokens, one per merged patch
(grid_t x grid_h x grid_w / merge_size^2), exactly as Qwen2-VL's processor expands it; a
GenerateRequest's `multi_modal_data` is `{"image": [image, ...]}` in the order of those runs,
each image a PIL image, encoded bytes (PNG, JPEG, ...), a file path, or an HF datasets Image
dict ({"bytes": ..., "path": ...}).
"""

from __future__ import annotations

import hashlib
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:  # torch is imported where tensors are made: the load-time checks stay torch-free
    import torch

IMAGE_PAD = "<|image_pad|>"  # Qwen2-VL's image token: one per merged patch of an image
VISION_FAMILIES = ("qwen2_vl", "qwen2_5_vl")  # the model_types tandem serves and trains

# Larger images are refused when read (a decompression bomb, or a row that would fill the
# context): the processor scales every image down to max_pixels anyway.
MAX_IMAGE_PIXELS = 64 * 1024 * 1024


def is_vision_model(model_path: str | Path) -> bool:
    """Whether the HF model directory holds a vision-language model (its config.json has a
    vision_config); reads the JSON only."""
    return vision_model_type(model_path) is not None


def vision_model_type(model_path: str | Path) -> str | None:
    """A vision-language model's model_type (config.json with a vision_config), else None."""
    config = Path(model_path) / "config.json"
    if not config.is_file():
        return None
    fields = json.loads(config.read_text())
    return str(fields.get("model_type")) if "vision_config" in fields else None


def image_processor_of(model_path: str | Path) -> Any:
    """A vision-language model's image processor (AutoImageProcessor), None for a text model."""
    if not is_vision_model(model_path):
        return None
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(str(model_path))


def load_image(item: Any, where: str) -> Any:
    """`item` as an RGB PIL image; a ValueError naming `where` (the request, or file and row)
    when it is not an image, cannot be read, or is larger than MAX_IMAGE_PIXELS."""
    from PIL import Image

    if isinstance(item, dict):
        item = item.get("bytes") or item.get("path")
    try:
        if isinstance(item, Image.Image):
            image = item
        elif isinstance(item, (bytes, bytearray)):
            image = Image.open(io.BytesIO(item))
        elif isinstance(item, (str, Path)):
            image = Image.open(item)
        else:
            raise ValueError(f"{type(item).__name__} is not an image (give a PIL image, encoded "
                             "bytes, a file path or a datasets Image dict)")
        if image.width * image.height > MAX_IMAGE_PIXELS:
            raise ValueError(f"{image.width} x {image.height} pixels is more than "
                             f"{MAX_IMAGE_PIXELS} (MAX_IMAGE_PIXELS); scale it down")
        return image.convert("RGB")
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None
    except (OSError, Image.DecompressionBombError) as error:
        raise ValueError(f"{where}: not a readable image ({error})") from None


@dataclass
class ImageInputs:
    """A prompt's images as the vision tower takes them: pixel values [patches, C*T*P*P] of all
    images, each image's grid [n, 3] (t, h, w in patches), token count and content digest."""

    pixel_values: torch.Tensor
    grid_thw: torch.Tensor
    token_counts: list[int]
    digests: list[bytes]


def process_images(processor: Any, images: Sequence[Any], where: str) -> ImageInputs:
    """Read `images` and run the model's image processor on them (one image processor call)."""
    loaded = [load_image(image, f"{where}, image {index}") for index, image in enumerate(images)]
    out = processor(images=loaded, return_tensors="pt")
    pixel_values, grid = out["pixel_values"], out["image_grid_thw"]
    merge = processor.merge_size
    counts = [int(t * h * w) // merge ** 2 for t, h, w in grid.tolist()]
    digests, start = [], 0
    for (t, h, w), count in zip(grid.tolist(), counts):
        patches = pixel_values[start:start + t * h * w]
        start += t * h * w
        digest = hashlib.sha256(str((t, h, w)).encode())
        digest.update(patches.contiguous().numpy().tobytes())
        digests.append(digest.digest())
    return ImageInputs(pixel_values, grid, counts, digests)


def join_inputs(first: ImageInputs | None, then: ImageInputs) -> ImageInputs:
    """One sequence's images: `first`'s, then `then`'s (a tool turn's), in that order."""
    import torch

    if first is None:
        return then
    return ImageInputs(torch.cat([first.pixel_values, then.pixel_values]),
                       torch.cat([first.grid_thw, then.grid_thw]),
                       first.token_counts + then.token_counts, first.digests + then.digests)


def pad_runs(token_ids: Sequence[int], pad_id: int) -> list[tuple[int, int]]:
    """(start, length) of each run of `pad_id` in `token_ids`."""
    runs: list[tuple[int, int]] = []
    for index, token in enumerate(token_ids):
        if token != pad_id:
            continue
        if runs and runs[-1][0] + runs[-1][1] == index:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((index, 1))
    return runs


def image_runs(token_ids: Sequence[int], pad_id: int, images: int, where: str
               ) -> list[tuple[int, int]]:
    """(start, length) of the runs of `pad_id` that hold the `images` images: the first ones.
    A later `pad_id` is a plain token (the policy sampled it: a resumed or multi-turn prompt
    carries the model's own tokens after the images); fewer runs than images is an error."""
    runs = pad_runs(token_ids, pad_id)
    if len(runs) < images:
        raise ValueError(f"{where}: the prompt has {len(runs)} run(s) of image tokens "
                         f"({IMAGE_PAD}) for {images} image(s)")
    return runs[:images]


def requested_images(data: Any, where: str) -> list[Any]:
    """A request's `multi_modal_data` as its list of images (read later); a ValueError naming
    `where` for anything but {"image": image or [images]}."""
    if not isinstance(data, dict) or set(data) - {"image"}:
        raise ValueError(f"{where}: multi_modal_data takes {{'image': [images]}}, not "
                         f"{sorted(data) if isinstance(data, dict) else type(data).__name__}")
    images = data.get("image") or []
    return list(images) if isinstance(images, (list, tuple)) else [images]


def collapse_image_runs(token_ids: Sequence[int], pad_id: int, images: int, where: str
                        ) -> list[int]:
    """The prompt with each of the `images` images' runs of `pad_id` (image_runs) cut to one
    token, what vLLM takes beside the raw images (it expands each run again from its image);
    a later `pad_id` stays as it is."""
    runs = image_runs(token_ids, pad_id, images, where)
    cut = {start + offset for start, length in runs for offset in range(1, length)}
    return [token for index, token in enumerate(token_ids) if index not in cut]


def image_types(length: int, runs: Sequence[tuple[int, int]]) -> torch.Tensor:
    """[length] int: 1 on the image runs' tokens, 0 elsewhere (HF's mm_token_type_ids)."""
    import torch

    types = torch.zeros(length, dtype=torch.int)
    for start, count in runs:
        types[start:start + count] = 1
    return types


def expand_image_pads(token_ids: Sequence[int], pad_id: int, counts: Sequence[int],
                      where: str) -> list[int]:
    """Each single `pad_id` of a rendered prompt repeated to its image's token count (what
    Qwen2-VL's processor does to the chat template's one pad per image)."""
    singles = [index for index, token in enumerate(token_ids) if token == pad_id]
    if len(singles) != len(counts):
        raise ValueError(f"{where}: {len(singles)} image placeholder(s) for {len(counts)} "
                         "image(s); give one image per placeholder")
    out: list[int] = []
    image = 0
    for token in token_ids:
        if token == pad_id:
            out.extend([pad_id] * counts[image])
            image += 1
        else:
            out.append(token)
    return out
