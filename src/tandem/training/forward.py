"""Forward passes over a jagged batch, returning outputs only where they score response tokens
(docs/training.md, "Forward passes").

Packed (remove padding): all valid tokens in one row [1, T] with positions restarting at 0 per
sequence, no attention mask and `use_cache=False` (with a cache object transformers 5 stops
deriving the block-diagonal mask from the position resets, and sequences attend to each other).
The boundaries also go to the attention as `cu_seq_lens_q/k` (as `attention_rows`, computed once
per forward), with which `packed_sdpa` (packed_attention.py) attends per sequence. Shared
prompts (`share_prompts`, packed_sdpa only): each prompt once, followed by every response of its
group (layouts.SharedPromptBatch). Padded: prompts left-padded, responses right-padded, with an
attention mask. Actor log-probs come from the hidden states through the LM head in chunks
(lm_head.py) when the head is a plain linear map; otherwise from the model's full logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from tensordict import TensorDict

from tandem.algorithms.entropy import entropy_from_logits
from tandem.algorithms.kept_sets import restrict_to_kept
from tandem.batch.jagged import field_lengths, field_values, make_field, padded_field
from tandem.batch.layouts import attention_rows, to_dense, to_packed, to_shared_prompts
from tandem.training.lm_head import DEFAULT_CHUNK_BYTES, chunk_tokens, chunked_log_probs, plain_linear_head
from tandem.training.packed_attention import uses_packed_sdpa
from tandem.training.vision_inputs import is_vision_batch, vision_inputs


@dataclass
class MiniBatchInfo:
    """Totals over the whole mini-batch on every data-parallel rank, for loss normalisation."""

    global_tokens: float  # sum of loss_mask
    global_sequences: int  # samples with at least one loss_mask token (padding samples have none)
    dp_size: int


@dataclass
class ForwardOutput:
    """Per-response-token outputs, flat in batch order [sum R_i]; `field()` gives [B, R_i]."""

    response_lengths: torch.Tensor  # [B]
    log_probs: torch.Tensor | None = None  # [sum R_i]
    entropy: torch.Tensor | None = None  # [sum R_i]
    values: torch.Tensor | None = None  # [sum R_i], critic only
    mini_batch: MiniBatchInfo | None = None  # set by the engine when training

    def field(self, name: str) -> torch.Tensor:
        """One output as a batch field [B, R_i]: jagged, or stacked when the lengths agree."""
        values = getattr(self, name)
        if values is None:
            raise ValueError(f"ForwardOutput.{name} was not computed for this forward")
        return make_field(values, self.response_lengths)

    def padded(self, name: str, pad_value: float = 0.0) -> torch.Tensor:
        """One output right-padded to [B, max R_i], aligned with padded_field(batch[...])."""
        return padded_field(self.field(name), pad_value)


def response_head_outputs(model: torch.nn.Module, batch: TensorDict, use_remove_padding: bool,
                          output_key: str = "logits", share_prompts: bool = True) -> torch.Tensor:
    """Run `model` (the HF causal LM call, which ValueModel mirrors) and return its `output_key` at
    the positions predicting response tokens: [sum R_i, ...] in batch order."""
    vision = is_vision_batch(batch)

    def run(positions: torch.Tensor, **inputs: torch.Tensor) -> torch.Tensor:
        if vision:  # the image tokens' embeddings and the 3-D positions (vision_inputs.py)
            inputs.update(vision_inputs(model, batch, inputs.pop("input_ids"),
                                        inputs["position_ids"], inputs["attention_mask"]))
        return getattr(model(**inputs, use_cache=False, logits_to_keep=positions), output_key)

    rows = _rows_mode(model, share_prompts and not vision)  # a shared prompt: one image copy
    return _at_response_positions(run, batch, use_remove_padding, _model_device(model), rows)


def response_hidden_states(model: torch.nn.Module, batch: TensorDict, use_remove_padding: bool,
                           share_prompts: bool = True) -> torch.Tensor:
    """The decoder's last hidden states at the positions predicting response tokens: [sum R_i, H]
    (what the LM head turns into those tokens' logits)."""
    decoder = model.get_decoder()
    vision = is_vision_batch(batch)

    def run(positions: torch.Tensor, **inputs: torch.Tensor) -> torch.Tensor:
        if vision:  # the image tokens' embeddings and the 3-D positions (vision_inputs.py)
            inputs.update(vision_inputs(model, batch, inputs.pop("input_ids"),
                                        inputs["position_ids"], inputs["attention_mask"]))
        return decoder(**inputs, use_cache=False).last_hidden_state[:, positions]

    rows = _rows_mode(model, share_prompts and not vision)  # a shared prompt: one image copy
    return _at_response_positions(run, batch, use_remove_padding, _model_device(model), rows)


def _rows_mode(model: torch.nn.Module, share_prompts: bool) -> str | None:
    """How the attention takes packed rows: "shared" (prompts shared), "rows", or None
    (the attention is not packed_sdpa: boundaries as cu_seq_lens only)."""
    if not uses_packed_sdpa(model):
        return None
    return "shared" if share_prompts else "rows"


def _at_response_positions(run: Callable[..., torch.Tensor], batch: TensorDict, use_remove_padding: bool,
                           device: torch.device, rows_mode: str | None = None) -> torch.Tensor:
    """run(positions, input_ids=, position_ids=, attention_mask=, ...) -> [rows, len(positions), ...];
    returns its rows at the response-predicting positions, flat in batch order."""
    shared = to_shared_prompts(batch) if use_remove_padding and rows_mode == "shared" else None
    if shared is not None:
        return run(shared.response_index.to(device), input_ids=shared.input_ids.to(device),
                   position_ids=shared.position_ids.to(device), attention_mask=None,
                   attention_rows=shared.rows.to(device))[0]
    if use_remove_padding:
        packed = to_packed(batch, response_fields=())
        starts = packed.cu_seqlens[:-1].long()
        if not bool(packed.position_ids[0, starts].eq(0).all()):
            raise ValueError("packed forward: position_ids must restart at 0 for every sequence; "
                             "otherwise neighbouring sequences would attend to each other")
        # the boundaries for attention per sequence (packed_attention.py; other kernels ignore them)
        bounds = packed.cu_seqlens.to(device)
        rows = {"attention_rows": attention_rows(packed.cu_seqlens).to(device)} if rows_mode else {}
        return run(packed.response_positions().to(device), input_ids=packed.input_ids.to(device),
                   position_ids=packed.position_ids.to(device), attention_mask=None,
                   cu_seq_lens_q=bounds, cu_seq_lens_k=bounds, **rows)[0]
    dense = to_dense(batch, pad_token_id=0, response_fields=())
    width, response_width = dense.prompt_width, dense.responses.shape[1]
    out = run(torch.arange(width - 1, width + response_width - 1, device=device),
              input_ids=dense.input_ids.to(device), position_ids=dense.position_ids.to(device),
              attention_mask=dense.attention_mask.to(device))
    return out[dense.response_attention().to(device)]


def token_log_probs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / temperature)[label]: logits [N, V], labels [N] -> [N] float32."""
    logits = logits.float() / temperature
    return logits.gather(-1, labels[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def token_entropy(logits: torch.Tensor, temperature: float = 1.0, masked: bool = False) -> torch.Tensor:
    """Entropy of softmax(logits / temperature): [N, V] -> [N] float32 (masked: -inf logits allowed)."""
    return entropy_from_logits(logits.float() / temperature, masked)


def kept_sets_of(batch: TensorDict, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The batch's kept sets as (counts [sum R_i], ids [sum K_i]) on `device`, or None without."""
    if "kept_counts" not in batch.keys():
        return None
    return (field_values(batch["kept_counts"]).to(device),
            field_values(batch["kept_token_ids"]).to(device))


