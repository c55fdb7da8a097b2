"""LoRA adapters into the tensor-parallel native engine (TP=2: rank 0 here, rank 1 a worker
process) against the one-rank engine on tiny fp32 models: each rank merges its slices of A and B
into its own base slices, byte-equal to the slices of the one-rank merge; greedy tokens equal and
log-probs within the float32 bound; a second adapter replaces the first; model weights become
every rank's new base; a rank refusing its slices leaves every rank on the old version."""

from __future__ import annotations

import pytest
import torch

from float_bounds import assert_within, token_logprob_bounds
from tandem.models import build_tiny_model
from tandem.rollout.engine.tensor_parallel import ShardLayout
from tandem.training.lora import iter_merged_weights
from test_engine_lora import lora_actor, merged_hf
from test_engine_tensor_parallel import GREEDY, SPECS, make, random_prompts, rank_slices, run_all

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module", params=list(SPECS))
def model_path(request):
    return build_tiny_model(SPECS[request.param])


@pytest.fixture(scope="module")
def qwen2_path():
    return build_tiny_model(SPECS["qwen2"])


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def assert_ranks_hold_slices_of(two, one, keys) -> None:
    """Every rank of `two` holds, byte for byte, its slice of what one-rank engine `one` serves
    under each HF weight name in `keys`."""
    layouts = two.runner.tensor_parallel.layout.all_ranks()
    held = rank_slices(two)
    for key in keys:
        full = one.current_weight(key)
        for rank, layout in enumerate(layouts):
            assert same_bytes(held[rank][key], layout.slice(key, full)), (rank, key)


def linear_keys(rollout, targets=ALL_TARGETS) -> list[str]:
    return [name for name in rollout.runner.full_shapes
            if name.endswith(".weight") and name.rsplit(".", 2)[-2] in targets]


def test_adapter_slices_give_the_slices_of_the_merge():
    """W_slice + B_slice @ A_slice is the slice of W + B @ A on every rank (exact in float64
    integers), column-parallel (B's rows) and row-parallel (A's columns) alike; A or B whole."""
    layout = ShardLayout(rank=0, size=2, num_heads=4, num_kv_heads=2, head_dim=4,
                         intermediate_size=24, vocab_size=50)
    shapes = {"model.layers.0.self_attn.q_proj": (16, 16),
              "model.layers.0.self_attn.k_proj": (8, 16),
              "model.layers.0.self_attn.o_proj": (16, 16), "model.layers.0.mlp.up_proj": (24, 16),
              "model.layers.0.mlp.down_proj": (16, 24)}
    generator = torch.Generator().manual_seed(0)
    for module, (out, inner) in shapes.items():
        w, a, b = (torch.randint(-9, 9, shape, generator=generator).double()
                   for shape in ((out, inner), (3, inner), (out, 3)))
        key = f"{module}.weight"
        for each in layout.all_ranks():
            a_part, b_part = each.adapter_slices(module, a, b)
            row_parallel = module.endswith(("o_proj", "down_proj"))
            assert (a_part is a) != row_parallel and (b_part is b) == row_parallel, module
            assert torch.equal(each.slice(key, w) + b_part @ a_part, each.slice(key, w + b @ a))


async def test_an_adapter_serves_as_on_one_rank_and_each_rank_merges_its_slice(model_path):
    """All seven linears targeted (q/k/v/gate/up column-parallel, o/down row-parallel; llama-kv1's
    one KV head replicated on both ranks): same greedy tokens as TP=1 with the adapter, log-probs
    within the float32 bound, every rank's merged slice byte-equal to TP=1's merge sliced."""
    actor = lora_actor(model_path, seed=1, targets=ALL_TARGETS)
    merged = merged_hf(model_path, actor)
    prompts = random_prompts(4, merged.config.vocab_size, 3, 20, seed=3)
    one = make(model_path, 1)
    await one.update_weights(actor.export_weights(), version=1)
    reference = await run_all(one, prompts, GREEDY)
    two = make(model_path, 2)
    try:
        base = await run_all(two, prompts, GREEDY, prefix="base")
        await two.update_weights(actor.export_weights(), version=1)
        served = await run_all(two, prompts, GREEDY)
        assert_ranks_hold_slices_of(two, one, linear_keys(two))
        name = "model.layers.1.self_attn.o_proj.lora_A.weight"
        assert same_bytes(two.current_weight(name), one.current_weight(name))  # whole, as sent
    finally:
        await two.shutdown()
        await one.shutdown()
    assert [out.token_ids for out in served] == [out.token_ids for out in reference]
    assert [out.token_ids for out in served] != [out.token_ids for out in base]
    assert all(out.extra_fields["global_steps"] == 1 for out in served)
    for prompt, out, ref in zip(prompts, served, reference):
        exact, bound = token_logprob_bounds(merged, prompt, out.token_ids)
        assert_within(torch.tensor(out.log_probs), exact, bound, "TP=2 + adapter vs exact")
        assert_within(torch.tensor(out.log_probs), torch.tensor(ref.log_probs), 2 * bound,
                      "TP=2 vs TP=1 with the adapter")


