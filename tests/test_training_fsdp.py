"""FSDP2 over gloo with 2 processes takes the same step as 1 process and exports the same weights.

Tolerances (docs/training.md): the only difference between the runs is the summation order of
the gradient reduction, so gradients agree within 1e-6. AdamW's first step, `g / (|g| + eps)`,
magnifies that difference without bound for gradient entries near eps, so the two-process weights
are compared with the one-process optimizer replayed on the two-process gradients: that differs
only by the grad-norm's summation order and float32 rounding of the update (`weight_tolerance`).
"""

import socket

import torch
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM

from tandem.algorithms.aggregation import aggregate_loss
from tandem.algorithms.policy_loss import ppo_clip_loss
from tandem.batch.jagged import field_lengths, make_field, padded_field, trajectories_to_batch
from tandem.batch.trajectory import Trajectory
from tandem.config.schema import OptimConfig
from tandem.models.tiny import TinyModelSpec, build_tiny_model
from tandem.training.critic import ValueModel

WORLD = 2
GRADIENT_TOLERANCE = 1e-6
LR = 1e-3
FLOAT32_EPS = torch.finfo(torch.float32).eps


def weight_tolerance(replayed, parameter_count):
    """Per-element bound on |two-process - replayed| weights after one step.

    The clip coefficient's relative error is at most that of the gradient norm's sum of squares
    (log2(n) roundings for a tree sum of n terms, plus the sqrt and division); the Adam direction
    moves by at most that relative amount, times lr; the update's own rounding is a few ulps of
    the weight.
    """
    norm_error = (int(parameter_count).bit_length() + 4) * FLOAT32_EPS
    return LR * norm_error + 4 * FLOAT32_EPS * replayed.abs()


def make_batch():
    generator = torch.Generator().manual_seed(0)
    shapes = ((5, 9), (3, 7), (8, 4), (2, 10))  # different lengths on each rank
    batch = trajectories_to_batch([
        Trajectory(prompts=torch.randint(10, 500, (p,), generator=generator),
                   responses=torch.randint(10, 500, (r,), generator=generator),
                   response_mask=torch.ones(r, dtype=torch.long), rollout_log_probs=torch.zeros(r),
                   min_global_steps=0, max_global_steps=0) for p, r in shapes])
    lengths = field_lengths(batch["responses"])
    batch["advantages"] = make_field(torch.randn(int(lengths.sum()), generator=generator), lengths)
    return batch


def loss_fn(micro_batch, outputs):
    mask = padded_field(micro_batch["loss_mask"])
    result = ppo_clip_loss(outputs.padded("log_probs"), padded_field(micro_batch["old_log_probs"]),
                           padded_field(micro_batch["advantages"]), mask)
    return aggregate_loss(result.loss, mask, global_token_count=outputs.mini_batch.global_tokens), {}


def one_step(engine, batch, max_token_len):
    """old_log_probs, gradients (full tensors), one optimizer step; returns the gradients."""
    batch["old_log_probs"] = engine.compute_log_prob(batch).field("log_probs")
    engine.accumulate_gradients(batch, loss_fn, max_token_len=max_token_len)
    grads = {name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
             for name, p in engine.model.named_parameters()}
    engine.optimizer_step()
    return grads