def actor_forward(model: torch.nn.Module, batch: TensorDict, use_remove_padding: bool,
                  temperature: float = 1.0, calculate_entropy: bool = False, entropy_grad: bool = True,
                  logits_chunk_bytes: int | None = DEFAULT_CHUNK_BYTES, share_prompts: bool = True
                  ) -> ForwardOutput:
    """Log-probabilities (and entropy) of every response token under `model`: from the hidden states
    in chunks of at most `logits_chunk_bytes` of logits with a plain linear LM head (lm_head.py),
    else (or with None) from the full logits. `entropy_grad=False`: entropy without gradient
    (metrics only); `share_prompts`: a prompt shared by several samples computed once (packed_sdpa
    only). A batch with kept sets (sampling-mask replay) gets both renormalised over them."""
    labels = field_values(batch["responses"]).to(_model_device(model))
    lengths = field_lengths(batch["responses"])
    kept = kept_sets_of(batch, labels.device)
    head = plain_linear_head(model) if logits_chunk_bytes is not None else None
    if head is not None:
        hidden = response_hidden_states(model, batch, use_remove_padding, share_prompts)
        mode = ("grad" if entropy_grad else "detached") if calculate_entropy else "none"
        log_probs, entropy = chunked_log_probs(hidden, head, labels, temperature, mode,
                                               chunk_tokens(head.out_features, logits_chunk_bytes), kept)
        return ForwardOutput(response_lengths=lengths, log_probs=log_probs, entropy=entropy)
    logits = response_head_outputs(model, batch, use_remove_padding, "logits", share_prompts)
    if kept is not None:
        logits = restrict_to_kept(logits.float(), *kept)
    entropy = None
    if calculate_entropy:
        with torch.set_grad_enabled(torch.is_grad_enabled() and entropy_grad):
            entropy = token_entropy(logits, temperature, masked=kept is not None)
    return ForwardOutput(response_lengths=lengths, log_probs=token_log_probs(logits, labels, temperature),
                         entropy=entropy)


def critic_forward(model: torch.nn.Module, batch: TensorDict, use_remove_padding: bool,
                   share_prompts: bool = True) -> ForwardOutput:
    """Value estimates V(s_t) at the state before each response token."""
    values = response_head_outputs(model, batch, use_remove_padding, "values", share_prompts)
    return ForwardOutput(response_lengths=field_lengths(batch["responses"]), values=values.float())


def _model_device(model: torch.nn.Module) -> torch.device:
    parameter = next(model.parameters())
    local = getattr(parameter, "to_local", None)  # an FSDP2 DTensor lives on its mesh's device
    return local().device if local is not None else parameter.device
