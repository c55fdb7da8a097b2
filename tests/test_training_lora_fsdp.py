"""A LoRA actor under FSDP2 over 2 gloo processes: the same adapter gradients as one process
(only the summation order of the reduction differs: test_training_fsdp.py's tolerance), the
base weights untouched, and the reference (adapters disabled) equal to the frozen base."""

import torch
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM

from tandem.config.schema import LoraConfig, OptimConfig
from tandem.models.tiny import TinyModelSpec, build_tiny_model

from test_training_fsdp import GRADIENT_TOLERANCE, LR, WORLD, free_port, loss_fn, make_batch

LORA = LoraConfig(rank=4, alpha=8.0)


def lora_engine(path):
    from tandem.training.engine import TrainingEngine

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    engine = TrainingEngine(model, "actor", 4096, optim=OptimConfig(lr=LR), lora=LORA)
    with torch.no_grad():  # B != 0, so A gets gradients too and the adapter changes the model
        for name, parameter in engine.model.named_parameters():
            if ".lora_B." in name:
                local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
                local.fill_(0.01)
    return engine


def step(engine, batch):
    """ref log-probs, then one step; returns (adapter gradients as full tensors, ref log-probs)."""
    reference = engine.compute_ref_log_prob(batch).log_probs
    batch["old_log_probs"] = engine.compute_log_prob(batch).field("log_probs")
    engine.accumulate_gradients(batch, loss_fn)
    grads = {name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
             for name, p in engine.model.named_parameters() if p.requires_grad}
    engine.optimizer_step()
    return grads, reference


def worker(rank, port, path, out_dir):
    torch.set_num_threads(1)
    from tandem.training.fsdp import init_process_group, shard_batch

    init_process_group(rank, WORLD, f"tcp://127.0.0.1:{port}")
    engine = lora_engine(path)
    from tandem.training.engine import TrainingEngine
    from tandem.training.lora import iter_merged_weights

    held = sum(p.to_local().numel() for group in engine.optimizer.param_groups for p in group["params"])
    batch = shard_batch(make_batch(), rank, WORLD)
    grads, reference = step(engine, batch)
    base = TrainingEngine(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), "reference", 4096)
    plain = base.compute_log_prob(batch).log_probs  # the frozen base, sharded the same way
    torch.save({"grads": grads, "reference": reference, "plain": plain, "held": held,
                "merged": dict(iter_merged_weights(engine.model))}, f"{out_dir}/lora{rank}.pt")
    torch.distributed.destroy_process_group()


def test_a_lora_actor_under_fsdp2_takes_the_one_process_step(tmp_path):
    from tandem.training.engine import TrainingEngine
    from tandem.training.lora import iter_merged_weights

    path = build_tiny_model(TinyModelSpec())
    mp.start_processes(worker, args=(free_port(), str(path), str(tmp_path)), nprocs=WORLD,
                       join=True, start_method="fork")
    ranks = [torch.load(tmp_path / f"lora{r}.pt", weights_only=False) for r in range(WORLD)]
    single = lora_engine(path)
    grads, _ = step(single, make_batch())
    assert set(ranks[0]["grads"]) == set(grads) and all(".lora_" in name for name in grads)
    for name, gradient in grads.items():
        assert (ranks[0]["grads"][name] - gradient).abs().max() < GRADIENT_TOLERANCE, name
    # each rank's optimizer holds its shard of the adapter only
    assert sum(rank["held"] for rank in ranks) == sum(g.numel() for g in grads.values())
    for rank in ranks:  # adapters disabled under FSDP2 is exactly the frozen base under FSDP2
        assert torch.equal(rank["reference"], rank["plain"])
    base = TrainingEngine(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), "reference", 4096)
    # the base weights did not move: the merged model differs from the base only where adapted
    merged = dict(iter_merged_weights(single.model))
    for name, tensor in ranks[0]["merged"].items():
        if not any(t in name for t in LORA.target_modules):
            assert torch.equal(tensor, dict(base.model.named_parameters())[name]), name
        assert torch.equal(tensor, ranks[1]["merged"][name]), name
    assert set(merged) == set(ranks[0]["merged"])
