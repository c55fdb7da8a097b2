"""Tiny local models: load offline with Auto classes; the chat template renders tool calls."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tandem.models.tiny import TinyModelSpec, build_tiny_model, resolve_model_path


@pytest.mark.parametrize("architecture", ["qwen2", "llama"])
def test_tiny_model_loads_offline(architecture, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = build_tiny_model(TinyModelSpec(architecture=architecture))
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (path / name).exists(), name
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert model.config.model_type == architecture
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    ids = tokenizer("Ann has 12 apples", return_tensors="pt").input_ids
    logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert torch.isfinite(logits).all()


def test_cache_is_reused_and_distinct_per_spec():
    assert build_tiny_model() == build_tiny_model()
    assert build_tiny_model(TinyModelSpec(hidden_size=32)) != build_tiny_model()
    assert resolve_model_path("tiny:qwen2") == build_tiny_model()


def test_chat_template_renders_tool_call_and_tool_response():
    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model())
    tools = [{"type": "function", "function": {"name": "calculator", "description": "arithmetic",
              "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 12 + 30?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "calculator",
                                              "arguments": {"expression": "12 + 30"}}}]},
        {"role": "tool", "content": "42"},
        {"role": "assistant", "content": "42"},
    ]
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "12 + 30"}}</tool_call>'
    assert call in text
    assert "<tool_response>42</tool_response>" in text
    assert json.dumps(tools[0]) in text and "Be brief." in text
    assert text.count("<|im_start|>assistant\n") == 2
    prompt = tokenizer.apply_chat_template(messages[:2], add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>assistant\n")
    # special tokens are single ids, so the engine can stop on eos
    ids = tokenizer.encode("<|im_end|><tool_call>")
    assert ids == [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<tool_call>")]


def test_bad_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="model.path"):
        resolve_model_path(str(tmp_path))
    with pytest.raises(ValueError, match="architecture"):
        build_tiny_model(TinyModelSpec(architecture="gpt2"))


def test_cache_key_follows_what_the_tokenizer_is_trained_on(monkeypatch):
    """A change to the corpus (e.g. a tool's description) gives a new cache entry, not the
    model built from the old corpus."""
    from tandem.models import tiny

    before = tiny.TinyModelSpec().key()
    tiny._training_text_digest.cache_clear()
    monkeypatch.setattr(tiny, "_corpus", lambda seed: ["a tool description that changed"])
    try:
        assert tiny.TinyModelSpec().key() != before
        assert tiny.TinyModelSpec(seed=0).key() == tiny.TinyModelSpec().key()
    finally:
        tiny._training_text_digest.cache_clear()
