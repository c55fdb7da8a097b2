"""list[Trajectory] -> one TensorDict batch of unpadded fields (DESIGN §1, seed §7.1).

Every field of a batch is either a per-sample scalar [B] or a token-level field [B, L_i]. A
token-level field is a jagged nested tensor (torch.nested, layout=torch.jagged) when the
lengths differ and a plain stacked [B, L] tensor when they are all equal; the helpers below
(`field_lengths`, `field_values`, `make_field`) read and build both the same way.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from tensordict import NonTensorStack, TensorDict

from tandem.batch.trajectory import Trajectory
from tandem.multimodal import ImageInputs
from tandem.types import KeptSets

TOKEN_FIELDS = ("prompts", "responses", "input_ids", "position_ids", "response_mask", "loss_mask",
                "rollout_log_probs", "response_versions")
NON_TENSOR_FIELDS = ("uid", "data_source", "stop_reason", "ground_truth", "reward_extra", "metadata")
# sampling-mask replay: kept_counts [B, R_i] int32 (response-aligned) and kept_token_ids [B, K_i]
# int32 (K_i = sum of the sample's kept_counts), present when some trajectory has kept_sets
KEPT_SET_FIELDS = ("kept_counts", "kept_token_ids")
# a vision-language batch: pixel_values [B, patches_i, D] float32 and image_grid_thw
# [B, images_i, 3] int64 (0 rows: a sample without images), present when some trajectory has them
IMAGE_FIELDS = ("pixel_values", "image_grid_thw")


def make_field(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Concatenated values [sum L_i, ...] + lengths [B] -> stacked [B, L] if all equal, else jagged."""
    lengths = torch.as_tensor(lengths, dtype=torch.long)
    if values.shape[0] != int(lengths.sum()):
        raise ValueError(f"make_field: {values.shape[0]} values but lengths sum to {int(lengths.sum())}")
    if lengths.numel() > 0 and bool((lengths == lengths[0]).all()):
        return values.reshape(lengths.numel(), int(lengths[0]), *values.shape[1:])
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.long, device=values.device)
    offsets[1:] = lengths.to(values.device).cumsum(0)  # nested tensors keep both on one device
    return torch.nested.nested_tensor_from_jagged(values, offsets)


def field_lengths(field: torch.Tensor) -> torch.Tensor:
    """Per-sample lengths [B] of a token-level field, jagged or stacked."""
    if field.is_nested:
        return field.offsets().diff()
    return torch.full((field.shape[0],), field.shape[1], dtype=torch.long)


def field_offsets(field: torch.Tensor) -> torch.Tensor:
    """Start offsets [B+1] of each sample inside `field_values(field)`."""
    offsets = torch.zeros(field.shape[0] + 1, dtype=torch.long)
    offsets[1:] = field_lengths(field).cumsum(0)
    return offsets


def field_values(field: torch.Tensor) -> torch.Tensor:
    """All samples' tokens back to back: [sum L_i, ...] (a view where possible)."""
    if field.is_nested:
        return field.values()
    return field.reshape(-1, *field.shape[2:])


def padded_field(field: torch.Tensor, pad_value: float = 0) -> torch.Tensor:
    """A token-level field right-padded to [B, max L_i] with pad_value (keeps autograd)."""
    if field.is_nested:
        # without output_size, jagged-layout nested tensors pad to the *sum* of lengths
        lengths = field_lengths(field)
        width = int(lengths.max()) if lengths.numel() else 0
        return field.to_padded_tensor(pad_value, output_size=(len(lengths), width, *field.shape[2:]))
    return field


