"""Rows with images through the agent loops into the native engine (a tiny Qwen2-VL): the prompt is
the chat template's rendering with each image's `<|image_pad|>` expanded to its token count, the
request carries the images, and the trajectory's tokens are the engine's for that prompt and
those images; in the tool loop too, where a tool may return images. Rows with images need a
vision-language policy, and what such a run cannot do is refused at load, naming the field."""

from __future__ import annotations

import pytest
from PIL import Image
from transformers import AutoImageProcessor, AutoTokenizer

from tandem.agent import AgentLoopRunner, DatasetRow
from tandem.agent.chat_format import ChatFormat
from tandem.config.schema import MultiTurnConfig, RolloutConfig
from tandem.models import TinyModelSpec, build_tiny_model
from tandem.multimodal import pad_runs, process_images
from tandem.rollout.native import NativeRollout
from tandem.types import GenerateRequest


@pytest.fixture(scope="module")
def vl_path():
    return build_tiny_model(TinyModelSpec(architecture="qwen2_vl"))


def picture(colour, size) -> Image.Image:
    image = Image.new("RGB", size, colour)
    image.putpixel((3, 5), (255 - colour[0], 10, 200))
    return image


@pytest.mark.parametrize("multi_turn", [False, True])
async def test_a_row_with_images_reaches_the_engine_with_its_images(vl_path, multi_turn):
    tokenizer = AutoTokenizer.from_pretrained(vl_path)
    processor = AutoImageProcessor.from_pretrained(vl_path)
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    config = RolloutConfig(prompt_length=512, response_length=6, n=1,
                           kv_cache_memory_bytes=8 << 20,
                           multi_turn=MultiTurnConfig(enable=multi_turn))
    images = [picture((200, 30, 30), (60, 40)), picture((0, 90, 250), (100, 100))]
    row = DatasetRow(messages=[{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "How many shapes? "}, {"type": "image"}]}],
        uid="v0", images=images, do_sample=False)
    engine = NativeRollout.create(vl_path, config)
    try:
        tools = None
        if multi_turn:
            from tandem.tools.registry import ToolRegistry
            from tandem.tools.calculator import CalculatorTool

            tools = ToolRegistry([CalculatorTool()])
        runner = AgentLoopRunner.from_tokenizer(engine, tokenizer, config, tools=tools,
                                                image_processor=processor)
        [trajectory] = await runner.run([row])
        prompt = trajectory.prompts.tolist()
        counts = process_images(processor, images, "test").token_counts
        assert [length for _, length in pad_runs(prompt, pad)] == counts
        assert "<|im_start|>user\n<|vision_start|><|image_pad|>" in tokenizer.decode(prompt)
        direct = await engine.generate(GenerateRequest(
            "direct", prompt, {"temperature": 0, "max_tokens": 6},
            multi_modal_data={"image": images}))
        model_tokens = [t for t, m in zip(trajectory.responses.tolist(),
                                          trajectory.response_mask.tolist()) if m]
        assert model_tokens[:len(direct.token_ids)] == direct.token_ids
    finally:
        await engine.shutdown()


def test_a_prompt_with_images_needs_the_policys_image_processor(vl_path):
    chat = ChatFormat(AutoTokenizer.from_pretrained(vl_path))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "?"}]}]
    with pytest.raises(ValueError, match="prompt: 1 image\\(s\\), but the policy has no image "
                                         "processor"):
        chat.prompt_ids(messages, images=[picture((1, 2, 3), (30, 30))])


def test_a_run_with_images_needs_a_vision_language_policy_and_what_it_runs_with(tmp_path):
    """Rows with images and a text model: refused naming the row; with tiny:qwen2_vl the job
    checks pass; what a vision-language run cannot do yet is refused naming the field."""
    import json

    from tandem.config import ConfigError, load_config
    from tandem.preflight import check_job

    picture((9, 9, 9), (30, 30)).save(tmp_path / "a.png")
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"prompt": [{"role": "user", "content": "<image>?"}],
                                "images": ["a.png"], "reward_model": {"ground_truth": "1"},
                                "data_source": "gsm8k"}) + "\n")
    common = [f"data.train_files=[{data}]", "data.val_files=[]", "data.train_batch_size=1",
              "actor.ppo_mini_batch_size=1", f"trainer.output_dir={tmp_path / 'run'}"]
    with pytest.raises(ConfigError, match="row 0: has 1 image\\(s\\), but model.path=tiny:qwen2 is "
                                          "a text model"):
        check_job(load_config(overrides=[*common, "model.path=tiny:qwen2"]))
    check_job(load_config(overrides=[*common, "model.path=tiny:qwen2_vl"]))
    check_job(load_config(overrides=[*common, "model.path=tiny:qwen2_vl", "rollout.name=vllm",
                                     "algorithm.adv_estimator=gae", "critic.enable=true"]))
    for override, words in (("rollout.disaggregation.enabled=true rollout.nnodes=1 "
                             "rollout.n_gpus_per_node=2",
                             "images are served by one plain engine per replica"),
                            ("actor.fsdp_size=2 trainer.n_devices=2",
                             "actor.fsdp_size: is 2; model.path=tiny:qwen2_vl is a vision")):
        with pytest.raises(ConfigError, match=words):
            check_job(load_config(overrides=[*common, "model.path=tiny:qwen2_vl",
                                             *override.split()]))


