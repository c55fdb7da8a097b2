"""What the adapters over external engines (vllm.py, sglang.py) share: the weight shapes of the
model's safetensors, checked weight buckets of the configured size, and the mapping of an
engine's finish reason to tandem's stop_reason."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Mapping

import torch

from tandem.multimodal import collapse_image_runs, load_image, requested_images
from tandem.rollout.base import EMBED_NAMES
from tandem.types import GenerateRequest
from tandem.weight_layout import ALIGN, plan_buckets

# an engine's finish reason -> tandem's stop_reason (vLLM's finish_reason, SGLang's "type")
STOP_REASONS = {"stop": "completed", "length": "length", "abort": "aborted"}


def stop_reason(engine: str, finish_reason: str | None) -> str:
    """The engine's finish reason as tandem's stop_reason; anything else is an engine failure."""
    if finish_reason not in STOP_REASONS:
        raise RuntimeError(f"{engine} finished a request with finish_reason={finish_reason!r}; "
                           f"expected one of {sorted(STOP_REASONS)}")
    return STOP_REASONS[finish_reason]


def with_tied_head(shapes: dict[str, tuple[int, ...]], tied_embeddings: bool
                   ) -> dict[str, tuple[int, ...]]:
    """`shapes` with a tied lm_head listed under its own name too (update streams may carry
    either): the input embedding's shape."""
    embedding = next((name for name in EMBED_NAMES if name in shapes), None)
    if tied_embeddings and embedding is not None:
        shapes.setdefault("lm_head.weight", shapes[embedding])
    return shapes


def safetensors_shapes(path: Path, tied_embeddings: bool) -> dict[str, tuple[int, ...]]:
    """HF weight name -> shape, read from the model directory's safetensors headers; a tied
    lm_head is listed under its own name too (update streams may carry either)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(file, "pt") as handle:
            shapes.update((key, tuple(handle.get_slice(key).get_shape())) for key in handle.keys())
    return with_tied_head(shapes, tied_embeddings)


def built_shapes(hf_config: Any, tied_embeddings: bool) -> dict[str, tuple[int, ...]]:
    """HF weight name -> shape of the model transformers builds from `hf_config` (on the meta
    device: no memory): the names the actor exports, where a checkpoint's differ (transformers 5
    renames a vision-language model's `model.` / `visual.` prefixes when it loads one)."""
    from transformers import AutoModelForImageTextToText

    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(hf_config)
    shapes = {name: tuple(parameter.shape) for name, parameter in model.named_parameters()}
    return with_tied_head(shapes, tied_embeddings)


def images_for_engine(request: GenerateRequest, prompt: list[int],
                      image_token_id: int | None) -> tuple[list[int], list[Any]]:
    """The prompt and images of a request for an engine that expands images itself (vLLM,
    SGLang): each image's run of pads cut to one pad (collapse_image_runs), the images read;
    a ValueError naming the request for a text model or a bad image."""
    where = f"request {request.request_id!r}"
    if image_token_id is None:
        raise ValueError(f"{where}: multi_modal_data, but this model has no vision tower; serve "
                         "a vision-language model (Qwen2-VL family) or send token ids only")
    images = [load_image(image, f"{where}, image {index}") for index, image in
              enumerate(requested_images(request.multi_modal_data, where))]
    return collapse_image_runs(prompt, image_token_id, len(images), where), images


def expansion_error(request_id: str, engine: str, expanded: int, prompt: int) -> ValueError:
    """The error of a request whose images `engine` expanded to another prompt length than the
    request's: the trainer scores the request's tokens, so the two must be one prompt."""
    return ValueError(f"request {request_id!r}: {engine} expanded the images to a prompt of "
                      f"{expanded} tokens, not the request's {prompt}; expand each "
                      "<|image_pad|> with the policy's own image processor "
                      "(tandem.multimodal.expand_image_pads)")


def checked_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]],
                    shapes: Mapping[str, tuple], bucket_bytes: int
                    ) -> list[list[tuple[str, torch.Tensor]]]:
    """The whole stream checked (empty, unknown names, wrong shapes, non-float: raised before any
    bucket is returned), CPU-contiguous, in plan_buckets' buckets of bucket_bytes
    (update_weights_bucket_megabytes) grown to the largest tensor: engines load whole tensors."""
    weights = [(name, _checked(name, tensor, shapes)) for name, tensor in named_tensors]
    if not weights:
        raise ValueError("update_weights: the stream held no tensor; stamping a new version on "
                         "the old weights would claim an update that never happened")
    room = max(bucket_bytes, ALIGN, *(t.numel() * t.element_size() for _, t in weights))
    plan = plan_buckets(((name, t.shape, t.dtype) for name, t in weights), room)
    in_order = iter(weights)  # no tensor is split, so the chunks are the weights in order
    return [[next(in_order) for _ in bucket] for bucket in plan]


def _checked(name: str, tensor: torch.Tensor, shapes: Mapping[str, tuple]) -> torch.Tensor:
    """The tensor, CPU-contiguous, if the model has a weight of that name and shape."""
    if name not in shapes:
        raise ValueError(f"update_weights: unknown weight {name!r} (expected HF names such "
                         f"as {next(iter(shapes))!r})")
    if tuple(tensor.shape) != tuple(shapes[name]):
        raise ValueError(f"update_weights: {name!r} has shape {tuple(tensor.shape)}, the "
                         f"model expects {tuple(shapes[name])}")
    if not tensor.is_floating_point():
        raise TypeError(f"update_weights: {name!r} has dtype {tensor.dtype}; weights must be "
                        "floating point")
    return tensor.detach().to("cpu").contiguous()
