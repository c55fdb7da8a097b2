"""The native engine serving a tiny Qwen2-VL and Qwen2.5-VL (models/tiny_vl.py, weights moved by seeded noise
so that what it writes depends on the image): greedy tokens equal HF `generate` on 16 prompts
with 1-3 images each, one at a time and in one batch; the prefix cache reuses the blocks of the
same image and never those of a different image with the same tokens; bad image input fails its
request with the reason."""

from __future__ import annotations

import asyncio
import random
import shutil

import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

from tandem.config.schema import RolloutConfig
from tandem.models import TinyModelSpec, build_tiny_model
from tandem.multimodal import expand_image_pads, load_image, pad_runs, process_images
from tandem.rollout.native import NativeRollout
from tandem.types import GenerateRequest

CONFIG = RolloutConfig(kv_cache_memory_bytes=16 << 20, block_size=4)
GREEDY = {"temperature": 0, "max_tokens": 8, "ignore_eos": True, "logprobs": True}
QUESTIONS = ["What is here?", "Count the shapes.", "Which colour?", "Describe it."]


FAMILIES = ["qwen2_vl", "qwen2_5_vl"]  # Qwen2.5-VL: window attention in its vision tower


@pytest.fixture(scope="module", params=FAMILIES)
def vl_path(tmp_path_factory, request):
    return noisy_vl_model(tmp_path_factory.mktemp("vl"), request.param)


def noisy_vl_model(directory, architecture: str = "qwen2_vl", **shape):
    """The tiny Qwen2-VL (or Qwen2.5-VL; `shape`: other TinyModelSpec fields) with every matrix
    moved by N(0, 0.15) noise (seeded), saved with its tokenizer and image processor in
    `directory`."""
    built = build_tiny_model(TinyModelSpec(architecture=architecture, **shape))
    model = AutoModelForImageTextToText.from_pretrained(built, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.add_(0.15 * torch.randn(parameter.shape, generator=generator))
    model.save_pretrained(directory)
    for path in built.iterdir():  # the tokenizer, its chat template, the image processor
        if not (directory / path.name).exists():
            shutil.copy(path, directory / path.name)
    return directory


@pytest.fixture(scope="module")
def parts(vl_path):
    hf = AutoModelForImageTextToText.from_pretrained(vl_path, dtype=torch.float32).eval()
    return hf, AutoTokenizer.from_pretrained(vl_path), AutoImageProcessor.from_pretrained(vl_path)


def noise_image(seed: int) -> Image.Image:
    """Random pixels, 28-130 pixels a side: 1 to 16 image tokens after scaling."""
    rng = random.Random(seed)
    width, height = rng.randint(28, 130), rng.randint(28, 130)
    return Image.frombytes("RGB", (width, height),
                           bytes(rng.randrange(256) for _ in range(width * height * 3)))


def render(tokenizer, processor, pad_id: int, images: list, question: str) -> list[int]:
    """The chat prompt with one image part per image, then the question; pads expanded."""
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": question}]
    ids = tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                        add_generation_prompt=True, tokenize=True,
                                        return_dict=False)
    counts = process_images(processor, images, "test").token_counts
    return expand_image_pads(ids, pad_id, counts, "test")


def hf_greedy(hf, processor, prompt: list[int], images: list, steps: int) -> list[int]:
    inputs = process_images(processor, images, "hf")
    ids = torch.tensor([prompt])
    out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                      pixel_values=inputs.pixel_values, image_grid_thw=inputs.grid_thw,
                      mm_token_type_ids=(ids == hf.config.image_token_id).int(),
                      max_new_tokens=steps, do_sample=False)
    return out[0, len(prompt):].tolist()


async def test_greedy_equals_hf_generate_on_16_prompts_with_1_to_3_images(vl_path, parts):
    hf, tokenizer, processor = parts
    pad = hf.config.image_token_id
    rng = random.Random(5)
    cases = []
    for index in range(16):
        images = [noise_image(100 * index + k) for k in range(rng.randint(1, 3))]
        cases.append((render(tokenizer, processor, pad, images, QUESTIONS[index % 4]), images))
    expected = [hf_greedy(hf, processor, prompt, images, GREEDY["max_tokens"])
                for prompt, images in cases]
    assert len({tuple(tokens) for tokens in expected}) > 8  # what it writes depends on the image
    engine = NativeRollout.create(vl_path, CONFIG)
    try:
        assert engine.runner.vision is not None
        one_at_a_time = [await engine.generate(GenerateRequest(
            f"a{index}", prompt, GREEDY, multi_modal_data={"image": images}))
            for index, (prompt, images) in enumerate(cases)]
        assert [output.token_ids for output in one_at_a_time] == expected
        assert all(len(output.log_probs) == GREEDY["max_tokens"] for output in one_at_a_time)
        await engine.clear_kv_cache()
        batch = await asyncio.gather(*(engine.generate(GenerateRequest(
            f"b{index}", prompt, GREEDY, multi_modal_data={"image": images}))
            for index, (prompt, images) in enumerate(cases)))
        assert [output.token_ids for output in batch] == expected
    finally:
        await engine.shutdown()