def worker(rank, port, path, out_dir):
    torch.set_num_threads(1)
    from tandem.training.engine import TrainingEngine
    from tandem.training.fsdp import init_process_group, shard_batch

    init_process_group(rank, WORLD, f"tcp://127.0.0.1:{port}")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    engine = TrainingEngine(model, "actor", 4096, optim=OptimConfig(lr=LR))
    # rank 0's two sequences fit one micro-batch, rank 1's need two: the engine evens them out
    grads = one_step(engine, shard_batch(make_batch(), rank, WORLD), max_token_len=14)
    weights = dict(engine.export_weights())  # a collective: both ranks drain it
    shards = [(s.name, s.start, s.tensor.clone()) for s in engine.export_local_shards()]
    critic = TrainingEngine(ValueModel.from_pretrained(path), "critic", 4096, optim=OptimConfig())
    values = critic.compute_values(shard_batch(make_batch(), rank, WORLD)).values
    torch.save({"grads": grads, "weights": weights, "shards": shards, "values": values},
               f"{out_dir}/rank{rank}.pt")
    torch.distributed.destroy_process_group()


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_gloo_processes_take_the_same_step_as_one(tmp_path):
    from tandem.training.engine import TrainingEngine

    path = build_tiny_model(TinyModelSpec())
    # fork: the children reuse the imported modules (spawn would re-import torch and transformers)
    mp.start_processes(worker, args=(free_port(), str(path), str(tmp_path)), nprocs=WORLD, join=True,
                       start_method="fork")
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]

    single = TrainingEngine(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), "actor", 4096,
                            optim=OptimConfig(lr=LR))
    single_initial = {name: tensor.clone() for name, tensor in single.export_weights()}
    grads = one_step(single, make_batch(), max_token_len=4096)
    expected = dict(single.export_weights())

    # the one-process optimizer replayed on the two-process gradients
    replay = TrainingEngine(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), "actor", 4096,
                            optim=OptimConfig(lr=LR))
    for name, parameter in replay.model.named_parameters():
        parameter.grad = ranks[0]["grads"][name].clone()
    replay.optimizer_step()
    replayed = dict(replay.export_weights())
    parameter_count = sum(p.numel() for p in replay.model.parameters())

    assert set(ranks[0]["weights"]) == set(expected) == set(replayed)
    for name, tensor in expected.items():
        assert (ranks[0]["grads"][name] - grads[name]).abs().max() < GRADIENT_TOLERANCE, name
        difference = (ranks[0]["weights"][name] - replayed[name]).abs()
        assert (difference <= weight_tolerance(replayed[name], parameter_count)).all(), name
        assert torch.equal(ranks[0]["weights"][name], ranks[1]["weights"][name]), name
        # the step moved the weights (lr 1e-3 and AdamW's unit-sized direction: not a no-op)
        assert not torch.equal(tensor, single_initial[name]), name

    critic = TrainingEngine(ValueModel.from_pretrained(path), "critic", 4096, optim=OptimConfig())
    values = critic.compute_values(make_batch()).values
    assert (torch.cat([rank["values"] for rank in ranks]) - values).abs().max() < 1e-5

    # local shards of both ranks tile the full tensors
    for name, tensor in ranks[0]["weights"].items():
        rebuilt = torch.empty_like(tensor).view(-1)
        for rank in ranks:
            for shard_name, start, shard in rank["shards"]:
                if shard_name == name:
                    rebuilt[start:start + shard.numel()] = shard.reshape(-1)
        assert torch.equal(rebuilt.view_as(tensor), tensor), name


def shared_batch():
    """Two prompts with two samples each (rank 0 gets one prompt's pair, rank 1 the other's)."""
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(10, 500, (p,), generator=generator) for p in (5, 8)]
    batch = trajectories_to_batch([
        Trajectory(prompts=prompts[p].clone(), responses=torch.randint(10, 500, (r,), generator=generator),
                   response_mask=torch.ones(r, dtype=torch.long), rollout_log_probs=torch.zeros(r),
                   min_global_steps=0, max_global_steps=0) for p, r in ((0, 9), (0, 7), (1, 4), (1, 8))])
    lengths = field_lengths(batch["responses"])
    batch["advantages"] = make_field(torch.randn(int(lengths.sum()), generator=generator), lengths)
    return batch


def shared_worker(rank, port, path, out_dir):
    torch.set_num_threads(1)
    from tandem.training import packed_attention
    from tandem.training.engine import TrainingEngine
    from tandem.training.fsdp import init_process_group, shard_batch

    init_process_group(rank, WORLD, f"tcp://127.0.0.1:{port}")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 attn_implementation=packed_attention.register())
    engine = TrainingEngine(model, "actor", 4096, optim=OptimConfig(lr=1e-3), share_prompts=True)
    grads = one_step(engine, shard_batch(shared_batch(), rank, WORLD), max_token_len=4096)
    torch.save({"grads": grads}, f"{out_dir}/shared{rank}.pt")
    torch.distributed.destroy_process_group()


def test_shared_prompt_forwards_under_fsdp_take_the_plain_step(tmp_path):
    """FSDP2 (full-logits head) with shared-prompt packed forwards: the same gradients as one
    process with plain packed forwards."""
    from tandem.training import packed_attention
    from tandem.training.engine import TrainingEngine

    path = build_tiny_model(TinyModelSpec())
    mp.start_processes(shared_worker, args=(free_port(), str(path), str(tmp_path)), nprocs=WORLD,
                       join=True, start_method="fork")
    ranks = [torch.load(tmp_path / f"shared{r}.pt", weights_only=False) for r in range(WORLD)]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 attn_implementation=packed_attention.register())
    single = TrainingEngine(model, "actor", 4096, optim=OptimConfig(lr=1e-3), share_prompts=False)
    grads = one_step(single, shared_batch(), max_token_len=4096)
    for name, grad in grads.items():
        assert (ranks[0]["grads"][name] - grad).abs().max() < GRADIENT_TOLERANCE, name
    assert any(grad.abs().max() > 1e-4 for grad in grads.values())  # not vacuous


def test_the_group_is_made_with_the_configured_deadline(monkeypatch):
    """A rank that died must fail its peers' collectives after trainer.timeout_s, not torch's
    default half hour."""
    from datetime import timedelta

    from tandem.training import fsdp

    made = {}
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.distributed, "init_process_group",
                        lambda backend, **kwargs: made.update(backend=backend, **kwargs))
    fsdp.init_process_group(1, 2, "tcp://127.0.0.1:1", "cpu", timeout_s=42.0)
    assert made == {"backend": "gloo", "init_method": "tcp://127.0.0.1:1", "rank": 1,
                    "world_size": 2, "timeout": timedelta(seconds=42.0)}
