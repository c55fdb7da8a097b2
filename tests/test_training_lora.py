"""The LoRA actor (peft): only adapters train, the reference is the actor with its adapters
disabled (exact against a separate frozen base), the adapter-only export, the merged weights,
checkpoints in peft's format, and the config refusing what it cannot honour."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from tandem.batch.jagged import field_lengths, make_field
from tandem.config.load import ConfigError, load_config
from tandem.config.schema import LoraConfig, OptimConfig
from tandem.models.tiny import TinyModelSpec, build_tiny_model
from tandem.training.engine import TrainingEngine
from tandem.training.lora import adapter_bytes, iter_adapter_weights, iter_merged_weights, lora_scale

from float_bounds import U, assert_within, gamma
from test_training_engine import make_batch, ppo_loss_fn

LORA = LoraConfig(rank=4, alpha=8.0)


@pytest.fixture(scope="module")
def tiny_path():
    return build_tiny_model(TinyModelSpec())


def lora_actor(path, lora=LORA, lr=1e-2) -> TrainingEngine:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return TrainingEngine(model, "actor", 4096, optim=OptimConfig(lr=lr, grad_clip=10.0), lora=lora)


def trained(path) -> tuple[TrainingEngine, object]:
    """A LoRA actor after one PPO step (so its adapter is not zero) and the batch."""
    batch = make_batch([(4, 8), (6, 5), (3, 9)], seed=3)
    lengths = field_lengths(batch["responses"])
    batch["advantages"] = make_field(torch.randn(int(lengths.sum()), generator=torch.Generator().manual_seed(0)),
                                     lengths)
    engine = lora_actor(path)
    batch["old_log_probs"] = make_field(engine.compute_log_prob(batch).log_probs, lengths)
    engine.train_mini_batch(batch, ppo_loss_fn())
    return engine, batch


def test_only_the_adapter_trains(tiny_path):
    engine = lora_actor(tiny_path)
    adapter = {n for n, p in engine.model.named_parameters() if ".lora_" in n}
    assert adapter and {n for n, p in engine.model.named_parameters() if p.requires_grad} == adapter
    held = {id(p) for group in engine.optimizer.param_groups for p in group["params"]}
    assert held == {id(p) for n, p in engine.model.named_parameters() if n in adapter}
    base = {n: p.detach().clone() for n, p in engine.model.named_parameters() if n not in adapter}
    engine_after, _ = trained(tiny_path)
    for name, parameter in engine_after.model.named_parameters():
        if name in base:
            assert torch.equal(parameter, base[name]), name
    assert any(float(p.detach().abs().max()) > 0 for n, p in engine_after.model.named_parameters()
               if ".lora_B." in n)


def test_the_reference_is_the_actor_with_adapters_disabled_exactly(tiny_path):
    engine, batch = trained(tiny_path)
    base = TrainingEngine(AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32),
                          "reference", 4096)
    reference = engine.compute_ref_log_prob(batch).log_probs
    assert torch.equal(reference, base.compute_log_prob(batch).log_probs)
    assert not torch.equal(engine.compute_log_prob(batch).log_probs, reference)  # adapter is back
    with pytest.raises(ValueError, match="LoRA actor"):
        base.compute_ref_log_prob(batch)


def test_export_is_adapter_only_with_the_scale_folded_into_b(tiny_path):
    engine, _ = trained(tiny_path)
    exported = dict(engine.export_weights())
    assert exported and all(n.endswith((".lora_A.weight", ".lora_B.weight")) for n in exported)
    assert "model.layers.0.self_attn.q_proj.lora_A.weight" in exported
    assert sum(t.numel() * t.element_size() for t in exported.values()) == adapter_bytes(engine.model)
    peft_b = dict(engine.model.named_parameters())["base_model.model.model.layers.0.mlp.down_proj.lora_B.default.weight"]
    assert torch.equal(exported["model.layers.0.mlp.down_proj.lora_B.weight"], peft_b * lora_scale(engine.model))
    assert lora_scale(engine.model) == 2.0


def test_merged_weights_are_base_plus_b_a_within_float32(tiny_path):
    engine, _ = trained(tiny_path)
    merged = dict(iter_merged_weights(engine.model))
    plain = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
    assert set(merged) == {n for n, _ in plain.named_parameters()}
    adapters = dict(iter_adapter_weights(engine.model))
    for name, tensor in merged.items():
        module = name.removesuffix(".weight")
        base = dict(plain.named_parameters())[name].detach()
        if f"{module}.lora_A.weight" not in adapters:
            assert torch.equal(tensor, base), name
            continue
        a, b = adapters[f"{module}.lora_A.weight"].double(), adapters[f"{module}.lora_B.weight"].double()
        exact = base.double() + b @ a
        # one rank-r dot product per element, one sum, one rounding to float32 of each input
        bound = gamma(a.shape[0] + 2) * (b.abs() @ a.abs() + base.double().abs()) + U * exact.abs()
        assert_within(tensor, exact, bound, name)


def test_checkpoints_hold_the_adapter_in_peft_format_and_the_merged_model(tiny_path, tmp_path):
    from peft import PeftModel

    engine, batch = trained(tiny_path)
    engine.save_merged = True
    path = engine.save_checkpoint(tmp_path / "step1")
    assert (path / "adapter" / "adapter_config.json").exists()
    base = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, str(path / "adapter"))
    ours = dict(engine.model.named_parameters())
    for name, parameter in loaded.named_parameters():
        if ".lora_" in name:
            assert torch.equal(parameter, ours[name]), name
    merged = AutoModelForCausalLM.from_pretrained(path / "merged", dtype=torch.float32)
    expected = dict(iter_merged_weights(engine.model))
    for name, parameter in merged.named_parameters():
        assert torch.equal(parameter, expected[name]), name
    resumed = lora_actor(tiny_path)
    resumed.load_checkpoint(path)
    assert torch.equal(resumed.compute_log_prob(batch).log_probs, engine.compute_log_prob(batch).log_probs)


@pytest.mark.parametrize("override, field", [
    ({"rank": 4, "target_modules": ["lm_head"]}, "actor.lora.target_modules"),
    ({"rank": 4, "target_modules": []}, "actor.lora.target_modules"),
    ({"rank": 4, "target_modules": ["q_proj", "q_proj"]}, "actor.lora.target_modules"),
    ({"save_merged": True}, "actor.lora.save_merged"),
    ({"rank": -1}, "actor.lora.rank"),
    ({"rank": 4, "dropout": 1.0}, "actor.lora.dropout"),
    ({"rank": 4, "alpha": 0.0}, "actor.lora.alpha"),
])
def test_the_config_refuses_lora_settings_it_cannot_honour(override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config({"actor": {"lora": override}})


def test_a_lora_config_loads():
    config = load_config({"actor": {"lora": {"rank": 16, "alpha": 32, "target_modules": ["q_proj", "v_proj"]}}})
    assert config.actor.lora.rank == 16 and config.actor.lora.target_modules == ["q_proj", "v_proj"]


def test_the_engines_lora_rank_follows_the_actor():
    assert load_config({"actor": {"lora": {"rank": 8}}}).rollout.lora_rank == 8
    assert load_config().rollout.lora_rank == 0
    with pytest.raises(ConfigError, match=r"rollout\.lora_rank: .*derived from actor\.lora\.rank"):
        load_config({"actor": {"lora": {"rank": 8}}, "rollout": {"lora_rank": 16}})
