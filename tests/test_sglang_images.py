"""SGLang and images (rollout/sglang.py; SGLang runs on CUDA only, so its request path runs here
against a recording stand-in of SGLang's tokenizer manager): each image's run of pads goes as
one pad beside the image in `image_data`, SGLang's expanded prompt length is checked, a text
model and a bad image fail their request, named; `synced_in_full` (a frozen tower may stay out
of a sync) only after a whole update since start or since a weight release. Written for CUDA,
not run on a GPU."""

from __future__ import annotations

import sys
import types

import pytest
from PIL import Image

from tandem.rollout.sglang import SGLangRollout
from tandem.types import GenerateRequest

PAD = 9
SAMPLING = {"temperature": 0, "max_tokens": 3, "logprobs": True}


class TokenizerManager:
    """Records each GenerateReqInput; answers 3 tokens with SGLang's meta_info, its prompt
    length the request's ids with each image's pad expanded to `per_image` tokens."""

    def __init__(self, per_image: int) -> None:
        self.per_image, self.requests = per_image, []

    def generate_request(self, request, _):
        self.requests.append(request)
        images = len(getattr(request, "image_data", []))
        expanded = len(request.input_ids) + (self.per_image - 1) * images

        async def answer():
            yield {"output_ids": [1, 2, 3], "meta_info": {
                "prompt_tokens": expanded, "cached_tokens": 0, "finish_reason": {"type": "length"},
                "output_token_logprobs": [(-0.5, t, None) for t in (1, 2, 3)]}}
        return answer()

    async def get_internal_state(self):
        return [{"memory_usage": {"weight": 0.0, "kvcache": 0.0}}]

    async def release_memory_occupation(self, request, _):
        self.requests.append(request)

    async def resume_memory_occupation(self, request, _):
        self.requests.append(request)

    async def update_weights_from_tensor(self, request, _):
        self.requests.append(request)

    async def flush_cache(self):
        pass


@pytest.fixture
def sglang_io(monkeypatch):
    """sglang.srt.managers.io_struct with a GenerateReqInput that keeps its fields."""
    module = types.ModuleType("sglang.srt.managers.io_struct")
    for request in ("GenerateReqInput", "ReleaseMemoryOccupationReqInput",
                    "ResumeMemoryOccupationReqInput", "UpdateWeightsFromTensorReqInput"):
        setattr(module, request, lambda **fields: types.SimpleNamespace(**fields))
    utils = types.ModuleType("sglang.srt.utils")
    utils.MultiprocessingSerializer = types.SimpleNamespace(serialize=lambda bucket: bucket)
    for name in ("sglang", "sglang.srt", "sglang.srt.managers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "sglang.srt.managers.io_struct", module)
    monkeypatch.setitem(sys.modules, "sglang.srt.utils", utils)


SHAPES = {"model.visual.proj.weight": (2, 2), "model.language_model.norm.weight": (2,)}


def engine(per_image: int, image_token_id: int | None = PAD) -> SGLangRollout:
    return SGLangRollout(types.SimpleNamespace(tokenizer_manager=TokenizerManager(per_image)),
                         context_len=256, vocab_size=64, shapes=SHAPES, tp_size=1,
                         image_token_id=image_token_id)


async def test_each_images_run_goes_as_one_pad_beside_the_image(sglang_io):
    rollout = engine(per_image=3)
    first, second = Image.new("RGB", (30, 30)), Image.new("RGB", (40, 30))
    prompt = [1, PAD, PAD, PAD, 2, PAD, PAD, PAD, 5, PAD]  # the last pad: a sampled token
    output = await rollout.generate(GenerateRequest(
        "r", prompt, SAMPLING, multi_modal_data={"image": [first, second]}))
    [request] = rollout.engine.tokenizer_manager.requests
    assert request.input_ids == [1, PAD, 2, PAD, 5, PAD]
    assert [image.size for image in request.image_data] == [(30, 30), (40, 30)]
    assert output.token_ids == [1, 2, 3] and output.log_probs == [-0.5] * 3
    await rollout.generate(GenerateRequest("text", [1, 2], SAMPLING))
    assert not hasattr(rollout.engine.tokenizer_manager.requests[-1], "image_data")


async def test_a_prompt_sglang_expands_otherwise_fails_that_request(sglang_io):
    rollout = engine(per_image=4)  # SGLang's processor makes 4 tokens of an image, the prompt 3
    with pytest.raises(ValueError, match="request 'r': SGLang expanded the images to a prompt "
                                         "of 6 tokens, not the request's 5"):
        await rollout.generate(GenerateRequest("r", [1, PAD, PAD, PAD, 2], SAMPLING,
                                               multi_modal_data={"image": [Image.new("RGB",
                                                                                     (9, 9))]}))


async def test_bad_images_and_a_text_model_fail_their_request_named(sglang_io):
    with pytest.raises(ValueError, match="request 'r', image 0: not a readable image"):
        await engine(3).generate(GenerateRequest("r", [1, PAD, 2], SAMPLING,
                                                 multi_modal_data={"image": [b"no png"]}))
    with pytest.raises(ValueError, match="request 'r': the prompt has 1 run\\(s\\) of image "
                                         "tokens"):
        await engine(3).generate(GenerateRequest("r", [1, PAD, 2], SAMPLING, multi_modal_data={
            "image": [Image.new("RGB", (9, 9))] * 2}))
    with pytest.raises(ValueError, match="request 't': multi_modal_data, but this model has no "
                                         "vision tower"):
        await engine(3, image_token_id=None).generate(GenerateRequest(
            "t", [1, PAD, 2], SAMPLING, multi_modal_data={"image": [Image.new("RGB", (9, 9))]}))


async def test_only_a_whole_update_since_start_or_a_weight_release_counts_as_synced(sglang_io):
    """SGLang's released weights come back as undefined memory: until a whole update, a sync
    must not leave frozen weights out (BaseRollout.synced_in_full)."""
    import torch

    rollout = engine(3)
    whole = [(name, torch.zeros(shape)) for name, shape in SHAPES.items()]
    language = whole[1:]
    assert not rollout.synced_in_full()
    await rollout.update_weights(iter(language), 1, partial=True)
    assert not rollout.synced_in_full()
    await rollout.update_weights(iter(whole), 2)
    assert rollout.synced_in_full()
    await rollout.update_weights(iter(language), 3, partial=True)
    assert rollout.synced_in_full()
    await rollout.sleep(["weights"])
    await rollout.wake_up(["weights"])
    assert not rollout.synced_in_full()
    await rollout.update_weights(iter(language), 4, partial=True)
    assert not rollout.synced_in_full() and rollout.version == 4
    await rollout.update_weights(iter(whole), 5)
    assert rollout.synced_in_full()