async def test_an_episode_that_starts_with_the_rows_messages_keeps_its_images(vl_path):
    """An environment's episode passes the row's messages and its own turns after them: the
    row's images still reach the engine and the trajectory."""
    from tandem.agent.session import Session
    from tandem.agent.tool_loop import ToolAgentLoop
    from tandem.tools.registry import ToolRegistry

    tokenizer = AutoTokenizer.from_pretrained(vl_path)
    config = RolloutConfig(prompt_length=256, response_length=4, n=1,
                           kv_cache_memory_bytes=8 << 20, multi_turn=MultiTurnConfig(enable=True))
    image = picture((10, 200, 10), (40, 40))
    row = DatasetRow(messages=[{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "Which?"}]}], uid="e", images=[image],
        do_sample=False)
    processor = AutoImageProcessor.from_pretrained(vl_path)
    engine = NativeRollout.create(vl_path, config)
    try:
        loop = ToolAgentLoop(engine, ChatFormat(tokenizer, image_processor=processor), config,
                             ToolRegistry([]))
        episode = [*row.messages, {"role": "user", "content": "Look again."}]
        trajectory = await loop.run(Session(row, 0, "e-0"), messages=episode)
        assert trajectory.images is not None
        assert trajectory.images.token_counts == process_images(processor, [image],
                                                                "t").token_counts
    finally:
        await engine.shutdown()


class Camera:
    """A tool that answers with a picture (or `image`) and a line of text."""

    name = "camera"
    description = "Take a picture."
    parameters = {"type": "object", "properties": {}, "additionalProperties": False}

    def __init__(self, image=None) -> None:
        self.image = image if image is not None else picture((20, 160, 60), (70, 50))

    async def execute(self, arguments, context):
        from tandem.tools.registry import ToolResult

        return ToolResult("here it is", images=[self.image])


class CameraFirst:
    """The policy's first turn is forced (`first`: a call to `camera`; log-probs 0, not scored
    here); every later turn is the engine's. Records every request."""

    def __init__(self, engine, first: list[int]) -> None:
        self.engine, self.first, self.requests = engine, first, []

    async def generate(self, request):
        from tandem.types import TokenOutput

        self.requests.append(request)
        if len(self.requests) == 1:
            return TokenOutput(self.first, [0.0] * len(self.first), "completed",
                               {"global_steps": 0})
        return await self.engine.generate(request)


@pytest.fixture(scope="module")
def noisy_vl(tmp_path_factory):
    from test_engine_vision import noisy_vl_model

    return noisy_vl_model(tmp_path_factory.mktemp("vl-tool"))


ROW_IMAGE = picture((200, 30, 30), (60, 40))


async def camera_session(path, room: int, before: list[int] = (), camera=None,
                         processor: bool = True):
    """One tool-loop session whose first turn calls the camera (after `before` tokens), with
    `room` response tokens after that call; returns (trajectory, client, call ids)."""
    from tandem.tools.registry import ToolRegistry

    tokenizer = AutoTokenizer.from_pretrained(path)
    call = list(before) + tokenizer.encode(
        '<tool_call>{"name": "camera", "arguments": {}}</tool_call>',
        add_special_tokens=False) + [tokenizer.eos_token_id]
    config = RolloutConfig(prompt_length=256, n=1, kv_cache_memory_bytes=16 << 20,
                           response_length=len(call) + room,
                           multi_turn=MultiTurnConfig(enable=True, max_assistant_turns=2))
    row = DatasetRow(messages=[{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "Look."}]}], uid="t0", images=[ROW_IMAGE],
        do_sample=False)
    engine = NativeRollout.create(path, config)
    try:
        client = CameraFirst(engine, call)
        runner = AgentLoopRunner.from_tokenizer(
            client, tokenizer, config, tools=ToolRegistry([camera or Camera()]),
            image_processor=AutoImageProcessor.from_pretrained(path) if processor else None)
        if not processor:  # a text policy's loop: the row holds no image
            row = DatasetRow(messages=[{"role": "user", "content": "Look."}], uid="t0",
                             do_sample=False)
        [trajectory] = await runner.run([row])
    finally:
        await engine.shutdown()
    return trajectory, client, call


