"""actor.freeze_vision_tower (docs/training.md, "Images"): a VLM's vision tower is not trained,
and weight syncs leave it out where every receiving engine holds all its weights, in process
(the hybrid worker's naive sync) and across processes (the loopback transport of
test_sync_manager); an engine that dropped its weights in sleep gets the whole stream."""

from __future__ import annotations

import asyncio

import pytest
import torch

from test_sync_manager import close, make_servers  # registers the loopback transport
from test_training_vision import sample
from test_engine_vision import noisy_vl_model
from tandem.batch.jagged import field_lengths, make_field, trajectories_to_batch
from tandem.config.load import ConfigError
from tandem.config.schema import CheckpointEngineConfig, OptimConfig, RolloutConfig, TandemConfig
from tandem.fleet.hybrid_worker import HybridWorker
from tandem.fleet.weight_sync import CrossProcessSync
from tandem.rollout.native import NativeRollout
from tandem.training.engine import TrainingEngine
from tandem.training.losses import actor_loss_fn
from tandem.types import GenerateRequest

ROLLOUT = RolloutConfig(kv_cache_memory_bytes=16 << 20, prompt_length=256, response_length=10)
TOWER = "model.visual."


@pytest.fixture(scope="module")
def vl_path(tmp_path_factory):
    return noisy_vl_model(tmp_path_factory.mktemp("vl-frozen"))


def _step(vl_path, batch, freeze: bool) -> tuple[TrainingEngine, dict, dict]:
    """One PPO step from the model's weights: (engine, weights before, weights after)."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(vl_path, dtype=torch.float32)
    engine = TrainingEngine(model, "actor", 4096, optim=OptimConfig(lr=1e-2, grad_clip=100.0),
                            freeze_vision_tower=freeze)
    before = {name: tensor.clone() for name, tensor in engine.export_weights()}
    batch = batch.clone()
    batch["old_log_probs"] = engine.compute_log_prob(batch).field("log_probs")
    metrics = engine.train_mini_batch(batch, actor_loss_fn(TandemConfig()))
    assert metrics["actor/step_skipped"] == 0
    return engine, before, dict(engine.export_weights())


def test_a_frozen_tower_is_not_trained_and_partial_exports_leave_it_out(vl_path):
    trajectories, _ = asyncio.run(sample(vl_path))
    batch = trajectories_to_batch(trajectories)
    lengths = field_lengths(batch["responses"])
    signs = torch.where(torch.arange(int(lengths.sum())) % 2 == 0, 1.0, -1.0)
    batch["advantages"] = make_field(signs, lengths)

    engine, before, after = _step(vl_path, batch, freeze=True)
    tower = {name for name in before if name.startswith(TOWER)}
    assert tower and engine.frozen_names == tower and engine.leaves_weights_out
    assert all(torch.equal(before[name], after[name]) for name in tower)
    assert any(not torch.equal(before[name], after[name]) for name in before if name not in tower)
    trained = {id(p) for group in engine.optimizer.param_groups for p in group["params"]}
    assert not any(id(p) in trained for name, p in engine.model.named_parameters() if name in tower)
    assert [name for name, _ in engine.export_weights(include_frozen=False)] == [
        name for name in before if name not in tower]

    # the same step without freezing moves the tower: the setting is what keeps it
    free, before, after = _step(vl_path, batch, freeze=False)
    assert any(not torch.equal(before[name], after[name]) for name in tower)
    assert free.frozen_names == set() and not free.leaves_weights_out
    assert len(list(free.export_weights(include_frozen=False))) == len(before)


def test_freezing_the_tower_of_a_text_model_is_refused(tmp_path):
    from tandem.preflight import check_job
    from tandem.config.load import load_config

    config = load_config(overrides=["actor.freeze_vision_tower=true"])
    with pytest.raises(ConfigError, match="actor.freeze_vision_tower: is true, but "
                                          "model.path=tiny:qwen2 is a text model"):
        check_job(config)
    from transformers import AutoModelForCausalLM

    from tandem.models import build_tiny_model

    model = AutoModelForCausalLM.from_pretrained(build_tiny_model())
    with pytest.raises(ValueError, match="has no vision tower"):
        TrainingEngine(model, "actor", 64, optim=OptimConfig(), freeze_vision_tower=True)


def _vl_worker(vl_path) -> HybridWorker:
    config = TandemConfig()
    config.model.path = str(vl_path)
    config.actor.freeze_vision_tower = True
    config.rollout.checkpoint_engine = CheckpointEngineConfig(backend="loopback", timeout_s=5.0)
    return HybridWorker(config)


def _move(worker: HybridWorker, prefix_in: bool, seed: int) -> None:
    """Add noise in place to the actor's weights inside (or outside) the tower."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in worker.actor.model.named_parameters():
            if name.startswith(TOWER) == prefix_in and parameter.dim() > 1:
                parameter.add_(0.1 * torch.randn(parameter.shape, generator=generator))


