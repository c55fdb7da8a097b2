"""Log-probs and entropy from hidden states through the LM head, a chunk of tokens at a time.

The full [tokens, vocab] logits are never held at once (49k-word vocabularies make them the
largest tensor of a training step). Each chunk runs under non-reentrant activation
checkpointing: its logits are freed after the forward and recomputed in the backward, so the
peak is one chunk's logits, softmax and gradient, at the price of one more head matmul.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from tandem.algorithms.entropy import entropy_from_logits
from tandem.algorithms.kept_sets import chunk_of_kept, restrict_to_kept

# fp32 [chunk, vocab] tensors alive at once in a chunk's backward: logits, softmax, their gradient
LIVE_CHUNK_TENSORS = 3
DEFAULT_CHUNK_BYTES = 64 << 20
# config attributes of heads that do more than a plain linear map (softcapping, logit scaling)
_HEAD_EXTRAS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def chunk_tokens(vocab_size: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Tokens per chunk so that one chunk's live [tokens, vocab] fp32 tensors fit chunk_bytes."""
    return max(1, chunk_bytes // (LIVE_CHUNK_TENSORS * 4 * vocab_size))


def plain_linear_head(model: torch.nn.Module) -> torch.nn.Linear | None:
    """The model's LM head if logits = head(decoder hidden states) exactly, else None (softcapping,
    logit scaling, or FSDP-sharded weights that only the root module's forward gathers)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Linear) or hasattr(head.weight, "to_local") or not hasattr(model, "get_decoder"):
        return None
    config = getattr(model, "config", None)
    if any(getattr(config, name, None) not in (None, 1, 1.0) for name in _HEAD_EXTRAS):
        return None
    return head


def _chunk(hidden: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           temperature: float, entropy: str, kept_counts: torch.Tensor | None = None,
           kept_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    logits = F.linear(hidden, weight, bias).float() / temperature
    if kept_counts is not None:
        logits = restrict_to_kept(logits, kept_counts, kept_ids)
    normalizer = torch.logsumexp(logits, dim=-1)
    log_probs = logits.gather(-1, labels[:, None]).squeeze(-1) - normalizer
    if entropy == "none":
        return log_probs, log_probs.new_zeros(0)
    with torch.set_grad_enabled(torch.is_grad_enabled() and entropy == "grad"):
        values = entropy_from_logits(logits, masked=kept_counts is not None)
    return log_probs, values


def chunked_log_probs(hidden: torch.Tensor, head: torch.nn.Linear, labels: torch.Tensor,
                      temperature: float = 1.0, entropy: str = "none",
                      tokens_per_chunk: int | None = None,
                      kept: tuple[torch.Tensor, torch.Tensor] | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(head(hidden) / temperature)[label] and the entropy, chunk by chunk: hidden [N,
    H], labels [N] -> log_probs [N] float32 and entropy [N] (None with entropy="none"; "detached":
    no gradient, for metrics; "grad": differentiable). Gradients reach `hidden` and the head through
    every chunk. kept (counts [N], ids): each row renormalised over its kept set (kept_sets.py)."""
    if entropy not in ("none", "detached", "grad"):
        raise ValueError(f"chunked_log_probs entropy={entropy!r}: use none, detached or grad")
    size = tokens_per_chunk or chunk_tokens(head.out_features)
    differentiable = torch.is_grad_enabled() and (hidden.requires_grad or head.weight.requires_grad)
    log_probs, entropies = [], []
    offsets = None if kept is None else F.pad(kept[0].long().cumsum(0), (1, 0))
    for start in range(0, hidden.shape[0], size):
        args = (hidden[start:start + size], labels[start:start + size], head.weight, head.bias, temperature, entropy)
        if kept is not None:
            args += chunk_of_kept(kept[0], kept[1], offsets, start, start + size)
        piece, piece_entropy = checkpoint(_chunk, *args, use_reentrant=False) if differentiable else _chunk(*args)
        log_probs.append(piece)
        entropies.append(piece_entropy)
    if not log_probs:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, (empty if entropy != "none" else None)
    return torch.cat(log_probs), (torch.cat(entropies) if entropy != "none" else None)