async def test_a_tool_that_returns_an_image_shows_it_to_the_policy(noisy_vl):
    """The tool turn holds the image's run of pads (mask 0) after the row's image; the next
    request carries both images; the trajectory keeps both, and the actor's log-probs and the
    engine's next turn are within the float32 bound of the exact ones with the tool's image at
    its place."""
    import torch
    from transformers import AutoModelForImageTextToText

    from float_bounds import assert_within, token_logprob_bounds
    from tandem.batch.jagged import field_lengths, trajectories_to_batch
    from tandem.training.forward import actor_forward
    from tandem.training.vision_inputs import sample_positions

    processor = AutoImageProcessor.from_pretrained(noisy_vl)
    pad = AutoTokenizer.from_pretrained(noisy_vl).convert_tokens_to_ids("<|image_pad|>")
    trajectory, client, call = await camera_session(noisy_vl, room=200)
    response, mask = trajectory.responses.tolist(), trajectory.response_mask.tolist()
    shot = process_images(processor, [Camera().image], "test")
    [(start, length)] = pad_runs(response, pad)
    assert length == shot.token_counts[0] and not any(mask[start:start + length])
    assert [len(r.multi_modal_data["image"]) for r in client.requests] == [1, 2]
    assert trajectory.images.grid_thw.tolist() == [
        *process_images(processor, [ROW_IMAGE], "test").grid_thw.tolist(),
        *shot.grid_thw.tolist()]
    second = [i for i, m in enumerate(mask) if m][len(call):]  # the engine's own turn
    assert second and second[0] > start + length

    model = AutoModelForImageTextToText.from_pretrained(noisy_vl, dtype=torch.float32).eval()
    with torch.no_grad():
        actor = actor_forward(model, trajectories_to_batch([trajectory]), use_remove_padding=True)
        rows = torch.cat(list(model.model.get_image_features(
            trajectory.images.pixel_values, trajectory.images.grid_thw).pooler_output))
    positions = sample_positions(model, trajectory.input_ids, trajectory.images.grid_thw)
    exact, bound = token_logprob_bounds(model, trajectory.prompts.tolist(), response,
                                        image_rows=rows, position_ids=positions)
    assert_within(actor.log_probs, exact, bound, "actor with a tool's image")
    engine_turn = torch.tensor(second)
    assert_within(trajectory.rollout_log_probs[engine_turn], exact[engine_turn],
                  bound[engine_turn], "the engine's turn after the tool's image")
    assert field_lengths(trajectories_to_batch([trajectory])["image_grid_thw"]).tolist() == [2]

    # the turn cut by response_length before its image, then inside the image's run: the
    # tokens before the image stay, the image goes nowhere (a cut run would not match it)
    for room, kept in ((3, 3), (start - len(call) + length // 2, start - len(call))):
        cut, cut_client, _ = await camera_session(noisy_vl, room=room)
        assert pad not in cut.responses.tolist() and len(cut.responses) == len(call) + kept
        assert cut.images.grid_thw.shape[0] == 1 and cut.stop_reason == "length"
        assert len(cut_client.requests) == 1


async def test_tool_images_that_cannot_be_shown_are_error_results_naming_the_tool(noisy_vl):
    """An unreadable image, a text policy, and an image token the policy wrote before the
    tool's image (it would take the image's place): the result becomes an error naming the
    tool, its images are not shown, and the session goes on."""
    pad = AutoTokenizer.from_pretrained(noisy_vl).convert_tokens_to_ids("<|image_pad|>")
    text_model = build_tiny_model()
    cases = [(noisy_vl, dict(camera=Camera(b"not an image")),
              "tool camera's result, image 0: not a readable image"),
             (text_model, dict(processor=False),
              "tool camera's result: 1 image(s), but the policy has no image processor"),
             (noisy_vl, dict(before=[pad]),
              "its 1 image(s) cannot follow the image token (<|image_pad|>) written earlier")]
    for path, options, words in cases:
        trajectory, client, _ = await camera_session(path, room=200, **options)
        tool = next(m for m in trajectory.metadata["messages"] if m["role"] == "tool")
        assert tool["content"].startswith("here it is\n[Error: ") and words in tool["content"]
        assert trajectory.metadata["tool_errors"] == 1 and len(client.requests) == 2
        shown = trajectory.images.grid_thw.shape[0] if trajectory.images is not None else 0
        assert shown == (1 if path == noisy_vl else 0)
