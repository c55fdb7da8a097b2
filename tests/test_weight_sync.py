"""The naive checkpoint engine: the actor's stream reaches the co-located rollout engine."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from tandem.config.schema import RolloutConfig
from tandem.models.tiny import build_tiny_model
from tandem.rollout.native import NativeRollout
from tandem.weight_sync.naive import NaiveCheckpointEngine
from tandem.weight_sync.registry import checkpoint_engine_names, get_checkpoint_engine_class
from tandem.types import GenerateRequest


async def test_naive_sync_loads_weights_and_stamps_the_version():
    path = build_tiny_model()
    rollout = NativeRollout.create(path, RolloutConfig(kv_cache_memory_bytes=1 << 22))
    model = AutoModelForCausalLM.from_pretrained(path)
    torch.manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.5)
    prompt = [5, 6, 7, 8]
    engine = get_checkpoint_engine_class("naive")(bucket_megabytes=1)
    assert isinstance(engine, NaiveCheckpointEngine)
    await engine.sync(model.state_dict().items(), rollout, version=3)
    out = await rollout.generate(GenerateRequest("a", prompt, {"temperature": 0, "max_tokens": 6}))
    assert out.extra_fields["global_steps"] == 3 and rollout.weight_version == 3
    expected = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, 4:].tolist()
    assert out.token_ids == expected[:len(out.token_ids)]
    await rollout.shutdown()


def test_naive_rejects_misuse():
    with pytest.raises(ValueError, match="engine_kwargs"):
        NaiveCheckpointEngine(512, transport="tcp")
    with pytest.raises(RuntimeError, match="before send_weights"):
        next(NaiveCheckpointEngine().receive_weights())
    with pytest.raises(ValueError, match="naive"):
        get_checkpoint_engine_class("nccl")
    assert "naive" in checkpoint_engine_names()
