"""bench/vllm_load.py's segment helpers (no vLLM needed): a layout of aligned, disjoint byte
ranges, and views of a /dev/shm file that give back every tensor bit for bit."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[1] / "bench" / "vllm_load.py"
spec = importlib.util.spec_from_file_location("vllm_load", BENCH)
vllm_load = importlib.util.module_from_spec(spec)
spec.loader.exec_module(vllm_load)


def tensors() -> dict[str, torch.Tensor]:
    return {"model.embed_tokens.weight": torch.randn(7, 5),
            "model.norm.weight": torch.randn(3, dtype=torch.bfloat16),
            "model.layers.0.mlp.up_proj.weight": torch.randn(4, 6, dtype=torch.float16),
            "scalar": torch.tensor(2.5, dtype=torch.float64)}


def test_layout_is_aligned_disjoint_and_small():
    layout, total = vllm_load.segment_layout(tensors().items())
    ends = 0
    for (name, offset, shape, dtype), tensor in zip(layout, tensors().values()):
        assert offset % vllm_load.ALIGN == 0 and offset >= ends
        assert shape == tuple(tensor.shape) and getattr(torch, dtype) == tensor.dtype
        ends = offset + tensor.numel() * tensor.element_size()
    assert ends <= total and total % vllm_load.ALIGN == 0
    # only this metadata crosses the RPC: plain str / int / tuple
    assert all(isinstance(v, (str, int, tuple)) for entry in layout for v in entry)


def test_segment_views_round_trip_through_a_file(tmp_path):
    weights = tensors()
    layout, buffer = vllm_load.write_segment(tmp_path / "segment", weights)
    # a second mapping of the file, as the worker makes; the layout as msgpack returns it
    as_lists = [[name, offset, list(shape), dtype] for name, offset, shape, dtype in layout]
    mapped = torch.from_file(str(tmp_path / "segment"), shared=True, size=buffer.numel(),
                             dtype=torch.uint8)
    views = vllm_load.segment_views(mapped, as_lists)
    assert [name for name, _ in views] == list(weights)
    for name, view in views:
        assert view.dtype == weights[name].dtype and torch.equal(view, weights[name])
    # views, not copies: a write through the sender's mapping shows in the worker's
    vllm_load.segment_views(buffer, layout)[0][1].fill_(0)
    assert views[0][1].abs().sum() == 0
