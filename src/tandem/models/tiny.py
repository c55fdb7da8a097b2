"""Tiny HF causal LMs (Qwen2 or Llama architecture) with a locally trained tokenizer.

Everything is built on this machine from a seed and saved as a normal HF directory
(config.json, model.safetensors, tokenizer.json, tokenizer_config.json with a chat template),
so `AutoModelForCausalLM.from_pretrained(path)` and `AutoTokenizer.from_pretrained(path)` work
offline. Built directories are cached under $TANDEM_CACHE (default ~/.cache/tandem).
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from tandem.models.cache import build_once

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>",
                  "<tool_response>", "</tool_response>"]
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
CHAT_TEMPLATE = (Path(__file__).parent / "chat_template.jinja").read_text()
_TOKENIZER_VERSION = 3  # bump when the corpus or the tokenizer recipe changes


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of a tiny model. vocab_size 0 means "the tokenizer's vocabulary size"."""

    architecture: str = "qwen2"  # qwen2 | llama | qwen2_vl | qwen2_5_vl (models/tiny_vl.py)
    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 128
    vocab_size: int = 0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True
    tokenizer_vocab_size: int = 1024
    seed: int = 0

    def key(self) -> str:
        """A short stable name for the cache directory: the spec, the tokenizer recipe and what
        the tokenizer is trained on (a change to a tool's description changes the merges, hence
        the model; a cache keyed on the spec alone kept serving the old one)."""
        digest = hashlib.sha1(json.dumps([asdict(self), _TOKENIZER_VERSION,
                                          _training_text_digest(self.seed)]).encode()).hexdigest()
        return f"tiny-{self.architecture}-{digest[:10]}"


@functools.lru_cache(maxsize=None)
def _training_text_digest(seed: int) -> str:
    """sha1 of the tokenizer's corpus, special tokens and chat template."""
    text = json.dumps([_corpus(seed), SPECIAL_TOKENS, EOS_TOKEN, PAD_TOKEN, CHAT_TEMPLATE])
    return hashlib.sha1(text.encode()).hexdigest()


def _corpus(seed: int = 0, lines: int = 4000) -> list[str]:
    """Text the tokenizer learns merges from: chat, arithmetic word problems, tool calls."""
    rng = random.Random(seed)
    names = ["Ann", "Bob", "Cai", "Dee", "Eli", "Fay", "Gus", "Hal", "Ivy", "Jo"]
    things = ["apples", "books", "coins", "pens", "cards", "boxes", "eggs", "cups", "shells", "stamps"]
    verbs = ["has", "buys", "finds", "gets", "sells", "loses", "gives away", "adds", "makes"]
    words = ("the a an and or of to in is are was how many much more less each per total what "
             "answer question compute result then times plus minus divided by equals left now "
             "user assistant system tool call calculator expression arguments name content "
             "you are helpful use think step final number").split()
    out = []
    for _ in range(lines):
        a, b = rng.randint(0, 999), rng.randint(1, 99)
        op = rng.choice(["+", "-", "*", "/"])
        name, thing, verb = rng.choice(names), rng.choice(things), rng.choice(verbs)
        out.append(f"{name} {verb} {a} {thing} and then {b} more. How many {thing}?")
        out.append(f'{{"name": "calculator", "arguments": {{"expression": "{a} {op} {b}"}}}}')
        out.append(f"The answer is {a + b}. Result: {a * b}")
        out.append(" ".join(rng.choice(words) for _ in range(12)))
    # the built-in tool schemas and the template's tool header recur in every tool-calling prompt;
    # read from the classes: constructing the python tool needs its sandbox (bwrap), a model not
    from tandem.tools.registry import builtin_tool_names, tool_class, tool_schema

    for schema in [tool_schema(tool_class(name)) for name in builtin_tool_names()]:
        out += ["# Tools\n<tools>\n" + json.dumps(schema) + "\n</tools>\nCall a tool as <tool_call>"] * 50
    out += ["Use the calculator tool, then give the final number."] * 50
    return out


