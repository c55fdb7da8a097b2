"""The vllm backend's weight segment (no vLLM needed): a layout of aligned, disjoint byte ranges,
views of the /dev/shm file that give back every tensor bit for bit, a new file only when an
update outgrows it, and none left after close (bench/vllm_load.py times it against pickling)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem.rollout.vllm_workers import WeightSegment, segment_views
from tandem.weight_layout import ALIGN, flat_layout


def tensors() -> list[tuple[str, torch.Tensor]]:
    return [("model.embed_tokens.weight", torch.randn(7, 5)),
            ("model.norm.weight", torch.randn(3, dtype=torch.bfloat16)),
            ("model.layers.0.mlp.up_proj.weight", torch.randn(4, 6, dtype=torch.float16)),
            ("scalar", torch.tensor(2.5, dtype=torch.float64))]


def test_layout_is_aligned_disjoint_and_plain_data():
    layout, total = flat_layout((name, t.shape, t.dtype) for name, t in tensors())
    end = 0
    for chunk, (name, tensor) in zip(layout, tensors()):
        assert chunk.offset % ALIGN == 0 and chunk.offset >= end and chunk.whole
        assert chunk.name == name and chunk.shape == tuple(tensor.shape)
        assert getattr(torch, chunk.dtype) == tensor.dtype
        end = chunk.offset + tensor.numel() * tensor.element_size()
    assert end <= total and total % ALIGN == 0
    # only this crosses collective_rpc: str / int / tuple
    assert all(isinstance(value, (str, int, tuple)) for entry in layout for value in entry)


def test_segment_views_in_a_second_mapping_give_back_the_tensors(tmp_path):
    weights = tensors()
    segment = WeightSegment(str(tmp_path))
    layout = segment.write(weights)
    # the worker's side: its own mapping of the file, the layout as msgpack returns it (lists)
    mapped = torch.from_file(segment.path, shared=True, size=segment.buffer.numel(),
                             dtype=torch.uint8)
    as_msgpack = [[list(value) if isinstance(value, tuple) else value for value in chunk]
                  for chunk in layout]
    views = segment_views(mapped, as_msgpack)
    assert [name for name, _ in views] == [name for name, _ in weights]
    for (_, view), (_, tensor) in zip(views, weights):
        assert view.dtype == tensor.dtype and torch.equal(view, tensor)

    path = segment.path
    segment.write(weights[1:])  # smaller: the same file
    assert segment.path == path
    segment.write(weights + [("big", torch.zeros(1000))])  # larger: a new file, the old one gone
    assert segment.path != path and not Path(path).exists() and Path(segment.path).exists()
    segment.close()
    assert list(tmp_path.iterdir()) == []


def test_a_segment_that_does_not_fit_is_refused_before_any_byte_is_written(tmp_path, monkeypatch):
    """A write past a full tmpfs would kill the process (SIGBUS): the free space is checked."""
    import shutil

    import tandem.rollout.vllm as vllm_module

    full = shutil.disk_usage(tmp_path)._replace(free=100)
    monkeypatch.setattr(vllm_module.shutil, "disk_usage", lambda path: full)
    segment = WeightSegment(str(tmp_path))
    with pytest.raises(RuntimeError, match=r"MiB free.*--shm-size"):
        segment.write(tensors())
    assert list(tmp_path.iterdir()) == [] and segment.path == ""