def ragged_ranges(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Concatenation of range(starts[i], starts[i] + lengths[i]) over i: [sum lengths] int64."""
    lengths = lengths.long()
    within = (torch.arange(int(lengths.sum()), device=lengths.device)
              - torch.repeat_interleave(lengths.cumsum(0) - lengths, lengths))
    return torch.repeat_interleave(starts.long().to(lengths.device), lengths) + within


def non_tensor_list(batch: TensorDict, key: str) -> list[Any]:
    """A per-sample non-tensor field (uid, data_source, ...) as a plain list of length B."""
    return list(batch.get(key).tolist())


def _stack_or_nest(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    lengths = torch.tensor([t.shape[0] for t in tensors], dtype=torch.long)
    return make_field(torch.cat(list(tensors)), lengths)


def trajectories_to_batch(trajectories: Sequence[Trajectory]) -> TensorDict:
    """Build the jagged batch: token ids, positions, masks and response_versions int64, logprobs
    float32; `reward` [B] float32 only when every trajectory has one (some missing is an error)."""
    if not trajectories:
        raise ValueError("trajectories_to_batch: got no trajectories; a batch needs at least one")
    columns: dict[str, list[torch.Tensor]] = {name: [] for name in TOKEN_FIELDS}
    for trajectory in trajectories:
        columns["prompts"].append(trajectory.prompts.long())
        columns["responses"].append(trajectory.responses.long())
        columns["input_ids"].append(trajectory.input_ids.long())
        columns["position_ids"].append(trajectory.position_ids.long())
        columns["response_mask"].append(trajectory.response_mask.long())
        columns["loss_mask"].append(trajectory.loss_mask.long())
        columns["rollout_log_probs"].append(trajectory.rollout_log_probs.float())
        columns["response_versions"].append(trajectory.response_versions.long())
    fields: dict[str, torch.Tensor] = {name: _stack_or_nest(column) for name, column in columns.items()}
    if any(t.kept_sets is not None for t in trajectories):
        kept = [t.kept_sets or KeptSets.none(t.responses.shape[0]) for t in trajectories]
        fields["kept_counts"] = _stack_or_nest([k.counts.int() for k in kept])
        fields["kept_token_ids"] = _stack_or_nest([k.ids.int() for k in kept])

    if any(t.images is not None for t in trajectories):  # a vision-language batch
        fields.update(image_fields([t.images for t in trajectories]))

    rewards = [t.reward for t in trajectories]
    if any(r is not None for r in rewards):
        missing = [i for i, r in enumerate(rewards) if r is None]
        if missing:
            raise ValueError(f"trajectories_to_batch: trajectories {missing[:8]} have no reward while "
                             "others do; score every trajectory before batching, or none")
        fields["reward"] = torch.tensor(rewards, dtype=torch.float32)
    fields["min_global_steps"] = torch.tensor([t.min_global_steps for t in trajectories], dtype=torch.long)
    fields["max_global_steps"] = torch.tensor([t.max_global_steps for t in trajectories], dtype=torch.long)
    fields["num_turns"] = torch.tensor([t.num_turns for t in trajectories], dtype=torch.long)
    fields["session_id"] = torch.tensor([t.session_id for t in trajectories], dtype=torch.long)
    fields["is_padding"] = torch.tensor([t.is_padding for t in trajectories], dtype=torch.bool)

    batch = TensorDict(fields, batch_size=[len(trajectories)])
    for name in NON_TENSOR_FIELDS:
        batch[name] = NonTensorStack.from_list([getattr(t, name) for t in trajectories])
    return batch


def image_fields(images: Sequence[ImageInputs | None]) -> dict[str, torch.Tensor]:
    """Each sample's pixel values [patches_i, D] and image grids [images_i, 3] as jagged fields
    (none for a sample without images)."""
    width = next(inputs.pixel_values.shape[1] for inputs in images if inputs is not None)
    pixels = [inputs.pixel_values.float() if inputs is not None else torch.zeros(0, width)
              for inputs in images]
    grids = [inputs.grid_thw.long() if inputs is not None else torch.zeros(0, 3, dtype=torch.long)
             for inputs in images]
    return {"pixel_values": _stack_or_nest(pixels), "image_grid_thw": _stack_or_nest(grids)}


def batch_to_trajectories(batch: TensorDict) -> list[Trajectory]:
    """The inverse of `trajectories_to_batch` (for tests, debugging and re-batching)."""
    per_sample = {name: batch[name].unbind(0) for name in ("prompts", "responses", "response_mask",
                                                          "rollout_log_probs", "response_versions")}
    extras = {name: non_tensor_list(batch, name) for name in NON_TENSOR_FIELDS if name in batch.keys()}
    if "kept_counts" in batch.keys():
        extras["kept_sets"] = [KeptSets(counts, ids) for counts, ids in zip(
            batch["kept_counts"].unbind(0), batch["kept_token_ids"].unbind(0))]
    if "pixel_values" in batch.keys():
        extras["images"] = [None if not len(grid) else ImageInputs(pixels, grid, [], [])
                            for pixels, grid in zip(batch["pixel_values"].unbind(0),
                                                    batch["image_grid_thw"].unbind(0))]
    out = []
    for i in range(batch.batch_size[0]):
        out.append(Trajectory(
            prompts=per_sample["prompts"][i], responses=per_sample["responses"][i],
            response_mask=per_sample["response_mask"][i],
            rollout_log_probs=per_sample["rollout_log_probs"][i],
            response_versions=per_sample["response_versions"][i],
            min_global_steps=int(batch["min_global_steps"][i]),
            max_global_steps=int(batch["max_global_steps"][i]),
            session_id=int(batch["session_id"][i]), num_turns=int(batch["num_turns"][i]),
            reward=float(batch["reward"][i]) if "reward" in batch.keys() else None,
            is_padding=bool(batch["is_padding"][i]),
            **{name: values[i] for name, values in extras.items()}))
    return out


def concat_batches(batches: Sequence[TensorDict]) -> TensorDict:
    """Concatenate batches along samples; token fields become jagged when lengths now differ."""
    if not batches:
        raise ValueError("concat_batches: got no batches")
    keys = list(batches[0].keys())
    for other in batches[1:]:
        if set(other.keys()) != set(keys):
            raise ValueError(f"concat_batches: field sets differ: {sorted(keys)} vs {sorted(other.keys())}")
    out: dict[str, Any] = {}
    non_tensor: dict[str, list[Any]] = {}
    for key in keys:
        first = batches[0].get(key)
        if isinstance(first, NonTensorStack) or not isinstance(first, torch.Tensor):
            non_tensor[key] = [item for b in batches for item in non_tensor_list(b, key)]
        elif first.is_nested or first.dim() >= 2:
            values = torch.cat([field_values(b.get(key)) for b in batches])
            lengths = torch.cat([field_lengths(b.get(key)) for b in batches])
            out[key] = make_field(values, lengths)
        else:
            out[key] = torch.cat([b.get(key) for b in batches])
    batch = TensorDict(out, batch_size=[sum(b.batch_size[0] for b in batches)])
    for key, items in non_tensor.items():
        batch[key] = NonTensorStack.from_list(items)
    return batch


def select_samples(batch: TensorDict, index: torch.Tensor | Sequence[int]) -> TensorDict:
    """Samples `index` (indices or a bool mask [B]) in that order, keeping the jagged/stacked rule."""
    index = torch.as_tensor(index)
    if index.dtype == torch.bool:
        index = index.nonzero().flatten()
    index = index.long()
    if index.numel() == 0:
        raise ValueError("select_samples: the index selects no sample")
    out: dict[str, Any] = {}
    non_tensor: dict[str, list[Any]] = {}
    for key in batch.keys():
        field = batch.get(key)
        if isinstance(field, NonTensorStack) or not isinstance(field, torch.Tensor):
            items = non_tensor_list(batch, key)
            non_tensor[key] = [items[i] for i in index.tolist()]
        elif field.is_nested or field.dim() >= 2:
            lengths = field_lengths(field)[index]
            starts = field_offsets(field)[:-1][index]
            out[key] = make_field(field_values(field)[ragged_ranges(starts, lengths)], lengths)
        else:
            out[key] = field[index]
    selected = TensorDict(out, batch_size=[index.numel()])
    for key, items in non_tensor.items():
        selected[key] = NonTensorStack.from_list(items)
    return selected
