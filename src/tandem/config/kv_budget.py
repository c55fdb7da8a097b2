"""Load-time check that one full-length trajectory fits the native engine's KV cache.

The engine sizes its cache from rollout.kv_cache_memory_bytes and the model's shape; a
prompt_length + response_length it cannot hold would otherwise fail inside a worker, after Ray
and the models have started. The shape is read from config.json (or the tiny model's spec)
without importing torch; a budget derived from GPU memory is only known on the device.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def hf_config(path: str) -> dict[str, Any] | None:
    """model.path's config.json as a dict (a tiny model's from its spec; its vocabulary is at
    most the tokenizer's), or None when unknown here."""
    from tandem.models.tiny import SHIPPED_MODELS

    if path in SHIPPED_MODELS:
        config_file = SHIPPED_MODELS[path] / "config.json"
        return json.loads(config_file.read_text()) if config_file.is_file() else None
    if path.startswith("tiny:"):
        from tandem.models.tiny import TinyModelSpec

        spec = TinyModelSpec(architecture=path.split(":", 1)[1])
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


def model_shape(path: str) -> dict[str, int] | None:
    """layers, kv_heads, head_dim and max_positions of model.path, or None when unknown here."""
    hf = hf_config(path)
    heads = hf.get("num_attention_heads") if hf is not None else None
    if not heads or "num_hidden_layers" not in hf:
        return None
    return {"layers": hf["num_hidden_layers"], "kv_heads": hf.get("num_key_value_heads") or heads,
            "head_dim": hf.get("head_dim") or hf["hidden_size"] // heads,
            "max_positions": hf.get("max_position_embeddings") or 1 << 62}


def kv_budget_problem(config: Any) -> str | None:
    """Why the longest trajectory cannot fit the native engine's KV cache, or None."""
    rollout = config.rollout
    default = type(rollout)().kv_cache_memory_bytes
    budget = rollout.kv_cache_memory_bytes or default
    on_gpu = config.model.device.startswith("cuda")
    if rollout.name != "native" or (on_gpu and rollout.kv_cache_memory_bytes in (0, default)):
        return None
    shape = model_shape(config.model.path)
    if shape is None:
        return None
    block_bytes = (2 * shape["layers"] * rollout.block_size * shape["kv_heads"] * shape["head_dim"]
                   * DTYPE_BYTES.get(config.model.dtype, 4))
    blocks = budget // block_bytes
    longest = min(rollout.prompt_length + rollout.response_length, shape["max_positions"])
    needed = -(-longest // rollout.block_size)
    if needed <= blocks:
        return None
    return (f"rollout.response_length: prompt_length + response_length = {longest} tokens need "
            f"{needed} KV blocks of {rollout.block_size} tokens ({needed * block_bytes} bytes for "
            f"{config.model.path}), but rollout.kv_cache_memory_bytes={budget} holds {blocks}; "
            f"raise rollout.kv_cache_memory_bytes to at least {needed * block_bytes} or shorten "
            "the lengths")
