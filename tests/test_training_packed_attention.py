"""packed_sdpa: per-sequence attention over a packed row equals sdpa with the block-diagonal mask."""

import pytest
import torch
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from tandem.training import packed_attention
from tandem.training.packed_attention import packed_sdpa_attention

EPS = torch.finfo(torch.float32).eps


class Attention(nn.Module):
    """What transformers' attention functions read from the calling module."""

    def __init__(self, heads: int, kv_heads: int):
        super().__init__()
        self.is_causal = True
        self.num_key_value_groups = heads // kv_heads


def block_diagonal_causal(lengths: list[int]) -> torch.Tensor:
    """[1, 1, T, T] bool: token i sees token j iff same sequence and j <= i."""
    sequence = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    position = torch.arange(sum(lengths))
    return ((sequence[:, None] == sequence[None, :]) & (position[None, :] <= position[:, None]))[None, None]


def tolerance(reference: torch.Tensor, dim: int, width: int) -> float:
    """Both sides compute softmax(q k^T) v in fp32 in different orders and shapes: each output
    sums `dim` products for the scores and `width` weighted values, so a worst-case bound is
    (dim + width) eps per unit of magnitude, x8 for exp, normalisation and the gradients' chains."""
    return 8 * (dim + width) * EPS * max(float(reference.abs().max()), 1.0)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)])
def test_packed_sdpa_equals_masked_sdpa_values_and_gradients(heads, kv_heads):
    lengths, dim = [5, 1, 9, 3, 7], 16
    total = sum(lengths)
    generator = torch.Generator().manual_seed(0)
    module = Attention(heads, kv_heads)
    inputs = [torch.randn(1, h, total, dim, generator=generator, requires_grad=True)
              for h in (heads, kv_heads, kv_heads)]
    upstream = torch.randn(1, total, heads, dim, generator=generator)
    bounds = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)

    results = {}
    for name in ("packed", "masked"):
        for tensor in inputs:
            tensor.grad = None
        if name == "packed":
            out, weights = packed_sdpa_attention(module, *inputs, None, cu_seq_lens_q=bounds, scaling=dim ** -0.5)
            assert weights is None
        else:
            out, _ = sdpa_attention_forward(module, *inputs, block_diagonal_causal(lengths), scaling=dim ** -0.5)
        (out * upstream).sum().backward()
        results[name] = (out.detach(), [tensor.grad.clone() for tensor in inputs])

    out, gradients = results["packed"]
    reference, reference_gradients = results["masked"]
    assert out.shape == (1, total, heads, dim)
    assert (out - reference).abs().max() <= tolerance(reference, dim, max(lengths))
    for gradient, expected in zip(gradients, reference_gradients):
        assert (gradient - expected).abs().max() <= tolerance(expected, dim, max(lengths))


def test_packed_sdpa_never_mixes_sequences():
    dim = 8
    generator = torch.Generator().manual_seed(1)
    query, key, value = (torch.randn(1, 2, 10, dim, generator=generator) for _ in range(3))
    bounds = torch.tensor([0, 4, 10], dtype=torch.int32)  # sequences of 4 and 6 tokens
    before, _ = packed_sdpa_attention(Attention(2, 2), query, key, value, None, cu_seq_lens_q=bounds)
    key[:, :, 4:] += 5.0  # the second sequence's keys and values only
    value[:, :, 4:] -= 3.0
    after, _ = packed_sdpa_attention(Attention(2, 2), query, key, value, None, cu_seq_lens_q=bounds)
    assert torch.equal(before[:, :4], after[:, :4])
    assert not torch.allclose(before[:, 4:], after[:, 4:])


def test_without_boundaries_it_is_plain_sdpa():
    generator = torch.Generator().manual_seed(2)
    query, key, value = (torch.randn(2, 2, 6, 8, generator=generator) for _ in range(3))
    mask = torch.ones(2, 1, 6, 6, dtype=torch.bool).tril()
    out, _ = packed_sdpa_attention(Attention(2, 2), query, key, value, mask)
    expected, _ = sdpa_attention_forward(Attention(2, 2), query, key, value, mask)
    assert torch.equal(out, expected)


def test_boundaries_that_do_not_cover_the_row_are_refused():
    query = key = value = torch.zeros(1, 2, 10, 8)
    with pytest.raises(ValueError, match="cu_seq_lens_q ends at 9 but the packed row holds 10"):
        packed_sdpa_attention(Attention(2, 2), query, key, value, None,
                              cu_seq_lens_q=torch.tensor([0, 4, 9], dtype=torch.int32))


def test_training_engine_packed_forward_attends_per_sequence(monkeypatch):
    """The engine loads its models with packed_sdpa and a packed forward hands every layer the
    sequence boundaries, so no layer attends over the whole masked row."""
    from tandem.config.schema import TandemConfig
    from tandem.models.tiny import TinyModelSpec, build_tiny_model
    from tandem.training.engine import TrainingEngine
    from test_training_forward import mixed_batch

    config = TandemConfig()
    config.model.path = str(build_tiny_model(TinyModelSpec(architecture="llama")))
    engine = TrainingEngine.from_config(config, "reference")
    assert engine.model.config._attn_implementation == packed_attention.NAME
    calls = []

    def spy(module, query, key, value, attention_mask, cu_seq_lens_q=None, **kwargs):
        calls.append(None if cu_seq_lens_q is None else cu_seq_lens_q.tolist())
        return packed_sdpa_attention(module, query, key, value, attention_mask, cu_seq_lens_q, **kwargs)

    monkeypatch.setitem(packed_attention.AttentionInterface._global_mapping, packed_attention.NAME, spy)
    batch = mixed_batch()
    engine.compute_log_prob(batch)
    lengths = [3 + 9, 7 + 2, 1 + 5, 12 + 1, 4 + 6]  # prompt + response of each sample
    expected = torch.tensor([0] + lengths).cumsum(0).tolist()
    assert calls == [expected] * engine.model.config.num_hidden_layers