def _served(backend, names) -> dict[str, torch.Tensor]:
    return {name: backend.current_weight(name).clone() for name in names}


async def test_the_hybrid_sync_leaves_the_tower_out_once_the_engine_took_a_whole_update(vl_path):
    """The first sync is whole (the engine may hold another tower than the actor's, e.g. after
    a resume); later ones leave the tower out; after the engine dropped its weights in sleep
    the next one is whole again."""
    worker = _vl_worker(vl_path)
    await worker.start(NativeRollout, vl_path, ROLLOUT)
    try:
        names = dict(worker.actor.export_weights())
        tower = sorted(name for name in names if name.startswith(TOWER))
        text = sorted(name for name in names if not name.startswith(TOWER))
        assert not worker.backend.synced_in_full()
        _move(worker, prefix_in=True, seed=1)  # the actor's tower differs from the files'
        await worker.load_actor_weights(1)
        actor = dict(worker.actor.export_weights())
        assert worker.backend.synced_in_full()
        assert all(torch.equal(worker.backend.current_weight(n), actor[n]) for n in tower + text)

        # the actor's tower moved behind the config's back: a partial sync does not carry it
        served_tower = _served(worker.backend, tower)
        _move(worker, prefix_in=True, seed=2)
        _move(worker, prefix_in=False, seed=3)
        await worker.load_actor_weights(2)
        actor = dict(worker.actor.export_weights())
        assert worker.backend.weight_version == 2
        assert all(torch.equal(worker.backend.current_weight(n), actor[n]) for n in text)
        assert all(torch.equal(worker.backend.current_weight(n), served_tower[n]) for n in tower)

        # sleep drops the weights on CPU: the next sync sends everything, the tower included
        await worker.sleep(["weights"])
        await worker.wake_up(["weights"])
        assert not worker.backend.synced_in_full()
        await worker.load_actor_weights(3)
        assert worker.backend.synced_in_full()
        assert all(torch.equal(worker.backend.current_weight(n), actor[n]) for n in tower + text)
        output = await worker.backend.generate(GenerateRequest(
            "after", [1, 2, 3], {"temperature": 0.0, "max_tokens": 4, "ignore_eos": True}))
        assert len(output.token_ids) == 4 and output.extra_fields["global_steps"] == 3
    finally:
        await worker.shutdown()


async def test_the_cross_process_sync_leaves_the_tower_out_while_every_server_holds_it(vl_path):
    servers = await make_servers(vl_path, [], count=2, rollout=ROLLOUT)
    worker = _vl_worker(vl_path)
    try:
        ckpt = worker.config.rollout.checkpoint_engine
        sync = CrossProcessSync([worker], servers, ckpt.backend, ckpt.timeout_s, frozen=True)
        names = dict(worker.actor.export_weights())
        tower = sorted(name for name in names if name.startswith(TOWER))
        backends = [r.servers[0].backend for r in servers.replicas.values()]

        async def synced(version: int, tower_moves: bool) -> None:
            before = _served(backends[0], tower)
            _move(worker, prefix_in=True, seed=10 + version)
            _move(worker, prefix_in=False, seed=20 + version)
            report = await sync.sync(version=version)
            assert report.served == {"replica-0": version, "replica-1": version}
            actor = dict(worker.actor.export_weights())
            for backend in backends:
                assert backend.synced_in_full()
                assert all(torch.equal(backend.current_weight(n), actor[n])
                           for n in names if n not in tower)
                assert all(torch.equal(backend.current_weight(n),
                                       actor[n] if tower_moves else before[n]) for n in tower)

        await synced(1, tower_moves=True)  # the engines never took a whole update
        await synced(2, tower_moves=False)  # now every server holds the actor's weights
        # one server dropped its weights: every server gets the whole stream
        await backends[1].sleep(["weights"])
        await backends[1].wake_up(["weights"])
        await synced(3, tower_moves=True)
        await synced(4, tower_moves=False)
        # without `frozen` the sync never asks, and sends everything
        _move(worker, prefix_in=True, seed=5)
        await CrossProcessSync([worker], servers, ckpt.backend, ckpt.timeout_s).sync(version=5)
        actor = dict(worker.actor.export_weights())
        for backend in backends:
            assert all(torch.equal(backend.current_weight(n), actor[n]) for n in names)
    finally:
        await close(servers)
