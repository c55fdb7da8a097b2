"""Load-time checks against the model, from its files only (config.json, the tokenizer's and
the weights' presence, safetensors headers): never the weights themselves, never torch. So
an unloadable model.path, a top_k beyond the vocabulary or lengths beyond the model's context
fail in well under a second, before Ray starts.

`model_directory_problem` takes a resolved directory, so any way of finding one (a local path,
a hub id resolved to its cache) plugs in.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin", "*.safetensors.index.json",
                   "pytorch_model.bin.index.json")
# config.json fields that must agree between a checkpoint and model.path
SHAPE_FIELDS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "intermediate_size", "vocab_size", "tie_word_embeddings")


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


def context_length(hf: dict[str, Any]) -> int | None:
    """The longest sequence the model's positions cover (max_position_embeddings, times a
    rope scaling factor), or None when config.json does not say."""
    positions = hf.get("max_position_embeddings")
    if not isinstance(positions, int):
        return None
    scaling = hf.get("rope_scaling") or {}
    factor = scaling.get("factor") if isinstance(scaling, dict) else None
    return int(positions * factor) if isinstance(factor, (int, float)) and factor > 1 else positions


def model_limits_problem(config: Any, hf: dict[str, Any]) -> str | None:
    """rollout.top_k (training and validation) within the vocabulary; prompt_length +
    response_length within the model's context."""
    rollout = config.rollout
    vocab = hf.get("vocab_size")
    if isinstance(vocab, int):
        for field, top_k in (("rollout.top_k", rollout.top_k),
                             ("rollout.val_kwargs.top_k", rollout.val_kwargs.top_k)):
            if top_k > vocab:
                return (f"{field}: is {top_k}, more than the model's vocabulary of {vocab} "
                        "tokens (config.json vocab_size); use -1 (off) or at most "
                        f"{vocab}")
    context = context_length(hf)
    longest = rollout.prompt_length + rollout.response_length
    if context is not None and longest > context:
        return (f"rollout.response_length: prompt_length + response_length = {longest} tokens, "
                f"beyond the model's context of {context} (config.json "
                "max_position_embeddings); shorten rollout.prompt_length or "
                "rollout.response_length")
    return None


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


def model_problem(config: Any) -> str | None:
    """The first problem of config.model.path and of the lengths and top_k against it, or None
    ("smollm2" is converted on first use: checked then)."""
    from tandem.config.kv_budget import hf_config

    path = config.model.path
    if path == "smollm2":
        return None
    if not path.startswith("tiny:"):
        from tandem.config.kv_budget import model_directory_if_known
        from tandem.models.hub import looks_like_hub_id

        directory = model_directory_if_known(path)
        if directory is None and looks_like_hub_id(path):
            return None  # a hub id not in the cache yet: tandem.preflight downloads and checks it
        problem = model_directory_problem(directory or Path(path).expanduser())
        if problem:
            return problem
    hf = hf_config(path)
    return model_limits_problem(config, hf) if hf is not None else None
