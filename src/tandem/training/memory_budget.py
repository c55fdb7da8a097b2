"""How many tokens a training micro-batch may hold to fit a memory budget (actor.micro_batch_memory_gb).

The estimate counts, per token of a packed micro-batch, the activations a forward of an HF
Llama/Qwen2-style decoder (RMSNorm, rotary attention through SDPA, gated SiLU MLP) saves for
its backward, plus one more layer's worth for the backward's transient gradients, plus the
LM head's share (docs/training.md, "Micro-batches"). What does not grow with the micro-batch
(weights, their gradients, optimizer state) is not in it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from tandem.config.choices import DTYPE_BYTES
from tandem.config.schema import TandemConfig
from tandem.training.lm_head import DEFAULT_CHUNK_BYTES

GB = 10**9
FP32 = 4
# fp32 values per response token held by the loss and its backward (log-probs, ratios, clips,
# advantages, masks, entropy, their gradients)
LOSS_VALUES_PER_TOKEN = 32
# fp32 [tokens, vocab] tensors of the LM head alive at once: logits, softmax, their gradient
HEAD_LIVE_TENSORS = 3


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder that set its activation memory."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    vocab_size: int

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any]) -> "ModelShape":
        """From an HF config.json dict (or PretrainedConfig.to_dict()); ValueError naming a
        missing key."""
        missing = [key for key in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                   "num_attention_heads", "vocab_size") if not hf.get(key)]
        if missing:
            raise ValueError(f"actor.micro_batch_memory_gb: the model's config has no {', '.join(missing)}, "
                             "so its activation memory cannot be estimated; set "
                             "actor.micro_batch_memory_gb=0 and size micro-batches with "
                             "actor.ppo_max_token_len_per_micro_batch")
        heads = hf["num_attention_heads"]
        return cls(hidden_size=hf["hidden_size"], intermediate_size=hf["intermediate_size"],
                   num_layers=hf["num_hidden_layers"], num_heads=heads,
                   head_dim=hf.get("head_dim") or hf["hidden_size"] // heads, vocab_size=hf["vocab_size"])


def layer_bytes_per_token(shape: ModelShape, dtype_bytes: int, tokens: int) -> int:
    """Activations one decoder layer saves for its backward, per token of a `tokens`-token
    packed micro-batch.

    RMSNorm (x2): its fp32 input, the normalised input and the output (model dtype), 1/rms.
    Attention: q, k and v expanded to all heads (HF repeats grouped K/V heads when a mask is
    passed, as packed and padded forwards do), SDPA's output and o_proj's input, SDPA's fp32
    log-sum-exp per head, and the [tokens, tokens] mask SDPA turns into the model dtype.
    MLP: gate and up projections, SiLU(gate), their product (down_proj's input).
    """
    norm = shape.hidden_size * (FP32 + 2 * dtype_bytes) + FP32
    attention = (5 * shape.num_heads * shape.head_dim + tokens) * dtype_bytes + shape.num_heads * FP32
    mlp = 4 * shape.intermediate_size * dtype_bytes
    return 2 * norm + attention + mlp


def activation_bytes(shape: ModelShape, dtype_bytes: int, tokens: int, full_logits: bool,
                     chunk_bytes: int) -> int:
    """Estimated memory a training forward + backward of `tokens` packed tokens holds beyond the
    weights and their gradients.

    Every layer's saved activations plus one more layer (the gradients and workspaces of the
    layer the backward is in), the final norm, rotary cos/sin, and per token the loss and the
    LM head: the logits, their fp32 copy, softmax and gradients, for at most one chunk of
    tokens (lm_head.py's `chunk_bytes` of fp32 logits-sized tensors), or for every token with
    `full_logits` (an FSDP-sharded or non-linear head); and three head-weight-sized gradients.
    """
    hidden, vocab = shape.hidden_size, shape.vocab_size
    per_token = ((shape.num_layers + 1) * layer_bytes_per_token(shape, dtype_bytes, tokens)
                 + hidden * (FP32 + dtype_bytes) + FP32  # final norm
                 + 2 * shape.head_dim * dtype_bytes  # rotary cos, sin
                 + hidden * dtype_bytes  # hidden states at response positions (the head's input)
                 + LOSS_VALUES_PER_TOKEN * FP32)
    head_per_token = vocab * (2 * dtype_bytes + HEAD_LIVE_TENSORS * FP32)
    head_tokens = tokens if full_logits else min(tokens, max(1, chunk_bytes // (HEAD_LIVE_TENSORS * FP32 * vocab)))
    # the head weight's gradient from one chunk, the sum of the earlier ones and their new sum
    # (the autograd engine adds up every chunk's, and a tied embedding's, before the .grad)
    head_weight_gradients = 3 * vocab * hidden * dtype_bytes
    return tokens * per_token + head_tokens * head_per_token + head_weight_gradients


def tokens_for_memory(memory_bytes: int, shape: ModelShape, dtype_bytes: int, full_logits: bool,
                      chunk_bytes: int) -> int:
    """The most tokens whose activation_bytes fit memory_bytes (0 if not even one)."""
    low, high = 0, 1
    while activation_bytes(shape, dtype_bytes, high, full_logits, chunk_bytes) <= memory_bytes:
        low, high = high, high * 2
    while high - low > 1:  # activation_bytes grows with tokens: bisect
        middle = (low + high) // 2
        if activation_bytes(shape, dtype_bytes, middle, full_logits, chunk_bytes) <= memory_bytes:
            low = middle
        else:
            high = middle
    return low


def micro_batch_token_budget(config: TandemConfig, hf_config: Mapping[str, Any], full_logits: bool) -> int:
    """actor.ppo_max_token_len_per_micro_batch, lowered to the tokens actor.micro_batch_memory_gb
    fits when that is set; ValueError when those are fewer than the longest trajectory."""
    actor = config.actor
    if not actor.micro_batch_memory_gb:
        return actor.ppo_max_token_len_per_micro_batch
    shape = ModelShape.from_hf_config(hf_config)
    dtype_bytes = DTYPE_BYTES[config.model.dtype]
    fits = tokens_for_memory(int(actor.micro_batch_memory_gb * GB), shape, dtype_bytes, full_logits,
                             DEFAULT_CHUNK_BYTES)
    longest = config.rollout.prompt_length + config.rollout.response_length
    if fits < longest:
        needed = activation_bytes(shape, dtype_bytes, longest, full_logits, DEFAULT_CHUNK_BYTES)
        raise ValueError(f"actor.micro_batch_memory_gb: is {actor.micro_batch_memory_gb:g}, which holds the "
                         f"estimated activations of {fits} tokens of {config.model.path} ({config.model.dtype}), "
                         f"fewer than the longest trajectory rollout.prompt_length + rollout.response_length "
                         f"= {longest}; raise it to at least {math.ceil(needed / 10**6) / 1000:g} (or set "
                         "it to 0 to size micro-batches by actor.ppo_max_token_len_per_micro_batch alone)")
    return min(actor.ppo_max_token_len_per_micro_batch, fits)
