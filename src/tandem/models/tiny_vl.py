"""Tiny Qwen2-VL and Qwen2.5-VL models: the tiny text model's tokenizer with Qwen2-VL's vision
tokens, a small vision tower (Qwen2.5-VL's with window attention in one block and full attention
in the other), 3-D rotary positions (mrope) and Qwen2-VL's image processor, randomly
initialised and saved as a normal HF directory (`Qwen2VLForConditionalGeneration.from_pretrained`,
`AutoTokenizer`, and the image processor's preprocessor_config.json). Built in seconds, cached
like the tiny text models (models/cache.py).

The chat template renders a message's content parts: an image part as
`<|vision_start|><|image_pad|><|vision_end|>`, a text part as its text; tandem.multimodal expands
each `<|image_pad|>` to the image's token count, as Qwen2-VL's processor does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from tandem.models.cache import build_once

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
IMAGE_PART = "<|vision_start|><|image_pad|><|vision_end|>"
CONTENT = "{{ message.content }}"
CONTENT_PARTS = ("{% if message.content is string %}{{ message.content }}{% else %}"
                 "{% for part in message.content %}{% if part.type == 'image' %}"
                 + IMAGE_PART + "{% else %}{{ part.text }}{% endif %}{% endfor %}{% endif %}")
# the image processor of the tiny models: 14-pixel patches merged 2 x 2 into one token, images
# scaled to between 1 token (28 x 28 pixels) and 16 (112 x 112)
PATCH, MERGE, TEMPORAL = 14, 2, 2
MIN_PIXELS, MAX_PIXELS = 28 * 28, 112 * 112
VERSION = 2  # in the cache key: bump when the recipe (template, sizes, processor) changes


def mrope_section(head_dim: int) -> list[int]:
    """Qwen2-VL's split of the rotary frequencies over (time, height, width): a quarter, three
    eighths, three eighths of head_dim / 2 (its [16, 24, 24] at head_dim 128)."""
    half = head_dim // 2
    spatial = half * 3 // 8
    return [half - 2 * spatial, spatial, spatial]


def build_tiny_vl_model(spec, build_tokenizer: Callable, chat_template: str) -> Path:
    """Build (once) and return the directory of a tiny Qwen2-VL of `spec` (a TinyModelSpec with
    architecture="qwen2_vl" or "qwen2_5_vl": its sizes are the language model's), with the tiny
    text models' tokenizer (`build_tokenizer`, models/tiny.py) and chat template."""
    import torch
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration,
                              Qwen2VLConfig, Qwen2VLForConditionalGeneration)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil)

    def build(directory: Path) -> None:
        tokenizer = build_tokenizer(spec.tokenizer_vocab_size, spec.seed)
        tokenizer.add_tokens(VISION_TOKENS, special_tokens=True)
        tokenizer.chat_template = chat_template.replace(CONTENT, CONTENT_PARTS)
        ids = {token: tokenizer.convert_tokens_to_ids(token) for token in VISION_TOKENS}
        head_dim = spec.hidden_size // spec.num_attention_heads
        text = dict(vocab_size=max(spec.vocab_size, len(tokenizer)), hidden_size=spec.hidden_size,
                    intermediate_size=spec.intermediate_size,
                    num_hidden_layers=spec.num_hidden_layers,
                    num_attention_heads=spec.num_attention_heads,
                    num_key_value_heads=spec.num_key_value_heads,
                    max_position_embeddings=spec.max_position_embeddings,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                     "mrope_section": mrope_section(head_dim)},
                    eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                    bos_token_id=None, tie_word_embeddings=spec.tie_word_embeddings)
        patches = dict(patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL)
        if spec.architecture == "qwen2_5_vl":
            kind, model_class = Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
            vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                          out_hidden_size=spec.hidden_size, in_chans=3, window_size=2 * PATCH * MERGE,
                          fullatt_block_indexes=[1], **patches)
        else:
            kind, model_class = Qwen2VLConfig, Qwen2VLForConditionalGeneration
            vision = dict(depth=1, embed_dim=32, hidden_size=spec.hidden_size, num_heads=2,
                          mlp_ratio=2, in_channels=3, **patches)
        config = kind(text_config=text, vision_config=vision,
                               image_token_id=ids["<|image_pad|>"],
                               video_token_id=ids["<|video_pad|>"],
                               vision_start_token_id=ids["<|vision_start|>"],
                               vision_end_token_id=ids["<|vision_end|>"],
                               tie_word_embeddings=spec.tie_word_embeddings)
        torch.manual_seed(spec.seed)
        model = model_class(config).to(torch.float32).eval()
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
        Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=PATCH,
                                 merge_size=MERGE, temporal_patch_size=TEMPORAL
                                 ).save_pretrained(directory)

    return build_once(f"{spec.key()}-vl{VERSION}", build)


