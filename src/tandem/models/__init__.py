"""Where models come from: tiny HF models built here, SmolLM2 from a pip package, hub ids from
transformers' cache (hub.py)."""

from tandem.models.smollm2 import smollm2_available, smollm2_path
from tandem.models.tiny import TinyModelSpec, build_tiny_model, build_tokenizer, resolve_model_path

__all__ = ["TinyModelSpec", "build_tiny_model", "build_tokenizer", "resolve_model_path",
           "smollm2_available", "smollm2_path"]