def build_tokenizer(vocab_size: int = 512, seed: int = 0):
    """Train a byte-level BPE tokenizer (digits split one by one) and wrap it for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(_corpus(seed), trainer=trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS_TOKEN,
                                      pad_token=PAD_TOKEN, additional_special_tokens=SPECIAL_TOKENS[1:])
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def _model_config(spec: TinyModelSpec, vocab_size: int, eos_id: int, pad_id: int):
    from transformers import LlamaConfig, Qwen2Config

    common = dict(vocab_size=vocab_size, hidden_size=spec.hidden_size,
                  intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_hidden_layers,
                  num_attention_heads=spec.num_attention_heads,
                  num_key_value_heads=spec.num_key_value_heads,
                  max_position_embeddings=spec.max_position_embeddings,
                  tie_word_embeddings=spec.tie_word_embeddings, eos_token_id=eos_id,
                  pad_token_id=pad_id, bos_token_id=None)
    if spec.architecture == "qwen2":
        return Qwen2Config(**common)
    if spec.architecture == "llama":
        return LlamaConfig(**common)
    raise ValueError(f"TinyModelSpec.architecture={spec.architecture!r}: use 'qwen2' or 'llama'")


def build_tiny_model(spec: TinyModelSpec | None = None, **overrides) -> Path:
    """Build (once) and return the directory of a randomly initialised tiny model + tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    spec = spec or TinyModelSpec(**overrides)
    if spec.architecture in ("qwen2_vl", "qwen2_5_vl"):
        from tandem.models.tiny_vl import build_tiny_vl_model

        return build_tiny_vl_model(spec, build_tokenizer, CHAT_TEMPLATE)
    if spec.architecture not in ("qwen2", "llama"):
        raise ValueError(f"TinyModelSpec.architecture={spec.architecture!r}: use 'qwen2', 'llama', "
                         "'qwen2_vl' or 'qwen2_5_vl'")

    def build(directory: Path) -> None:
        tokenizer = build_tokenizer(spec.tokenizer_vocab_size, spec.seed)
        vocab = max(spec.vocab_size, len(tokenizer))
        config = _model_config(spec, vocab, tokenizer.eos_token_id, tokenizer.pad_token_id)
        torch.manual_seed(spec.seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)

    return build_once(spec.key(), build)


def build_tiny_reward_model(spec: TinyModelSpec | None = None, **overrides) -> Path:
    """Build (once) a randomly initialised tiny sequence-classification reward model (one
    scalar head) with the same tokenizer as the tiny causal LM of the same spec."""
    import torch
    from transformers import AutoModelForSequenceClassification

    spec = spec or TinyModelSpec(**overrides)

    def build(directory: Path) -> None:
        tokenizer = build_tokenizer(spec.tokenizer_vocab_size, spec.seed)
        vocab = max(spec.vocab_size, len(tokenizer))
        config = _model_config(spec, vocab, tokenizer.eos_token_id, tokenizer.pad_token_id)
        config.num_labels = 1
        torch.manual_seed(spec.seed + 1)
        model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)

    return build_once(f"{spec.key()}-reward", build)


# Warmed-up tiny models shipped with the package (`make demo-model` rebuilds them with
# tandem.demo.warmup): model.path -> directory. tiny:demo is what `tandem demo` starts from;
# tiny:calculator only learned the calculator's call format (for examples and tests of tools).
SHIPPED_MODELS = {"tiny:demo": Path(__file__).with_name("demo_model"),
                  "tiny:calculator": Path(__file__).with_name("calculator_model")}
DEMO_MODEL_DIR = SHIPPED_MODELS["tiny:demo"]


def shipped_model_path(name: str = "tiny:demo") -> Path:
    """A shipped warmed-up model (HF directory with its tokenizer)."""
    directory = SHIPPED_MODELS[name]
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(f"the {name} model is not in {directory}; rebuild it with "
                                "`make demo-model`")
    return directory


def resolve_model_path(path: str) -> Path:
    """Turn a `model.path` value into a directory: "tiny:qwen2", "tiny:llama", "tiny:qwen2_vl" (a
    tiny vision-language model), "tiny:colours" (the vision example's, warmed up), "tiny:reward"
    (a tiny
    reward model), "tiny:demo" and "tiny:calculator" (shipped), "smollm2", a local HF directory or a
    hub id (tandem.models.hub: transformers' cache, offline honoured)."""
    if path in SHIPPED_MODELS:
        return shipped_model_path(path)
    if path == "tiny:reward":
        return build_tiny_reward_model()
    if path == "tiny:colours":  # the vision example's warmed-up tiny Qwen2-VL
        from tandem.models.tiny_vl import build_colour_model

        return build_colour_model(build_tiny_model(TinyModelSpec(architecture="qwen2_vl")))
    if path.startswith("tiny:"):
        return build_tiny_model(TinyModelSpec(architecture=path.split(":", 1)[1]))
    if path == "smollm2":
        from tandem.models.smollm2 import smollm2_path

        return smollm2_path()
    directory = Path(path).expanduser()
    if (directory / "config.json").exists():
        return directory
    from tandem.models.hub import hub_model_directory, looks_like_hub_id

    if looks_like_hub_id(path):
        return hub_model_directory(path)
    raise FileNotFoundError(f"model.path={path!r} is not an HF model directory (no config.json); "
                            "use a local directory, a hub id ('org/name'), 'tiny:qwen2', "
                            "'tiny:llama' or 'smollm2'")
