"""Weight export: full tensors under HF names, local shards, and exact compact deltas."""

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tandem.config.schema import OptimConfig
from tandem.models.tiny import TinyModelSpec, build_tiny_model
from tandem.training.engine import TrainingEngine


@pytest.fixture(scope="module")
def tiny_path():
    return build_tiny_model(TinyModelSpec())


def engine_for(path):
    return TrainingEngine(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), "actor", 4096,
                          optim=OptimConfig(lr=1e-2))


def test_full_export_uses_the_hf_checkpoint_names(tiny_path):
    engine = engine_for(tiny_path)
    on_disk = load_file(str(tiny_path / "model.safetensors"))
    exported = dict(engine.export_weights())
    assert set(exported) == set(on_disk)
    for name, tensor in exported.items():
        assert torch.equal(tensor, on_disk[name]), name
    shards = list(engine.export_local_shards())  # one process: each shard is the whole tensor
    assert [s.name for s in shards] == list(exported)
    assert all(s.start == 0 and tuple(s.tensor.shape) == s.full_shape for s in shards)
