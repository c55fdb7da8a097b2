"""Packed and dense layouts round-trip exactly; response_from_nested is the next-token slice."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.batch.jagged import field_lengths, field_values, make_field, trajectories_to_batch
from tandem.batch.layouts import from_dense, from_packed, response_from_nested, to_dense, to_packed
from tandem.batch.trajectory import Trajectory

TOKEN_FIELDS = ("prompts", "responses", "input_ids", "position_ids", "response_mask", "loss_mask",
                "rollout_log_probs")


@st.composite
def batches(draw):
    size = draw(st.integers(1, 5))
    trajectories = []
    for _ in range(size):
        prompt = draw(st.lists(st.integers(1, 999), min_size=1, max_size=7))
        response = draw(st.lists(st.integers(1, 999), min_size=0, max_size=7))
        mask = draw(st.lists(st.integers(0, 1), min_size=len(response), max_size=len(response)))
        logprobs = [draw(st.floats(-20.0, -0.125, width=32)) if m else 0.0 for m in mask]
        trajectories.append(Trajectory(prompts=torch.tensor(prompt),
                                       responses=torch.tensor(response, dtype=torch.long),
                                       response_mask=torch.tensor(mask, dtype=torch.long),
                                       rollout_log_probs=torch.tensor(logprobs, dtype=torch.float32),
                                       min_global_steps=0, max_global_steps=0))
    return trajectories_to_batch(trajectories)


def assert_same_fields(batch, other, names=TOKEN_FIELDS):
    for name in names:
        for i in range(batch.batch_size[0]):
            assert torch.equal(batch[name][i], other[name][i]), (name, i)


@settings(max_examples=30, deadline=None)
@given(batches())
def test_packed_round_trip(batch):
    packed = to_packed(batch)
    assert packed.input_ids.shape == (1, int(packed.cu_seqlens[-1]))
    starts = packed.cu_seqlens[:-1].long()
    assert packed.position_ids[0, starts].eq(0).all()  # positions restart per sequence
    assert_same_fields(batch, from_packed(packed))


@settings(max_examples=30, deadline=None)
@given(batches())
def test_dense_round_trip(batch):
    dense = to_dense(batch, pad_token_id=0)
    width = dense.prompt_width
    assert dense.attention_mask[:, width - 1].eq(1).all()  # prompts are left-padded: last column real
    if dense.responses.shape[1]:  # responses are right-padded: first column real iff non-empty
        assert torch.equal(dense.attention_mask[:, width].bool(), field_lengths(batch["responses"]) > 0)
    assert torch.equal(dense.input_ids, torch.cat([dense.prompts, dense.responses], 1))
    assert_same_fields(batch, from_dense(dense))
    assert_same_fields(batch, from_dense(to_dense(from_packed(to_packed(batch)), pad_token_id=7)))


def test_dense_layout_matches_the_seed_shapes():
    batch = trajectories_to_batch([
        Trajectory(prompts=torch.tensor([11, 12, 13]), responses=torch.tensor([21, 22, 31, 32, 23]),
                   response_mask=torch.tensor([1, 1, 0, 0, 1]),
                   rollout_log_probs=torch.tensor([-1.0, -2.0, 0.0, 0.0, -3.0]),
                   min_global_steps=0, max_global_steps=0),
        Trajectory(prompts=torch.tensor([14]), responses=torch.tensor([24, 25]),
                   response_mask=torch.tensor([1, 1]),
                   rollout_log_probs=torch.tensor([-4.0, -5.0]), min_global_steps=0, max_global_steps=0),
    ])
    dense = to_dense(batch, pad_token_id=0)
    assert dense.prompts.tolist() == [[11, 12, 13], [0, 0, 14]]
    assert dense.responses.tolist() == [[21, 22, 31, 32, 23], [24, 25, 0, 0, 0]]
    assert dense.attention_mask.tolist() == [[1] * 8, [0, 0, 1, 1, 1, 0, 0, 0]]
    assert dense.position_ids.tolist() == [list(range(8)), [0, 0, 0, 1, 2, 0, 0, 0]]
    assert dense.response_fields["response_mask"].tolist() == [[1, 1, 0, 0, 1], [1, 1, 0, 0, 0]]
    assert dense.response_fields["rollout_log_probs"][1].tolist() == [-4.0, -5.0, 0.0, 0.0, 0.0]


@settings(max_examples=30, deadline=None)
@given(batches())
def test_response_from_nested_is_the_shifted_per_sequence_slice(batch):
    # a stand-in for full-sequence outputs: at position t, the id of the token at t+1 (0 at the end)
    full_values = []
    for i in range(batch.batch_size[0]):
        ids = batch["input_ids"][i]
        full_values.append(torch.cat([ids[1:], ids.new_zeros(1)]))
    lengths = field_lengths(batch["responses"])
    shifted = make_field(torch.cat(full_values), field_lengths(batch["input_ids"]))
    responses = response_from_nested(shifted, lengths)
    assert torch.equal(field_values(responses), field_values(batch["responses"]))
    for i in range(batch.batch_size[0]):
        end, r = len(full_values[i]), int(lengths[i])
        assert torch.equal(responses[i], full_values[i][end - r - 1:end - 1])


def test_group_members_gathers_indices_by_group_in_first_appearance_order():
    from tandem.batch.layouts import group_members

    assert group_members([4, 1, 4, 7, 1]) == [[0, 2], [1, 4], [3]]
    assert group_members([4, 1, 4, 7, 1], [4, 3, 2]) == [[4], [3], [2]]