async def test_the_prefix_cache_reuses_an_image_only_when_it_is_the_same(vl_path, parts):
    """Two requests with the same image and text: the second computes only what follows the
    cached full blocks. A different image of the same size (the same tokens): nothing from its
    first image token on is reused."""
    hf, tokenizer, processor = parts
    pad = hf.config.image_token_id
    first, other = noise_image(7), noise_image(7).transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    prompt = render(tokenizer, processor, pad, [first], QUESTIONS[0])
    assert prompt == render(tokenizer, processor, pad, [other], QUESTIONS[0])
    image_start = pad_runs(prompt, pad)[0][0]
    engine = NativeRollout.create(vl_path, CONFIG)
    block = CONFIG.block_size
    try:
        async def computed(request_id: str, image) -> tuple[int, list[int]]:
            before = engine.counters["prompt_tokens_computed"]
            output = await engine.generate(GenerateRequest(request_id, prompt, GREEDY,
                                                           multi_modal_data={"image": [image]}))
            return engine.counters["prompt_tokens_computed"] - before, output.token_ids

        whole, tokens = await computed("x", first)
        assert whole == len(prompt)
        again, same = await computed("y", first)
        cached = (len(prompt) - 1) // block * block  # every full block but the last token's
        assert again == len(prompt) - cached and same == tokens
        different, _ = await computed("z", other)
        assert different == len(prompt) - image_start // block * block
        assert different > again
    finally:
        await engine.shutdown()


async def test_bad_image_input_fails_its_request_naming_it(vl_path, parts):
    hf, tokenizer, processor = parts
    pad = hf.config.image_token_id
    image = noise_image(3)
    prompt = render(tokenizer, processor, pad, [image], QUESTIONS[1])
    engine = NativeRollout.create(vl_path, CONFIG)
    try:
        cases = [
            ({"image": [image, image]}, prompt, "the prompt has 1 run(s) of image tokens "
                                                "(<|image_pad|>) for 2 image(s)"),
            ({"image": [b"not a png"]}, prompt, "image 0: not a readable image"),
            ({"video": [image]}, prompt, "multi_modal_data takes {'image': [images]}"),
            ({"image": [noise_image(11)]}, prompt, "expand each <|image_pad|> to its image's count"),
        ]
        for data, ids, words in cases:
            with pytest.raises(ValueError) as error:
                await engine.generate(GenerateRequest("bad", ids, GREEDY, multi_modal_data=data))
            assert "request 'bad'" in str(error.value) and words in str(error.value), error.value
        ok = await engine.generate(GenerateRequest("ok", prompt, GREEDY,
                                                   multi_modal_data={"image": [image]}))
        assert len(ok.token_ids) == GREEDY["max_tokens"]  # the bad ones left nothing behind
        # an image token after the images (one the policy sampled, in a resumed prompt) is a
        # plain token: served, at a text position
        resumed = prompt + [pad, 30]
        more = await engine.generate(GenerateRequest("resumed", resumed, GREEDY,
                                                     multi_modal_data={"image": [image]}))
        assert len(more.token_ids) == GREEDY["max_tokens"]
        images = engine.runner.vision.prepare("r", resumed, {"image": [image]})
        assert len(images.spans) == 1
        end = len(prompt)
        assert [axis[end] for axis in images.positions.tolist()] == \
            [images.positions[0, end - 1].item() + 1] * 3
    finally:
        await engine.shutdown()


async def test_a_text_model_refuses_images_naming_the_request():
    engine = NativeRollout.create(build_tiny_model(), CONFIG)
    try:
        with pytest.raises(ValueError, match="request 'r': multi_modal_data, but this model has "
                                             "no vision tower"):
            await engine.generate(GenerateRequest("r", [5, 6], GREEDY,
                                                  multi_modal_data={"image": [noise_image(1)]}))
    finally:
        await engine.shutdown()


def test_image_reading_and_pad_expansion_refuse_what_they_cannot_take(tmp_path):
    assert pad_runs([1, 9, 9, 2, 9], 9) == [(1, 2), (4, 1)]
    assert expand_image_pads([1, 9, 2, 9], 9, [3, 1], "row 4") == [1, 9, 9, 9, 2, 9]
    with pytest.raises(ValueError, match="row 4: 2 image placeholder\\(s\\) for 1 image\\(s\\)"):
        expand_image_pads([1, 9, 2, 9], 9, [3], "row 4")
    path = tmp_path / "x.png"
    noise_image(2).save(path)
    assert load_image(str(path), "row 1").size == noise_image(2).size
    assert load_image({"bytes": path.read_bytes(), "path": None}, "row 1").mode == "RGB"
    with pytest.raises(ValueError, match="row 2: not a readable image"):
        load_image(str(tmp_path / "missing.png"), "row 2")
    with pytest.raises(ValueError, match="row 3: int is not an image"):
        load_image(3, "row 3")
    huge = Image.new("1", (9000, 8000))
    with pytest.raises(ValueError, match="row 5: 9000 x 8000 pixels is more than"):
        load_image(huge, "row 5")
