"""Chunked log-probs and entropy from hidden states equal the full-logits ones (values and
gradients) and never hold the full [tokens, vocab] logits."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM

from tandem.models.tiny import TinyModelSpec, build_tiny_model
from tandem.training.forward import actor_forward, token_entropy, token_log_probs
from tandem.training.lm_head import chunk_tokens, chunked_log_probs, plain_linear_head

from test_training_forward import mixed_batch

EPS = torch.finfo(torch.float32).eps


def bound(reference: torch.Tensor, reduction_length: int) -> float:
    """Higham's worst case for a sum of n fp32 terms, n * eps * sum |terms|, with the largest
    reference magnitude standing in for sum |terms| (both sides sum the same terms, only the
    order differs), plus 16 eps of headroom for logsumexp/softmax."""
    return (reduction_length + 16) * EPS * max(float(reference.detach().abs().max()), 1.0)


class LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an op produces."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(value, torch.Tensor):
                self.largest = max(self.largest, value.numel())
        return out


def full_reference(hidden, head, labels, temperature):
    logits = head(hidden)
    return token_log_probs(logits, labels, temperature), token_entropy(logits, temperature)


@pytest.mark.parametrize("tokens_per_chunk", [1, 5, 37, 64])
def test_chunked_equals_full_values_and_gradients(tokens_per_chunk):
    torch.manual_seed(0)
    tokens, width, vocab = 37, 16, 1000
    hidden = (torch.randn(tokens, width) * 2).requires_grad_()
    head = torch.nn.Linear(width, vocab)
    labels = torch.randint(0, vocab, (tokens,))
    weights_lp, weights_ent = torch.randn(tokens), torch.randn(tokens)

    full_lp, full_ent = full_reference(hidden, head, labels, 0.7)
    expected = torch.autograd.grad((weights_lp * full_lp).sum() + (weights_ent * full_ent).sum(),
                                   (hidden, head.weight, head.bias))
    lp, ent = chunked_log_probs(hidden, head, labels, 0.7, "grad", tokens_per_chunk)
    got = torch.autograd.grad((weights_lp * lp).sum() + (weights_ent * ent).sum(), (hidden, head.weight, head.bias))

    assert (lp - full_lp).abs().max() <= bound(full_lp, width)
    assert (ent - full_ent).abs().max() <= bound(full_ent, width)
    # hidden's gradient sums over the vocabulary, the head's over the tokens
    for name, a, b, n in zip(("hidden", "weight", "bias"), got, expected, (vocab, tokens, tokens)):
        assert (a - b).abs().max() <= bound(b, n), name
        assert b.abs().max() > 1e-3, name  # not vacuous


def test_detached_entropy_has_no_gradient_and_log_probs_still_do():
    hidden = torch.randn(6, 8, requires_grad=True)
    head = torch.nn.Linear(8, 50)
    lp, ent = chunked_log_probs(hidden, head, torch.zeros(6, dtype=torch.long), entropy="detached",
                                tokens_per_chunk=4)
    assert lp.requires_grad and not ent.requires_grad
    assert chunked_log_probs(hidden, head, torch.zeros(6, dtype=torch.long))[1] is None
    with pytest.raises(ValueError, match="entropy='yes'"):
        chunked_log_probs(hidden, head, torch.zeros(6, dtype=torch.long), entropy="yes")


def test_chunked_never_holds_the_full_logits():
    tokens, width, vocab, per_chunk = 64, 8, 4096, 8
    hidden = torch.randn(tokens, width, requires_grad=True)
    head = torch.nn.Linear(width, vocab)
    labels = torch.randint(0, vocab, (tokens,))
    with LargestTensor() as chunked:
        lp, ent = chunked_log_probs(hidden, head, labels, 1.0, "grad", per_chunk)
        (lp.sum() + ent.sum()).backward()
    with LargestTensor() as full:
        lp, ent = full_reference(hidden, head, labels, 1.0)
        (lp.sum() + ent.sum()).backward()
    assert full.largest >= tokens * vocab
    # the head's weight (and its gradient) is the largest tensor left: vocab x width
    assert chunked.largest <= max(per_chunk * vocab, vocab * width)


def test_chunk_size_from_the_byte_budget():
    assert chunk_tokens(49152, 64 << 20) == (64 << 20) // (3 * 4 * 49152)  # 113 tokens for SmolLM2
    assert chunk_tokens(10**9, 1) == 1


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def model(request):
    path = build_tiny_model(TinyModelSpec(architecture=request.param))
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")


@pytest.mark.parametrize("use_remove_padding", [True, False])
def test_actor_forward_chunked_equals_full_logits(model, use_remove_padding):
    assert plain_linear_head(model) is model.get_output_embeddings()
    batch = mixed_batch()
    results = {}
    for name, chunk_bytes in (("full", None), ("chunked", 3 * 4 * model.config.vocab_size * 4)):  # 4 tokens
        model.zero_grad()
        out = actor_forward(model, batch, use_remove_padding, 0.7, calculate_entropy=True,
                            logits_chunk_bytes=chunk_bytes)
        (out.log_probs.sum() + 0.1 * out.entropy.sum()).backward()
        results[name] = (out.log_probs.detach(), out.entropy.detach(),
                         [p.grad.clone() for p in model.parameters()])
    (full_lp, full_ent, full_grads), (lp, ent, grads) = results["full"], results["chunked"]
    width = model.config.hidden_size
    assert (lp - full_lp).abs().max() <= bound(full_lp, width)
    assert (ent - full_ent).abs().max() <= bound(full_ent, width)
    tokens = lp.numel()
    for a, b in zip(grads, full_grads):
        assert (a - b).abs().max() <= bound(b, tokens + width)
