"""A vision-language model's training forward inputs (Qwen2-VL family; docs/training.md,
"Images"): the token embeddings with each sample's image tokens replaced by the vision tower's
embeddings of its images, and each sample's 3-D rotary positions from the model's own
`get_rope_index`, exactly as the engine computed them at rollout (rollout/engine/vision.py):
the tower runs on one sample's images per call, as the engine runs it per sequence, so the
embeddings are the engine's bit for bit on one machine.

Packed rows get positions [4, 1, T] (the per-sequence text positions first, which transformers
reads for packing, then t, h, w); padded rows [3, B, W] with the attention mask.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from tandem.batch.jagged import field_lengths, field_values
from tandem.multimodal import image_runs, image_types
from tandem.training.export import named_weights


def is_vision_batch(batch: TensorDict) -> bool:
    """Whether the batch carries images (pixel_values / image_grid_thw fields)."""
    return "pixel_values" in batch.keys()


def vision_tower_names(model: torch.nn.Module) -> set[str]:
    """The export names (training/export.py) of a vision-language model's vision tower: its
    parameters and persistent buffers; a ValueError for a model without one."""
    tower = getattr(getattr(_base(model), "model", None), "visual", None)
    if tower is None:
        raise ValueError(f"{type(_base(model)).__name__} has no vision tower (model.visual); "
                         "actor.freeze_vision_tower is for vision-language models")
    inside = {id(tensor) for tensor in [*tower.parameters(), *tower.buffers()]}
    return {name for name, tensor in named_weights(model) if id(tensor) in inside}


def _samples(batch: TensorDict) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(token ids [L_i], pixel values [patches_i, D], grids [images_i, 3]) of every sample."""
    ids = field_values(batch["input_ids"]).split(field_lengths(batch["input_ids"]).tolist())
    pixels = field_values(batch["pixel_values"]).split(
        field_lengths(batch["pixel_values"]).tolist())
    grids = field_values(batch["image_grid_thw"]).split(
        field_lengths(batch["image_grid_thw"]).tolist())
    return list(zip(ids, pixels, grids))


def _base(model: torch.nn.Module) -> torch.nn.Module:
    """The HF model for conditional generation (under a peft wrapper when training LoRA)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def sample_positions(model: torch.nn.Module, ids: torch.Tensor, grid: torch.Tensor
                     ) -> torch.Tensor:
    """[3, L] rotary positions of one sequence: the model's get_rope_index with its images,
    t = h = w = the index without."""
    if not len(grid):
        return torch.arange(len(ids), device=ids.device).expand(3, -1)
    model = _base(model)
    types = image_types(len(ids), _runs(model, ids, grid)).to(ids.device)
    positions, _ = model.model.get_rope_index(ids[None], types[None], image_grid_thw=grid)
    return positions[:, 0]


def _runs(model: torch.nn.Module, ids: torch.Tensor, grid: torch.Tensor
          ) -> list[tuple[int, int]]:
    """The image runs of one sample: its first len(grid) runs of image tokens (a sampled image
    token after them is a plain token, as in the engine)."""
    return image_runs(ids.tolist(), model.config.image_token_id, len(grid), "vision batch")


def _image_mask(model: torch.nn.Module, samples: list, input_ids: torch.Tensor,
                attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Where the images' tokens are in the layout of `input_ids` (packed [1, T], or padded
    [B, W] whose valid tokens `attention_mask` marks)."""
    per_sample = [image_types(len(ids), _runs(model, ids, grid)).bool() if len(grid) else
                  torch.zeros(len(ids), dtype=torch.bool) for ids, _, grid in samples]
    if attention_mask is None:
        return torch.cat(per_sample)[None].to(input_ids.device)
    mask = torch.zeros(input_ids.shape, dtype=torch.bool, device=input_ids.device)
    valid = attention_mask.bool()
    for row, part in enumerate(per_sample):
        mask[row, valid[row]] = part.to(input_ids.device)
    return mask


def vision_inputs(model: torch.nn.Module, batch: TensorDict, input_ids: torch.Tensor,
                  position_ids: torch.Tensor, attention_mask: torch.Tensor | None
                  ) -> dict[str, torch.Tensor]:
    """inputs_embeds and position_ids for the layout of `input_ids` (packed [1, T] with no mask,
    or padded [B, W] with `attention_mask`), in place of input_ids and the 1-D positions."""
    device = input_ids.device
    samples = _samples(batch)
    model = _base(model)
    embeds = model.get_input_embeddings()(input_ids)
    features = [model.model.get_image_features(pixels.to(device), grid.to(device)).pooler_output
                for _, pixels, grid in samples if len(grid)]
    if features:
        rows = torch.cat([part for parts in features for part in parts]).to(embeds.dtype)
        image = _image_mask(model, samples, input_ids, attention_mask)[..., None]
        if int(image.sum()) != rows.shape[0]:
            raise ValueError(f"vision batch: {int(image.sum())} image tokens for {rows.shape[0]} "
                             "image embeddings; the samples' prompts and images disagree")
        embeds = embeds.masked_scatter(image, rows)
    positions = [sample_positions(model, ids.to(device), grid.to(device))
                 for ids, _, grid in samples]
    if attention_mask is None:  # packed: text positions, then (t, h, w)
        spatial = torch.cat(positions, dim=1)[:, None]
        return {"inputs_embeds": embeds,
                "position_ids": torch.cat([position_ids[None], spatial]).to(device)}
    grid3 = torch.zeros(3, *input_ids.shape, dtype=torch.long, device=device)
    valid = attention_mask.bool()
    for row, part in enumerate(positions):
        grid3[:, row, valid[row]] = part
    return {"inputs_embeds": embeds, "position_ids": grid3}
