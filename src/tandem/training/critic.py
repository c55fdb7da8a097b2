"""The PPO critic: the HF transformer backbone with a scalar value head on every position."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn


@dataclass
class ValueOutput:
    """values [B, K]: one scalar per kept position."""

    values: torch.Tensor


class ValueModel(nn.Module):
    """Backbone (e.g. Qwen2Model) + Linear(hidden, 1). Same call signature as an HF causal LM."""

    def __init__(self, backbone: nn.Module, hidden_size: int, init_std: float = 0.02, seed: int = 0):
        super().__init__()
        self.model = backbone  # parameter names stay "model.layers...", as in the causal LM
        self.value_head = nn.Linear(hidden_size, 1, dtype=next(backbone.parameters()).dtype)
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            self.value_head.weight.copy_(torch.randn(self.value_head.weight.shape, generator=generator) * init_std)
            self.value_head.bias.zero_()
        # FSDP wraps these units one by one, as it does for the causal LM
        self._no_split_modules = list(getattr(backbone, "_no_split_modules", None) or [])

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32,
                        attn_implementation: str = "sdpa", seed: int = 0) -> "ValueModel":
        """Backbone weights from an HF causal-LM directory (its lm_head is dropped); fresh head."""
        from transformers import AutoModel

        backbone = AutoModel.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation)
        return cls(backbone, backbone.config.hidden_size, backbone.config.initializer_range, seed)

    @property
    def config(self):
        """The backbone's HF config (saved with checkpoints)."""
        return self.model.config

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None, use_cache: bool = False,
                logits_to_keep: torch.Tensor | None = None, **attention_kwargs: torch.Tensor) -> ValueOutput:
        """input_ids [B, L] -> values [B, K] at the `logits_to_keep` columns (all when None);
        attention_kwargs (packed sequence boundaries) go to the backbone's attention."""
        hidden = self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                            use_cache=use_cache, **attention_kwargs).last_hidden_state
        if logits_to_keep is not None:
            hidden = hidden[:, logits_to_keep]
        return ValueOutput(values=self.value_head(hidden).squeeze(-1))
