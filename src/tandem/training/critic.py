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
    """Backbone (e.g. Qwen2Model, or a vision-language model's Qwen2VLModel) + Linear(hidden, 1).
    Same call signature as an HF causal LM."""

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
        text = backbone.config.get_text_config()  # a vision-language model's language model's
        return cls(backbone, text.hidden_size, getattr(text, "initializer_range", 0.02), seed)

    @property
    def config(self):
        """The backbone's HF config (saved with checkpoints)."""
        return self.model.config

    def get_input_embeddings(self) -> nn.Module:
        """The backbone's token embedding (a vision-language batch replaces its image rows)."""
        return self.model.get_input_embeddings()

    def forward(self, input_ids: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, use_cache: bool = False,
                logits_to_keep: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None,
                **attention_kwargs: torch.Tensor) -> ValueOutput:
        """input_ids [B, L] (or a vision-language batch's inputs_embeds [B, L, H] with its 3-D
        positions, training/vision_inputs.py) -> values [B, K] at the `logits_to_keep` columns
        (all when None); attention_kwargs (packed sequence boundaries) go to the attention."""
        # a VLM backbone's language model takes the embeddings with the images already in them
        backbone = (self.model.language_model if inputs_embeds is not None
                    and hasattr(self.model, "language_model") else self.model)
        hidden = backbone(input_ids=input_ids, inputs_embeds=inputs_embeds,
                          position_ids=position_ids, attention_mask=attention_mask,
                          use_cache=use_cache, **attention_kwargs).last_hidden_state
        if logits_to_keep is not None:
            hidden = hidden[:, logits_to_keep]
        return ValueOutput(values=self.value_head(hidden).squeeze(-1))