async def test_a_second_adapter_replaces_the_first_and_model_weights_become_the_base(qwen2_path):
    """Each adapter merges against every rank's base: what the second leaves out goes back to
    its base slices; after a stream of model weights, the next adapter merges onto those."""
    first = lora_actor(qwen2_path, seed=2, targets=ALL_TARGETS)
    second = lora_actor(qwen2_path, seed=3, targets=("q_proj", "up_proj"))
    one, two = make(qwen2_path, 1), make(qwen2_path, 2)
    prompts = random_prompts(3, two.runner.vocab_size, 3, 12, seed=4)
    try:
        keys = linear_keys(two)
        base_slices = rank_slices(two)
        await two.update_weights(first.export_weights(), version=1)
        await two.update_weights(second.export_weights(), version=2)
        await one.update_weights(second.export_weights(), version=2)
        assert_ranks_hold_slices_of(two, one, keys)  # second alone: others back to the base
        for rank, held in enumerate(rank_slices(two)):
            for key in linear_keys(two, ("k_proj", "v_proj", "o_proj", "gate_proj", "down_proj")):
                assert same_bytes(held[key], base_slices[rank][key]), (rank, key)
        assert ([out.token_ids for out in await run_all(two, prompts, GREEDY)]
                == [out.token_ids for out in await run_all(one, prompts, GREEDY)])
        # the first actor's merged model as model weights: the new base of every rank
        for rollout in (one, two):
            await rollout.update_weights(iter_merged_weights(first.model), version=3)
            await rollout.update_weights(second.export_weights(), version=4)
        assert_ranks_hold_slices_of(two, one, keys)
        assert ([out.token_ids for out in await run_all(two, prompts, GREEDY, prefix="n")]
                == [out.token_ids for out in await run_all(one, prompts, GREEDY, prefix="n")])
    finally:
        await two.shutdown()
        await one.shutdown()


def overflowing_on_rank_one(actor, module: str, rows: slice) -> list[tuple[str, torch.Tensor]]:
    """The actor's adapter with `module`'s merge overflowing to inf in `rows` only (rank 1's
    rows of a column-parallel linear): A and B finite, so rank 0 stages it and rank 1 refuses."""
    stream = []
    for name, tensor in actor.export_weights():
        tensor = tensor.clone()
        if name == f"{module}.lora_A.weight":
            tensor = torch.full_like(tensor, 1e20)
        elif name == f"{module}.lora_B.weight":
            tensor.zero_()
            tensor[rows] = 1e20
        stream.append((name, tensor))
    return stream


async def test_a_rank_refusing_its_adapter_slices_leaves_every_rank_on_the_old_version(
        qwen2_path):
    first = lora_actor(qwen2_path, seed=5, targets=ALL_TARGETS)
    second = lora_actor(qwen2_path, seed=6, targets=("q_proj", "down_proj"))
    two = make(qwen2_path, 2)
    prompts = random_prompts(3, two.runner.vocab_size, 3, 12, seed=8)
    try:
        await two.update_weights(first.export_weights(), version=1)
        served = [out.token_ids for out in await run_all(two, prompts, GREEDY)]
        held = rank_slices(two)
        a_name = "model.layers.0.self_attn.q_proj.lora_A.weight"
        kept_a = two.current_weight(a_name)
        module = "model.layers.1.self_attn.q_proj"
        rank_one_rows = two.runner.tensor_parallel.layout.all_ranks()[1].head_rows()
        with pytest.raises(ValueError, match=r"rank\(s\) refused their slices \{1: .*NaN or inf"):
            await two.update_weights(overflowing_on_rank_one(second, module, rank_one_rows),
                                     version=2)
        wrong_shape = [(n, t[:, :-2] if n == "model.layers.0.mlp.down_proj.lora_A.weight" else t)
                       for n, t in second.export_weights()]
        half = [(n, t) for n, t in second.export_weights() if n.endswith("lora_A.weight")]
        for case, stream in {"wrong shape": wrong_shape, "half a pair": half}.items():
            with pytest.raises(ValueError):  # checked whole at rank 0, before any rank
                await two.update_weights(iter(stream), version=2)
        assert two.weight_version == 1
        for rank, (now, then) in enumerate(zip(rank_slices(two), held)):
            assert all(same_bytes(now[key], then[key]) for key in then), rank
        assert same_bytes(two.current_weight(a_name), kept_a)
        again = await run_all(two, prompts, GREEDY, prefix="again")
        assert [out.token_ids for out in again] == served
        assert all(out.extra_fields["global_steps"] == 1 for out in again)
        # a good adapter still lands, merged against the base on every rank
        await two.update_weights(second.export_weights(), version=2)
        one = make(qwen2_path, 1)
        await one.update_weights(second.export_weights(), version=2)
        assert_ranks_hold_slices_of(two, one, linear_keys(two))
        await one.shutdown()
    finally:
        await two.shutdown()
