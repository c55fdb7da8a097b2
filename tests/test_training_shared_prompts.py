"""Shared-prompt packed forwards (GRPO's n samples of a prompt compute it once) equal the plain
packed forward: log-probs, entropy, values and every parameter's gradient."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from tandem.batch.jagged import trajectories_to_batch
from tandem.batch.layouts import to_packed, to_shared_prompts
from tandem.batch.trajectory import Trajectory
from tandem.models.tiny import TinyModelSpec, build_tiny_model
from tandem.training import packed_attention
from tandem.training.critic import ValueModel
from tandem.training.forward import actor_forward, critic_forward

EPS = torch.finfo(torch.float32).eps


def tolerance(model, reference: torch.Tensor, tokens: int = 1) -> float:
    """Both layouts run the same arithmetic in different shapes and orders (a shared prompt's
    gradient is summed over its samples before the layers' backward instead of after). With
    rounding as a random walk a length-H dot product errs by ~sqrt(H) eps relative, compounded
    over L layers and the head, x4 for softmax and normalisation; a weight gradient sums over
    `tokens` tokens, one more sqrt(tokens). (float32: HF's RMSNorm and the log-prob head compute
    in float32 whatever the model's dtype.)"""
    config = model.config
    return 4 * (config.num_hidden_layers + 1) * (config.hidden_size * tokens) ** 0.5 * EPS * max(
        float(reference.detach().abs().max()), 1.0)


def grouped_batch(seed=0):
    """Two prompts with 3 samples each, one alone, samples of a group interleaved with others;
    responses of 1 to 9 tokens."""
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(10, 500, (length,), generator=generator) for length in (7, 4, 11)]
    order = [(0, 5), (1, 1), (0, 9), (2, 3), (1, 6), (0, 2), (1, 4)]
    return trajectories_to_batch([
        Trajectory(prompts=prompts[p].clone(), responses=torch.randint(10, 500, (r,), generator=generator),
                   response_mask=torch.ones(r, dtype=torch.long), rollout_log_probs=torch.zeros(r),
                   min_global_steps=0, max_global_steps=0)
        for p, r in order])


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request):
    path = build_tiny_model(TinyModelSpec(architecture=request.param))
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64,
                                                attn_implementation=packed_attention.register())


def test_shared_layout_holds_each_prompt_once():
    batch = grouped_batch()
    shared = to_shared_prompts(batch)
    plain = to_packed(batch)
    assert shared.input_ids.shape[1] == plain.input_ids.shape[1] - 2 * 7 - 2 * 4
    # prompt 0 (7 tokens), then the three responses of its group, each positioned after the prompt
    assert shared.position_ids[0, :7 + 5 + 9 + 2].tolist() == (
        list(range(7)) + list(range(7, 12)) + list(range(7, 16)) + list(range(7, 9)))
    assert shared.rows.count == 7 and shared.rows.width == int(plain.cu_seqlens.diff().max())


def test_no_shared_prompt_gives_none():
    generator = torch.Generator().manual_seed(1)
    batch = trajectories_to_batch([
        Trajectory(prompts=torch.randint(10, 500, (5,), generator=generator), responses=torch.tensor([3, 4]),
                   response_mask=torch.ones(2, dtype=torch.long), rollout_log_probs=torch.zeros(2),
                   min_global_steps=0, max_global_steps=0) for _ in range(3)])
    assert to_shared_prompts(batch) is None


@pytest.mark.parametrize("entropy", [False, True])
def test_shared_equals_plain_values_and_gradients(model, entropy):
    batch = grouped_batch()
    results = {}
    for share in (False, True):
        model.zero_grad(set_to_none=True)
        out = actor_forward(model, batch, True, 0.9, calculate_entropy=entropy, share_prompts=share)
        loss = (out.log_probs * torch.linspace(-1, 1, out.log_probs.numel())).sum()
        if entropy:
            loss = loss + out.entropy.sum()
        loss.backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        results[share] = (out, grads)
    (plain, plain_grads), (shared, shared_grads) = results[False], results[True]
    assert torch.equal(plain.response_lengths, shared.response_lengths)
    torch.testing.assert_close(shared.log_probs, plain.log_probs, rtol=0,
                               atol=tolerance(model, plain.log_probs))
    if entropy:
        torch.testing.assert_close(shared.entropy, plain.entropy, rtol=0, atol=tolerance(model, plain.entropy))
    assert plain_grads.keys() == shared_grads.keys() and len(plain_grads) > 10
    tokens = int(to_packed(batch).cu_seqlens[-1])
    for name, grad in plain_grads.items():
        torch.testing.assert_close(shared_grads[name], grad, rtol=0, atol=tolerance(model, grad, tokens), msg=name)


