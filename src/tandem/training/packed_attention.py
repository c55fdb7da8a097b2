"""Attention for packed (remove-padding) forwards that attends within each sequence only.

For a packed row [1, T] transformers' `sdpa` builds a [T, T] block-diagonal mask and attends
over all T x T pairs (torch's CPU kernels skip no masked block): with 16 sequences that is 16x
the attention work of attending per sequence, a quarter of a training step's time on CPU.
`packed_sdpa` lays the row out as one right-padded row per sequence and runs SDPA causally
on those rows; right padding needs no mask, since a valid query never reaches a padded key.
The rows come as `attention_rows` (batch.layouts.AttentionRows, passed by forward.py; also
the layout in which samples share one copy of their prompt), or are derived from transformers'
flash-attention keyword `cu_seq_lens_q`; with neither the call is plain `sdpa`, with its masks.
A sliding-window layer's `sliding_window` becomes a banded causal mask over the rows.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from tandem.batch.layouts import AttentionRows, attention_rows as rows_of

NAME = "tandem_packed_sdpa"


def packed_sdpa_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                          value: torch.Tensor, attention_mask: torch.Tensor | None,
                          cu_seq_lens_q: torch.Tensor | None = None,
                          attention_rows: AttentionRows | None = None, **kwargs
                          ) -> tuple[torch.Tensor, None]:
    """query [1, H, T, D], key and value [1, KVH, T, D] of a packed row -> ([1, T, H, D], None),
    as transformers' attention functions return; attention runs within each of the rows."""
    kwargs.pop("is_causal", None)
    if query.shape[0] != 1 or (attention_rows is None and cu_seq_lens_q is None):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    total = query.shape[2]
    if attention_rows is None:
        if int(cu_seq_lens_q[-1]) != total:
            raise ValueError(f"packed attention: cu_seq_lens_q ends at {int(cu_seq_lens_q[-1])} but "
                             f"the packed row holds {total} tokens")
        attention_rows = rows_of(cu_seq_lens_q.cpu()).to(query.device)
    if attention_rows.scatter.numel() != total:
        raise ValueError(f"packed attention: attention_rows place {attention_rows.scatter.numel()} "
                         f"tokens but the packed row holds {total}")
    count, width = attention_rows.count, attention_rows.width

    def padded(states: torch.Tensor) -> torch.Tensor:  # [1, h, T, D] -> [count, h, width, D]
        heads, dim = states.shape[1], states.shape[3]
        rows = states[0].index_select(1, attention_rows.gather)
        return rows.view(heads, count, width, dim).transpose(0, 1)

    # a sliding-window layer (Mistral, Gemma 2/3, Qwen2 with use_sliding_window) attends to the
    # last `sliding_window` positions only; every row starts at position 0, so one mask serves all
    window = kwargs.pop("sliding_window", None)
    mask = None
    if window is not None and width > window:
        columns = torch.arange(width, device=query.device)
        distance = columns[:, None] - columns[None, :]
        mask = ((distance >= 0) & (distance < window))[None, None]
    out, _ = sdpa_attention_forward(module, padded(query), padded(key), padded(value), mask,
                                    is_causal=mask is None, **kwargs)  # [count, width, H, D]
    return out.reshape(count * width, *out.shape[2:]).index_select(0, attention_rows.scatter)[None], None


def register() -> str:
    """Make `packed_sdpa` known to transformers (its masks are sdpa's); returns its name."""
    AttentionInterface.register(NAME, packed_sdpa_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
    return NAME


def uses_packed_sdpa(model: torch.nn.Module) -> bool:
    """Whether `model`'s attention is packed_sdpa (it then honours `attention_rows`)."""
    for candidate in (model, getattr(model, "model", None)):
        config = getattr(candidate, "config", None)
        if config is not None:
            return getattr(config, "_attn_implementation", None) == NAME
    return False
