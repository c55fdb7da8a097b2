"""The images of a dataset row (verl's vision rows; docs/agent_loops.md, "Rows with images"): the
`images` column's entries matched to the messages' image places, `<image>` placeholders in a
message's text turned into image parts, and every image read once at load.

A row's images come from its `images` column (file paths, relative ones from the data file's
folder; encoded bytes; datasets Image dicts {"bytes", "path"}), or, without that column, from
the image parts themselves ({"type": "image", "image": <one of those>}). A row whose images do
not match its places, or one that is not a readable image or is too large, raises ImageRowError:
the dataset leaves that row out, naming file, row and reason (PromptDataset).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tandem.multimodal import load_image

PLACEHOLDER = "<image>"  # verl's image place inside a message's text


class ImageRowError(ValueError):
    """What is wrong with a row's images: that row is left out, the others load."""


def split_placeholders(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each message whose text holds `<image>` with its content as parts: text, image, text."""
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str) and PLACEHOLDER in content:
            parts: list[dict[str, Any]] = []
            for index, piece in enumerate(content.split(PLACEHOLDER)):
                if index:
                    parts.append({"type": "image"})
                if piece:
                    parts.append({"type": "text", "text": piece})
            message = {**message, "content": parts}
        out.append(message)
    return out


def image_parts(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [part for message in messages if isinstance(message.get("content"), list)
            for part in message["content"] if isinstance(part, dict) and part.get("type") == "image"]


def row_images(record: dict[str, Any], messages: list[dict[str, Any]], where: str,
               base: Path | None) -> tuple[list[dict[str, Any]], list[Any]]:
    """The row's messages with image parts (each bare: {"type": "image"}) and its images in
    their order, each read once to check it; ImageRowError naming `where` otherwise."""
    messages = split_placeholders(messages)
    parts = image_parts(messages)
    column = record.get("images")
    if column in (None, "", []):
        refs = [part.get("image") for part in parts]
        if any(ref is None for ref in refs):
            raise ImageRowError(f"{where}: {len(parts)} image place(s) (<image> or image parts) "
                                "but no column 'images' to fill them; give one image per place")
    else:
        refs = list(column) if isinstance(column, (list, tuple)) else [column]
        if len(refs) != len(parts):
            raise ImageRowError(f"{where}: {len(parts)} image place(s) (<image> or image parts) "
                                f"for {len(refs)} image(s) in column 'images'; give one image "
                                "per place")
    refs = [_resolved(ref, base) for ref in refs]
    for index, ref in enumerate(refs):
        try:
            load_image(ref, f"{where}, image {index}")
        except ValueError as error:
            raise ImageRowError(str(error)) from None
    bare = [{**message, "content": [
        {"type": "image"} if isinstance(part, dict) and part.get("type") == "image" else part
        for part in message["content"]]} if isinstance(message.get("content"), list) else message
        for message in messages]
    return bare, refs


def _resolved(ref: Any, base: Path | None) -> Any:
    """A relative file path from the data file's folder; any other image as it is."""
    if isinstance(ref, dict) and not ref.get("bytes") and ref.get("path"):
        ref = ref["path"]
    if isinstance(ref, str) and base is not None and not Path(ref).is_absolute():
        return str(base / ref)
    return ref
