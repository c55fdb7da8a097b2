"""The native engine serving base + adapter (merged into a working copy, the base kept): the
same greedy tokens and log-probs as HF with the merged weights, all-or-nothing adapter loads,
each adapter merged against the base, and the KV-cache sleep keeping base and adapter."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from tandem.config.schema import LoraConfig, OptimConfig, RolloutConfig
from tandem.models import TinyModelSpec, build_tiny_model
from tandem.rollout.native import NativeRollout
from tandem.training.engine import TrainingEngine
from tandem.training.lora import iter_merged_weights
from tandem.types import GenerateRequest

from float_bounds import assert_within, token_logprob_bounds

ROLLOUT = RolloutConfig(kv_cache_memory_bytes=8 << 20, block_size=8)
GREEDY = {"temperature": 0.0, "max_tokens": 16, "ignore_eos": True}
PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], [40, 41, 42, 43, 44, 45, 46]]


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def model_path(request):
    return build_tiny_model(TinyModelSpec(architecture=request.param))


def lora_actor(path, seed: int, targets=("q_proj", "v_proj", "o_proj", "gate_proj", "down_proj")):
    """A LoRA actor whose adapter is random (B != 0), so it serves a model unlike the base."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    engine = TrainingEngine(model, "actor", 4096, optim=OptimConfig(),
                            lora=LoraConfig(rank=4, alpha=8.0, target_modules=list(targets)))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in engine.model.named_parameters():
            if ".lora_B." in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)
    return engine


def merged_hf(path, actor) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(dict(iter_merged_weights(actor.model)), strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected
    return model.eval()


async def greedy(rollout, prefix="g"):
    return [await rollout.generate(GenerateRequest(f"{prefix}{i}", p, GREEDY)) for i, p in enumerate(PROMPTS)]


def hf_greedy(model, prompt):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=GREEDY["max_tokens"], do_sample=False, min_new_tokens=GREEDY["max_tokens"])
    return out[0, len(prompt):].tolist()


async def test_the_engine_with_an_adapter_matches_hf_with_merged_weights(model_path):
    actor = lora_actor(model_path, seed=1)
    rollout = NativeRollout.create(model_path, ROLLOUT)
    base_tokens = [o.token_ids for o in await greedy(rollout, "base")]
    await rollout.update_weights(actor.export_weights(), version=1)
    merged = merged_hf(model_path, actor)
    outputs = await greedy(rollout)
    assert [o.token_ids for o in outputs] != base_tokens  # the adapter changes what is served
    for prompt, output in zip(PROMPTS, outputs):
        assert output.token_ids == hf_greedy(merged, prompt)
        assert output.global_steps == 1
        assert_within(torch.tensor(output.log_probs), *token_logprob_bounds(merged, prompt, output.token_ids),
                      "engine + adapter vs HF merged")
    await rollout.shutdown()


async def test_each_adapter_merges_against_the_base_and_a_bad_one_changes_nothing(model_path):
    first, second = lora_actor(model_path, seed=2), lora_actor(model_path, seed=3, targets=("q_proj", "up_proj"))
    rollout = NativeRollout.create(model_path, ROLLOUT)
    name = "model.layers.0.self_attn.v_proj.weight"
    base_v = rollout.current_weight(name)
    await rollout.update_weights(first.export_weights(), version=1)
    await rollout.update_weights(second.export_weights(), version=2)
    # second alone, against the base: v_proj (only the first's) is back to its base weight
    assert torch.equal(rollout.current_weight(name), base_v)
    fresh = NativeRollout.create(model_path, ROLLOUT)
    await fresh.update_weights(second.export_weights(), version=2)
    served = [o.token_ids for o in await greedy(rollout)]
    assert served == [o.token_ids for o in await greedy(fresh)]
    for key in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.up_proj.weight"):
        assert torch.equal(rollout.current_weight(key), fresh.current_weight(key))
    a_name = "model.layers.0.self_attn.q_proj.lora_A.weight"
    kept_a = rollout.current_weight(a_name)
    bad = [(n, t.clone() if n != "model.layers.1.mlp.down_proj.lora_B.weight" else torch.full_like(t, float("nan")))
           for n, t in first.export_weights()]
    cases = {"NaN": bad,
             "shape": [(n, t[:2] if n.endswith("lora_A.weight") else t) for n, t in first.export_weights()],
             "half a pair": [(n, t) for n, t in first.export_weights() if n.endswith("lora_A.weight")],
             "unknown module": [("model.layers.0.self_attn.rotary.lora_A.weight", torch.ones(4, 8))],
             "mixed": [*first.export_weights(), (name, base_v)]}
    for case, stream in cases.items():
        with pytest.raises((ValueError, TypeError)):
            await rollout.update_weights(iter(stream), version=3)
        assert rollout.weight_version == 2, case
        assert [o.token_ids for o in await greedy(rollout, case)] == served, case
        assert torch.equal(rollout.current_weight(a_name), kept_a), case
    await rollout.shutdown()
    await fresh.shutdown()


