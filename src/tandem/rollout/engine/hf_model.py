"""What the native engine's runner takes from an HF model: loading it (a decoder-only LM, or a
vision-language model's language model beside its vision tower), the decoder it runs, the checks
of what the runner supports, and the CPU fp32 linears held in oneDNN's packed layout."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from tandem import cpu_kernels


def load_model(model_path: str | Path, dtype: torch.dtype) -> nn.Module:
    """The HF model of `model_path`: a causal LM, or (a config with a vision_config) a
    vision-language model for conditional generation (Qwen2-VL family)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(str(model_path))
    kind = AutoModelForImageTextToText if hasattr(config, "vision_config") else AutoModelForCausalLM
    return kind.from_pretrained(str(model_path), dtype=dtype)


def decoder_of(model: nn.Module) -> nn.Module:
    """The decoder stack (embed_tokens, layers, norm, rotary_emb): `model.model`, or a
    vision-language model's `model.model.language_model`."""
    inner = model.model
    return getattr(inner, "language_model", inner)


def text_config(model: nn.Module):
    """The language model's config (a vision-language model's text_config)."""
    return model.config.get_text_config()


def uses_onednn(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the linear layers run through oneDNN: CPU fp32 only. There torch's `F.linear`
    (MKL sgemm) reached ~105 GFLOP/s per core on an AMD Zen 5 and oneDNN ~250 (docs/engine.md);
    bf16/fp16 and CUDA keep the HF modules."""
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


class PackedLinear(nn.Module):
    """`x @ weight.T + bias` with the weight [out, in] held only in oneDNN's packed layout.

    `bias` is the HF module's own parameter (so its HF name and in-place update are unchanged);
    the weight has no dense copy: `load` packs a new one, `release` frees it."""

    def __init__(self, weight: torch.Tensor, bias: nn.Parameter | None) -> None:
        super().__init__()
        self.weight_shape = weight.shape
        self.bias = bias
        self.packed: torch.Tensor | None = None
        self.load(weight)

    @staticmethod
    def pack(weight: torch.Tensor) -> torch.Tensor:
        """A copy of the dense weight [out, in] in oneDNN's packed layout."""
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach())

    def load(self, weight: torch.Tensor) -> None:
        self.packed = self.pack(weight)

    def release(self) -> None:
        self.packed = None

    def nbytes(self) -> int:
        # the packed layout may pad rows to oneDNN's block size; numel is the unpadded size
        return 0 if self.packed is None else self.packed.numel() * self.packed.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def pack_linears(model: nn.Module) -> dict[str, PackedLinear]:
    """Replace every nn.Linear of `model`'s decoder and its lm_head (unless tied) by a
    PackedLinear and drop its dense weight; returns them by HF weight name
    (`model.layers.0.mlp.up_proj.weight`). A vision tower keeps its HF linears."""
    tied = model.lm_head.weight is model.get_input_embeddings().weight
    own = {id(module) for module in decoder_of(model).modules()} | {id(model.lm_head)}
    packed = {}
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and id(module) in own and not (
                tied and module is model.lm_head):
            parent, _, child = name.rpartition(".")
            linear = PackedLinear(module.weight, module.bias)
            setattr(model.get_submodule(parent), child, linear)
            packed[f"{name}.weight"] = linear
    # the checkpoint file is memory-mapped as a whole, and the pages packing read stay resident
    # while any tensor still maps it: the remaining dense weights get their own memory
    for param in model.parameters():
        param.data = param.data.clone()
    return packed


def check_supported(model) -> None:
    """Refuse what this runner would silently get wrong."""
    config = text_config(model)
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        raise NotImplementedError(f"{config.model_type}: sliding-window attention layers are not "
                                  "supported by the native engine")
    decoder = decoder_of(model)
    rope_type = getattr(decoder.rotary_emb, "rope_type", "default")
    if rope_type in ("dynamic", "longrope"):
        raise NotImplementedError(f"rope_type {rope_type!r} depends on the sequence length; the "
                                  "native engine precomputes one rotary table")
    for name in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if not hasattr(decoder, name):
            raise NotImplementedError(f"{type(model).__name__} is not a Llama/Qwen2-style decoder "
                                      f"(no model.{name})")


def fused_kernels_supported(model) -> bool:
    """Whether the fused CPU kernels compute exactly what this model's modules do: silu MLPs,
    RMSNorms with `weight` and `variance_epsilon` (Qwen2/Llama style), full-width rotary, and
    a head size and grouping the attention kernel is compiled for."""
    config, decoder = text_config(model), decoder_of(model)
    attention = decoder.layers[0].self_attn
    norms = [decoder.norm] + [module for layer in decoder.layers
                              for module in (layer.input_layernorm,
                                             layer.post_attention_layernorm)]
    return (getattr(config, "hidden_act", None) == "silu"
            and all(hasattr(layer.mlp, name) for layer in decoder.layers
                    for name in ("gate_proj", "up_proj", "down_proj"))
            and all(type(norm).__name__.endswith("RMSNorm") and hasattr(norm, "variance_epsilon")
                    for norm in norms)
            and getattr(config, "partial_rotary_factor", 1.0) == 1.0
            and attention.head_dim in cpu_kernels.HEAD_DIMS
            and config.num_attention_heads // config.num_key_value_heads <= cpu_kernels.MAX_GROUP)


