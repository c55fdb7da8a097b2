"""Weight export: full tensors under HF names, local shards, and exact compact deltas."""

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tandem.config.schema import OptimConfig
from tandem.models.tiny import TinyModelSpec, build_tiny_model
from tandem.training.engine import TrainingEngine
from tandem.training.export import DeltaExporter, apply_delta


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


def test_delta_export_rebuilds_the_new_weights_exactly(tiny_path):
    engine = engine_for(tiny_path)
    receiver = {name: tensor.clone() for name, tensor in engine.export_weights()}
    first = list(engine.export_delta())
    assert len(first) == len(receiver) and all(d.indices is None for d in first)  # baseline: dense
    assert list(engine.export_delta()) == []  # nothing changed since

    with torch.no_grad():  # a sparse change: three entries of one matrix
        weight = engine.model.get_parameter("model.layers.0.mlp.up_proj.weight")
        weight[0, :3] += 1.0
    (delta,) = engine.export_delta()
    assert delta.name == "model.layers.0.mlp.up_proj.weight" and delta.indices.dtype == torch.int32
    assert delta.indices.tolist() == [0, 1, 2] and delta.nbytes() == 3 * (4 + 4)
    apply_delta(receiver[delta.name], delta)

    for parameter in engine.model.parameters():  # a dense change: every entry of every tensor
        parameter.grad = torch.randn_like(parameter)
    engine.optimizer.step()
    deltas = list(engine.export_delta())
    assert {d.name for d in deltas} == set(receiver)
    for d in deltas:
        apply_delta(receiver[d.name], d)
    for name, tensor in engine.export_weights():
        assert torch.equal(receiver[name], tensor), name


def test_delta_compares_bits_not_float_values():
    model = torch.nn.Linear(8, 8)
    with torch.no_grad():
        model.bias.zero_()
    exporter = DeltaExporter()
    list(exporter.export(model))
    with torch.no_grad():
        model.bias[0] = -0.0  # equal as floats, different bytes: the receiver must get it
    (delta,) = exporter.export(model)
    assert delta.name == "bias" and delta.indices.tolist() == [0]
    assert torch.equal(delta.values.view(torch.int32), torch.tensor([-0.0]).view(torch.int32))