async def test_the_kv_cache_sleep_keeps_base_and_adapter_and_model_weights_become_the_base(model_path):
    actor = lora_actor(model_path, seed=4)
    rollout = NativeRollout.create(model_path, ROLLOUT)
    await rollout.update_weights(actor.export_weights(), version=1)
    served = [o.token_ids for o in await greedy(rollout)]
    await rollout.sleep(["kv_cache"])
    await rollout.wake_up(["kv_cache"])
    assert [o.token_ids for o in await greedy(rollout, "woken")] == served
    await rollout.update_weights(actor.export_weights(), version=2)  # adapter only, no refill
    assert [o.token_ids for o in await greedy(rollout, "again")] == served
    # a full stream of model weights replaces base and adapter: the merged model is now the base
    await rollout.update_weights(iter_merged_weights(actor.model), version=3)
    assert rollout.lora.adapter == {} and rollout.lora.base == {}
    assert [o.token_ids for o in await greedy(rollout, "full")] == served
    with pytest.raises(KeyError, match="no adapter tensor"):
        rollout.current_weight("model.layers.0.self_attn.q_proj.lora_A.weight")
    # after the weights were dropped there is no base to merge into: a full stream must come first
    await rollout.sleep(["weights"])
    await rollout.wake_up(["weights"])
    with pytest.raises(RuntimeError, match="dropped"):
        await rollout.update_weights(actor.export_weights(), version=4)
    await rollout.update_weights(iter_merged_weights(actor.model), version=4)
    assert [o.token_ids for o in await greedy(rollout, "refilled")] == served
    await rollout.shutdown()


def test_the_peft_folder_for_vllm_and_sglang_holds_the_merged_model(model_path, tmp_path):
    """write_peft_adapter (what the vLLM and SGLang backends hand their LoRA APIs) loads in
    peft, and peft's merge of it is the merged actor (scale folded into B, alpha = r), within
    float32 rounding of W + B @ A."""
    from peft import PeftModel

    from tandem.rollout.adapter_stream import read_adapter, write_peft_adapter
    from tandem.rollout.external import safetensors_shapes

    from float_bounds import U, gamma

    actor = lora_actor(model_path, seed=5)
    shapes = safetensors_shapes(model_path, tied_embeddings=True)
    adapter = read_adapter(actor.export_weights(), shapes)
    write_peft_adapter(adapter, tmp_path, str(model_path), 8)
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    base_weights = {n: p.detach().clone() for n, p in base.named_parameters()}
    loaded = PeftModel.from_pretrained(base, str(tmp_path)).merge_and_unload()
    expected = dict(iter_merged_weights(actor.model))
    for name, tensor in loaded.named_parameters():
        module = name.removesuffix(".weight")
        if module not in adapter:
            assert torch.equal(tensor, expected[name]), name
            continue
        a, b = (t.double() for t in adapter[module])
        exact = base_weights[name].double() + b @ a
        bound = gamma(a.shape[0] + 2) * (b.abs() @ a.abs() + base_weights[name].double().abs()) + U * exact.abs()
        assert_within(tensor.detach(), exact, bound, f"peft folder {name}")
        assert_within(expected[name], exact, bound, f"merged actor {name}")
    with pytest.raises(ValueError, match="rank"):
        write_peft_adapter(adapter, tmp_path / "small", "", 2)