def test_shared_critic_values_equal_plain(model):
    critic = ValueModel.from_pretrained(model.name_or_path, torch.float32, packed_attention.NAME, seed=0)
    batch = grouped_batch(seed=2)
    with torch.no_grad():
        plain = critic_forward(critic, batch, True, share_prompts=False).values
        shared = critic_forward(critic, batch, True, share_prompts=True).values
    torch.testing.assert_close(shared, plain, rtol=0, atol=tolerance(model, plain))


def test_other_attention_ignores_share_prompts():
    """With plain sdpa the rows cannot be honoured: the forward takes the plain packed layout."""
    path = build_tiny_model(TinyModelSpec(architecture="llama"))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    batch = grouped_batch()
    with torch.no_grad():
        shared = actor_forward(model, batch, True, share_prompts=True).log_probs
        plain = actor_forward(model, batch, True, share_prompts=False).log_probs
    assert torch.equal(shared, plain)


def test_micro_batches_keep_prompt_groups_together():
    from tandem.batch.jagged import field_lengths
    from tandem.batch.layouts import prompt_groups
    from tandem.training.micro_batches import split_by_token_budget

    batch = grouped_batch()  # groups: samples {0, 2, 5} (prompt 7), {1, 4, 6} (prompt 4), {3} (prompt 11)
    groups = prompt_groups(batch)
    assert groups.tolist() == [0, 1, 0, 3, 1, 0, 1]
    lengths = field_lengths(batch["input_ids"])  # 12, 5, 16, 14, 10, 9, 8
    # a group costs its samples' whole lengths (attention holds each sample's prompt):
    # group 0 37 tokens, group 1 23, sample 3 14; whole groups, never a group over two bins
    bins = split_by_token_budget(lengths, 37, groups)
    assert sorted(map(tuple, (b.tolist() for b in bins))) == [(0, 2, 5), (1, 3, 4, 6)]
    # over budget, a group splits into parts that fit
    bins = split_by_token_budget(lengths, 17, groups)
    assert sorted(torch.cat(bins).tolist()) == list(range(7))
    assert all(int(lengths[b].sum()) <= 17 for b in bins)
    # by sample (no groups), first-fit longest first mixes the groups
    mixed = split_by_token_budget(lengths, 37)
    assert any(len(set(groups[b].tolist())) > 1 for b in mixed)


@pytest.mark.parametrize("share", [False, True])
def test_sliding_window_layers_keep_their_window(tmp_path, share):
    """packed_sdpa honours a layer's sliding window (it used to attend causally over the whole
    row: log-probs off by ~0.2 on this model): equal to HF's sdpa one sequence at a time."""
    from transformers import Qwen2Config

    from tandem.training.forward import token_log_probs

    config = Qwen2Config(vocab_size=600, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True,
                         sliding_window=4, max_window_layers=0, layer_types=["sliding_attention"] * 2)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=packed_attention.register()).eval()
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa").eval()
    unwindowed = AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="sdpa", use_sliding_window=False,
        layer_types=["full_attention"] * 2).eval()
    batch = grouped_batch()
    with torch.no_grad():
        out = actor_forward(model, batch, True, share_prompts=share).log_probs
        expected, unmasked = [], []
        for i in range(batch.batch_size[0]):
            ids, prompt = batch["input_ids"][i], batch["prompts"][i].numel()
            expected.append(token_log_probs(reference(input_ids=ids[None]).logits[0, prompt - 1:-1], ids[prompt:]))
            unmasked.append(token_log_probs(unwindowed(input_ids=ids[None]).logits[0, prompt - 1:-1], ids[prompt:]))
    expected, unmasked = torch.cat(expected), torch.cat(unmasked)
    assert float((expected - unmasked).abs().max()) > 100 * tolerance(model, expected)  # the window matters
    torch.testing.assert_close(out, expected, rtol=0, atol=tolerance(model, expected))
