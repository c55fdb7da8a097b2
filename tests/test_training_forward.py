"""Packed and padded forwards agree with each other and with one sequence at a time."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from tandem.batch.jagged import field_values, trajectories_to_batch
from tandem.batch.trajectory import Trajectory
from tandem.models.tiny import TinyModelSpec, build_tiny_model
from tandem.training import packed_attention
from tandem.training.forward import actor_forward, token_entropy, token_log_probs

EPS = torch.finfo(torch.float32).eps


def tolerance(model, reference: torch.Tensor) -> float:
    """Packed and padded run the same arithmetic in different shapes, so only summation orders
    differ. With rounding errors as a random walk, a dot product of length H errs by ~sqrt(H) eps
    relative; L decoder layers plus the LM head compound it, x4 for softmax and normalisation:
    4 (L + 1) sqrt(H) eps max|reference| (tiny models: ~8e-5; SmolLM2-135M: ~8e-3)."""
    config = model.config
    return 4 * (config.num_hidden_layers + 1) * config.hidden_size ** 0.5 * EPS * max(
        float(reference.abs().max()), 1.0)


def mixed_batch(seed=0, shapes=((3, 9), (7, 2), (1, 5), (12, 1), (4, 6))):
    generator = torch.Generator().manual_seed(seed)
    return trajectories_to_batch([
        Trajectory(prompts=torch.randint(10, 500, (p,), generator=generator),
                   responses=torch.randint(10, 500, (r,), generator=generator),
                   response_mask=torch.ones(r, dtype=torch.long), rollout_log_probs=torch.zeros(r),
                   min_global_steps=0, max_global_steps=0)
        for p, r in shapes])


@pytest.fixture(scope="module", params=[("qwen2", "sdpa"), ("llama", "sdpa"), ("qwen2", "packed"),
                                        ("llama", "packed")], ids="-".join)
def model(request):
    """The tiny models with sdpa, and with the training engine's packed_sdpa attention."""
    architecture, attention = request.param
    path = build_tiny_model(TinyModelSpec(architecture=architecture))
    implementation = packed_attention.register() if attention == "packed" else "sdpa"
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                attn_implementation=implementation).eval()


def per_sequence(model, batch, temperature=1.0):
    log_probs, entropies = [], []
    for i in range(batch.batch_size[0]):
        ids, prompt_length = batch["input_ids"][i], batch["prompts"][i].numel()
        with torch.no_grad():
            logits = model(input_ids=ids[None]).logits[0, prompt_length - 1:-1]
        log_probs.append(token_log_probs(logits, ids[prompt_length:], temperature))
        entropies.append(token_entropy(logits, temperature))
    return torch.cat(log_probs), torch.cat(entropies)


def test_packed_equals_padded_equals_per_sequence(model):
    batch = mixed_batch()
    with torch.no_grad():
        packed = actor_forward(model, batch, use_remove_padding=True, temperature=0.7, calculate_entropy=True)
        padded = actor_forward(model, batch, use_remove_padding=False, temperature=0.7, calculate_entropy=True)
    reference_log_probs, reference_entropy = per_sequence(model, batch, temperature=0.7)
    assert packed.log_probs.shape == (int(field_values(batch["responses"]).numel()),)
    lp_tol, entropy_tol = tolerance(model, reference_log_probs), tolerance(model, reference_entropy)
    assert (packed.log_probs - padded.log_probs).abs().max() <= lp_tol
    assert (packed.log_probs - reference_log_probs).abs().max() <= lp_tol
    assert (padded.log_probs - reference_log_probs).abs().max() <= lp_tol
    assert (packed.entropy - reference_entropy).abs().max() <= entropy_tol
    assert (padded.entropy - reference_entropy).abs().max() <= entropy_tol
    assert packed.field("log_probs")[0].shape == (9,)  # per-sample view [B, R_i]


def test_packed_attention_never_crosses_sequences(model):
    batch = mixed_batch()
    changed = mixed_batch()
    ids = changed["input_ids"]  # rewrite sample 1 entirely (prompt and response tokens)
    values = field_values(ids)
    start, end = int(ids.offsets()[1]), int(ids.offsets()[2])
    values[start:end] = (values[start:end] + 37) % 500
    with torch.no_grad():
        before = actor_forward(model, batch, use_remove_padding=True).field("log_probs")
        after = actor_forward(model, changed, use_remove_padding=True).field("log_probs")
    for i in (0, 2, 3, 4):  # sample 2 follows the rewritten one in the packed row
        assert torch.equal(before[i], after[i]), i
    assert not torch.equal(before[1], after[1])


def test_packed_forward_rejects_positions_that_do_not_restart():
    batch = mixed_batch(shapes=((2, 2), (3, 1)))
    field_values(batch["position_ids"])[4:] += 4  # sample 1 continues sample 0's positions
    path = build_tiny_model(TinyModelSpec())
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with pytest.raises(ValueError, match="restart at 0"):
        actor_forward(model, batch, use_remove_padding=True)


@pytest.mark.smollm2
@pytest.mark.slow
@pytest.mark.parametrize("attention", ["sdpa", "packed"])
def test_packed_equals_padded_on_smollm2(attention):
    """The Llama architecture at full size (30 layers, 576 wide, 49k vocabulary), with gradients."""
    from tandem.models.smollm2 import smollm2_available, smollm2_path

    if not smollm2_available():
        pytest.skip("needs `make smollm2`")
    implementation = packed_attention.register() if attention == "packed" else "sdpa"
    model = AutoModelForCausalLM.from_pretrained(smollm2_path(), dtype=torch.float32,
                                                 attn_implementation=implementation)
    batch = mixed_batch(shapes=((30, 20), (7, 12), (50, 3), (12, 25)))
    outputs, gradients = {}, {}
    for packed in (True, False):
        model.zero_grad()
        out = actor_forward(model, batch, use_remove_padding=packed, calculate_entropy=True)
        out.log_probs.sum().backward()
        outputs[packed] = out
        gradients[packed] = model.model.norm.weight.grad.clone()
    reference = outputs[False].log_probs.detach()
    assert (outputs[True].log_probs.detach() - reference).abs().max() <= tolerance(model, reference)
    entropy = outputs[False].entropy.detach()
    assert (outputs[True].entropy.detach() - entropy).abs().max() <= tolerance(model, entropy)
    assert (gradients[True] - gradients[False]).abs().max() <= tolerance(model, gradients[False])
