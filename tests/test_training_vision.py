"""The training forward of a vision-language model (training/vision_inputs.py) on trajectories
the native engine sampled with images (a tiny Qwen2-VL and Qwen2.5-VL through the single-turn
agent loop): the
batch carries each sample's pixel values and grids; each sample's [3, L] rotary positions are
the engine's; the actor's log-probs, packed and padded, and the engine's are both within the
float32 bound of the exact (float64) ones."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

from float_bounds import assert_within, token_logprob_bounds
from test_engine_vision import FAMILIES, noise_image, noisy_vl_model
from tandem.agent import AgentLoopRunner, DatasetRow
from tandem.batch.jagged import batch_to_trajectories, field_lengths, trajectories_to_batch
from tandem.batch.padding import pad_to_multiple
from tandem.config.schema import RolloutConfig
from tandem.rollout.engine.vision import VisionTower
from tandem.rollout.native import NativeRollout
from tandem.training.forward import actor_forward
from tandem.training.vision_inputs import sample_positions

QUESTIONS = ["What is here?", "Count them.", "Which colour?"]


@pytest.fixture(scope="module", params=FAMILIES)
def vl_path(tmp_path_factory, request):
    return noisy_vl_model(tmp_path_factory.mktemp("vl-train"), request.param)


@pytest.fixture(scope="module")
def sampled(vl_path):
    return asyncio.run(sample(vl_path))


async def sample(vl_path):
    """5 trajectories sampled at temperature 1: 4 rows with 1-3 images and one without."""
    tokenizer = AutoTokenizer.from_pretrained(vl_path)
    config = RolloutConfig(prompt_length=256, response_length=10, n=1, temperature=1.0,
                           kv_cache_memory_bytes=16 << 20, seed=3)
    rng = random.Random(2)
    rows = []
    for index in range(5):
        images = [noise_image(50 + 10 * index + k) for k in range(rng.randint(1, 3))] \
            if index < 4 else []
        content = [{"type": "image"} for _ in images] + [
            {"type": "text", "text": QUESTIONS[index % 3]}]
        rows.append(DatasetRow(messages=[{"role": "user", "content": content}], uid=f"r{index}",
                               images=images))
    engine = NativeRollout.create(vl_path, config)
    try:
        runner = AgentLoopRunner.from_tokenizer(
            engine, tokenizer, config, image_processor=AutoImageProcessor.from_pretrained(vl_path))
        return await runner.run(rows), rows
    finally:
        await engine.shutdown()


def test_the_batch_carries_each_samples_images_and_survives_padding(sampled):
    trajectories, rows = sampled
    batch = trajectories_to_batch(trajectories)
    assert field_lengths(batch["image_grid_thw"]).tolist() == [len(row.images) for row in rows]
    for trajectory, again in zip(trajectories, batch_to_trajectories(batch)):
        if trajectory.images is None:
            assert again.images is None
        else:
            assert torch.equal(again.images.pixel_values, trajectory.images.pixel_values)
            assert torch.equal(again.images.grid_thw, trajectory.images.grid_thw)
    padded = pad_to_multiple(batch, 4, eos_token_id=0)
    assert field_lengths(padded["image_grid_thw"]).tolist()[5:] == [0, 0, 0]


def test_each_samples_rotary_positions_are_the_engines(vl_path, sampled):
    trajectories, _ = sampled
    model = AutoModelForImageTextToText.from_pretrained(vl_path, dtype=torch.float32)
    tower = VisionTower(model, vl_path)
    for trajectory, row in zip(trajectories, sampled[1]):
        ids = trajectory.input_ids
        positions = sample_positions(model, ids, trajectory.images.grid_thw
                                     if trajectory.images is not None else torch.zeros(0, 3))
        assert positions.shape == (3, len(ids))
        if row.images:
            engine = tower.prepare("r", trajectory.prompts.tolist(), {"image": row.images})
            assert positions.tolist() == engine.positions_of(0, len(ids))
        else:
            assert positions.tolist() == [list(range(len(ids)))] * 3


@pytest.mark.parametrize("packed", [True, False])
def test_the_actors_log_probs_and_the_engines_are_within_the_float32_bound(vl_path, sampled,
                                                                           packed):
    trajectories, _ = sampled
    model = AutoModelForImageTextToText.from_pretrained(vl_path, dtype=torch.float32).eval()
    batch = trajectories_to_batch(trajectories)
    with torch.no_grad():
        output = actor_forward(model, batch, use_remove_padding=packed)
    actor = output.log_probs.split(field_lengths(batch["responses"]).tolist())
    for trajectory, trained in zip(trajectories, actor):
        prompt, response = trajectory.prompts.tolist(), trajectory.responses.tolist()
        rows = positions = None
        if trajectory.images is not None:
            with torch.no_grad():
                features = model.model.get_image_features(trajectory.images.pixel_values,
                                                          trajectory.images.grid_thw)
            rows = torch.cat(list(features.pooler_output))
            positions = sample_positions(model, trajectory.input_ids, trajectory.images.grid_thw)
        exact, bound = token_logprob_bounds(model, prompt, response, image_rows=rows,
                                            position_ids=positions)
        assert_within(trained, exact, bound, f"actor ({'packed' if packed else 'padded'})")
        assert_within(trajectory.rollout_log_probs, exact, bound, "engine")


@pytest.mark.parametrize("packed", [True, False])
def test_an_image_token_the_policy_sampled_is_a_plain_token(vl_path, sampled, packed):
    """A response holding <|image_pad|> (the policy may sample it): the images are the prompt's
    runs only, the sampled one is looked up as a token, as the engine does; within the bound."""
    import dataclasses

    trajectory = next(t for t in sampled[0] if t.images is not None and len(t.responses) >= 2)
    model = AutoModelForImageTextToText.from_pretrained(vl_path, dtype=torch.float32).eval()
    responses = trajectory.responses.clone()
    responses[1] = model.config.image_token_id
    changed = dataclasses.replace(trajectory, responses=responses)
    with torch.no_grad():
        output = actor_forward(model, trajectories_to_batch([changed]), use_remove_padding=packed)
        rows = torch.cat(list(model.model.get_image_features(
            changed.images.pixel_values, changed.images.grid_thw).pooler_output))
    positions = sample_positions(model, changed.input_ids, changed.images.grid_thw)
    exact, bound = token_logprob_bounds(model, changed.prompts.tolist(), responses.tolist(),
                                        image_rows=rows, position_ids=positions)
    assert_within(output.log_probs, exact, bound, "actor with a sampled image token")


@pytest.mark.parametrize("packed", [True, False])
def test_the_critics_values_see_each_samples_images(vl_path, sampled, packed):
    """A vision-language critic (ValueModel over the VLM's backbone): its packed and padded
    values at the response positions equal the value head on HF's own forward of each whole
    sample with its pixel values, both computed in float64 (unit roundoff 1.1e-16 through a few
    thousand operations: a gap over 1e-10 is another computation, not rounding), the critic's
    then rounded once to float32."""
    from tandem.multimodal import image_runs, image_types
    from tandem.training import packed_attention
    from tandem.training.critic import ValueModel
    from tandem.training.forward import critic_forward

    trajectories, _ = sampled
    critic = ValueModel.from_pretrained(vl_path, torch.float64,
                                        packed_attention.register()).eval()
    with torch.no_grad():
        values = critic_forward(critic, trajectories_to_batch(trajectories), packed).values
        expected = []
        for trajectory in trajectories:
            ids, prompt = trajectory.input_ids, len(trajectory.prompts)
            inputs = {}
            if trajectory.images is not None:
                runs = image_runs(ids.tolist(), critic.config.image_token_id,
                                  len(trajectory.images.grid_thw), "test")
                inputs = {"pixel_values": trajectory.images.pixel_values.double(),
                          "image_grid_thw": trajectory.images.grid_thw,
                          "mm_token_type_ids": image_types(len(ids), runs)[None]}
            hidden = critic.model(input_ids=ids[None], **inputs).last_hidden_state
            expected.append(critic.value_head(hidden)[0, prompt - 1:len(ids) - 1, 0])
    expected = torch.cat(expected)
    assert values.shape == expected.shape
    # critic_forward returns float32: its one rounding (2^-24 relative) on top of float64's
    assert ((values.double() - expected).abs() <= expected.abs() * 2.0 ** -24 + 1e-10).all()


def test_lora_adapts_the_language_model_and_never_the_vision_tower():
    """Qwen2.5-VL's vision MLPs are named like the decoder's (gate/up/down_proj): the adapters
    still sit on the language model only."""
    from tandem.config.schema import LoraConfig
    from tandem.models import TinyModelSpec, build_tiny_model
    from tandem.training.lora import apply_lora

    model = AutoModelForImageTextToText.from_pretrained(
        build_tiny_model(TinyModelSpec(architecture="qwen2_5_vl")), dtype=torch.float32)
    assert any("visual" in name and name.endswith("mlp.gate_proj")
               for name, _ in model.named_modules())
    adapted = [name for name, _ in apply_lora(model, LoraConfig(rank=4)).named_parameters()
               if "lora_" in name]
    assert adapted and not any("visual" in name for name in adapted)
    assert any("language_model" in name and "mlp.gate_proj" in name for name in adapted)