# ---- the vision example's policy (tiny:colours) ------------------------------------------
# Pictures of one colour with pixel noise; the warm-up teaches the answer's format only (its
# labels are drawn at random, so the policy names a colour but not the picture's): GRPO then
# has to learn to look (examples/colours.yaml).
COLOURS = {"red": (220, 40, 40), "green": (40, 200, 60), "blue": (40, 60, 220)}
QUESTION = "What colour is it? Answer with one word."
WARMUP_STEPS, WARMUP_BATCH, WARMUP_LR = 200, 8, 3e-3


def colour_picture(name: str, rng: Any) -> Any:
    """A 28-70 pixel picture of colour `name` with noise of +-40 per channel (`rng`: random.Random)."""
    from PIL import Image

    base = COLOURS[name]
    width, height = rng.randint(28, 70), rng.randint(28, 70)
    pixels = bytes(max(0, min(255, channel + rng.randint(-40, 40)))
                   for _ in range(width * height) for channel in base)
    return Image.frombytes("RGB", (width, height), pixels)


def build_colour_model(base: Path) -> Path:
    """Build (once) the tiny Qwen2-VL of `base` after a supervised warm-up on the colour question
    answered with a random colour name (WARMUP_STEPS steps of WARMUP_BATCH, AdamW)."""
    import random
    import shutil

    import torch
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen2VLForConditionalGeneration

    from tandem.multimodal import IMAGE_PAD, expand_image_pads, process_images

    def build(directory: Path) -> None:
        tokenizer = AutoTokenizer.from_pretrained(base)
        processor = AutoImageProcessor.from_pretrained(base)
        torch.manual_seed(0)
        model = Qwen2VLForConditionalGeneration.from_pretrained(base, dtype=torch.float32)
        optimizer = torch.optim.AdamW(model.parameters(), lr=WARMUP_LR)
        pad = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
        messages = [{"role": "user", "content": [{"type": "image"},
                                                 {"type": "text", "text": QUESTION}]}]
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                 tokenize=True, return_dict=False)
        rng = random.Random(0)
        for _ in range(WARMUP_STEPS):
            optimizer.zero_grad()
            for _ in range(WARMUP_BATCH):
                inputs = process_images(processor, [colour_picture(rng.choice(list(COLOURS)),
                                                                   rng)], "warm-up")
                prompt = expand_image_pads(rendered, pad, inputs.token_counts, "warm-up")
                answer = tokenizer.encode(rng.choice(list(COLOURS)), add_special_tokens=False)
                ids = torch.tensor([prompt + answer + [tokenizer.eos_token_id]])
                labels = ids.clone()
                labels[0, :len(prompt)] = -100
                loss = model(input_ids=ids, pixel_values=inputs.pixel_values,
                             image_grid_thw=inputs.grid_thw, labels=labels,
                             mm_token_type_ids=(ids == pad).int()).loss
                (loss / WARMUP_BATCH).backward()
            optimizer.step()
        model.save_pretrained(directory)
        for path in base.iterdir():  # the tokenizer, its template, the image processor
            if not (directory / path.name).exists():
                shutil.copy(path, directory / path.name)

    return build_once(f"{base.name}-colours{VERSION}", build)
