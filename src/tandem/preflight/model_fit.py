"""What must fit the model, read from its config.json (or the tiny model's spec) without
importing torch: top_k within the vocabulary, prompt_length + response_length within the
context and the native engine's KV cache (one rank's, under tensor parallelism), the model's
heads and MLP splitting over the native engine's tensor-parallel ranks,
actor.micro_batch_memory_gb holding one trajectory.
A budget derived from GPU memory is only known on the device (the engine checks it there)."""

from __future__ import annotations

from typing import Any

from tandem.config.choices import DTYPE_BYTES, ConfigError
from tandem.config.schema import RolloutConfig, TandemConfig
from tandem.preflight.model_files import hf_config


def check_model_fit(config: TandemConfig) -> None:
    """Raise ConfigError when top_k, the lengths, the KV cache or the micro-batch memory do not
    fit model.path (unknown shapes pass: "smollm2" is converted on first use)."""
    hf = hf_config(config.model.path)
    if hf is None:
        return
    problem = (_limits_problem(config, hf) or _tensor_parallel_problem(config, hf)
               or _kv_budget_problem(config, hf) or _memory_budget_problem(config, hf))
    if problem:
        raise ConfigError(problem)


def _context_length(hf: dict[str, Any]) -> int | None:
    """The longest sequence the model's positions cover (max_position_embeddings, times a
    rope scaling factor), or None when config.json does not say."""
    positions = hf.get("max_position_embeddings")
    if not isinstance(positions, int):
        return None
    scaling = hf.get("rope_scaling") or {}
    factor = scaling.get("factor") if isinstance(scaling, dict) else None
    return int(positions * factor) if isinstance(factor, (int, float)) and factor > 1 else positions


def _limits_problem(config: TandemConfig, hf: dict[str, Any]) -> str | None:
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
    context = _context_length(hf)
    longest = rollout.prompt_length + rollout.response_length
    if context is not None and longest > context:
        return (f"rollout.response_length: prompt_length + response_length = {longest} tokens, "
                f"beyond the model's context of {context} (config.json "
                "max_position_embeddings); shorten rollout.prompt_length or "
                "rollout.response_length")
    return None


def _tensor_parallel_problem(config: TandemConfig, hf: dict[str, Any]) -> str | None:
    """The native engine splits query heads, KV heads (or replicates them when fewer than the
    ranks) and the MLP's intermediate size evenly over its ranks (rollout/engine/
    tensor_parallel.py); a model that does not split is refused before any process starts."""
    tp = config.rollout.tensor_model_parallel_size
    heads = hf.get("num_attention_heads")
    if config.rollout.name != "native" or tp == 1 or not isinstance(heads, int):
        return None
    kv_heads = hf.get("num_key_value_heads") or heads
    intermediate = hf.get("intermediate_size")
    sizes = {"num_attention_heads": heads % tp,
             "num_key_value_heads": kv_heads % tp and tp % kv_heads,
             "intermediate_size": intermediate % tp if isinstance(intermediate, int) else 0}
    for field, remainder in sizes.items():
        if remainder:
            return (f"rollout.tensor_model_parallel_size: is {tp}, but {config.model.path}'s "
                    f"{field}={hf.get(field)} does not split over {tp} ranks (config.json); "
                    "choose a size that divides the attention heads, the intermediate size and "
                    "the KV heads (or a multiple of the KV heads)")
    return None


def _kv_budget_problem(config: TandemConfig, hf: dict[str, Any]) -> str | None:
    """Why the longest trajectory cannot fit the native engine's KV cache, or None. The budget
    is per rank: each tensor-parallel rank holds its KV heads' share of every block."""
    rollout = config.rollout
    default = RolloutConfig().kv_cache_memory_bytes
    budget = rollout.kv_cache_memory_bytes or default
    on_gpu = config.model.device.startswith("cuda")
    heads = hf.get("num_attention_heads")
    if (rollout.name != "native" or (on_gpu and rollout.kv_cache_memory_bytes in (0, default))
            or not heads or "num_hidden_layers" not in hf):
        return None
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    kv_heads = max(1, (hf.get("num_key_value_heads") or heads) // rollout.tensor_model_parallel_size)
    block_bytes = (2 * hf["num_hidden_layers"] * rollout.block_size * kv_heads * head_dim
                   * DTYPE_BYTES.get(config.model.dtype, 4))
    blocks = budget // block_bytes
    longest = min(rollout.prompt_length + rollout.response_length,
                  hf.get("max_position_embeddings") or 1 << 62)
    needed = -(-longest // rollout.block_size)
    if needed <= blocks:
        return None
    return (f"rollout.response_length: prompt_length + response_length = {longest} tokens need "
            f"{needed} KV blocks of {rollout.block_size} tokens ({needed * block_bytes} bytes for "
            f"{config.model.path}), but rollout.kv_cache_memory_bytes={budget} holds {blocks}; "
            f"raise rollout.kv_cache_memory_bytes to at least {needed * block_bytes} or shorten "
            "the lengths")


def _memory_budget_problem(config: TandemConfig, hf: dict[str, Any]) -> str | None:
    """actor.micro_batch_memory_gb must hold the longest trajectory (the engine checks again
    with the loaded model: a head with softcapping or logit scaling takes the full-logits path,
    as an FSDP-sharded one does)."""
    if not config.actor.micro_batch_memory_gb:
        return None
    from tandem.training.memory_budget import micro_batch_token_budget  # imports torch

    try:
        micro_batch_token_budget(config, hf, full_logits=config.actor.fsdp_size > 1)
    except ValueError as error:
        return str(error)
    return None
