"""Models named by hub id (`model.path: Qwen/Qwen2.5-0.5B-Instruct`), found through the same
cache transformers uses ($HF_HOME, $HF_HUB_CACHE) and downloaded there when the hub can be
reached; with HF_HUB_OFFLINE=1 only the cache is read. Imports no torch."""

from __future__ import annotations

import re
from pathlib import Path

# what from_pretrained needs of a causal LM and its tokenizer (no .bin / .pt / onnx copies)
MODEL_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def looks_like_hub_id(path: str) -> bool:
    """"org/name" or "name" that is not a local path."""
    return bool(_HUB_ID.match(path)) and not Path(path).expanduser().exists()


def hub_model_directory(repo_id: str, revision: str | None = None) -> Path:
    """The local snapshot directory of a hub model (downloaded into the HF cache unless
    offline); FileNotFoundError naming model.path and the fix otherwise."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    offline = constants.HF_HUB_OFFLINE
    try:
        directory = Path(snapshot_download(repo_id, revision=revision, allow_patterns=MODEL_FILES,
                                           local_files_only=offline))
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError, ValueError) as error:
        where = f"the HF cache {constants.HF_HUB_CACHE}"
        fix = ("HF_HUB_OFFLINE=1 reads only the cache: download it first (huggingface-cli "
               "download) or unset HF_HUB_OFFLINE" if offline else
               "check the id, your network and HF_TOKEN for gated models")
        raise FileNotFoundError(f"model.path={repo_id!r}: not a local directory, and as a hub id "
                                f"it is not in {where} ({type(error).__name__}); {fix}") from None
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(f"model.path={repo_id!r}: the hub snapshot {directory} has no "
                                "config.json, so it is not a transformers model")
    return directory


def cached_model_directory(repo_id: str) -> Path | None:
    """The cached snapshot of a hub model without any network call, or None."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, allow_patterns=MODEL_FILES, local_files_only=True))
    except (LocalEntryNotFoundError, OSError, ValueError):
        return None
