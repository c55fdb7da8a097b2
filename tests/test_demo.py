"""The demo's pieces: problems are right, transcripts tokenise exactly as the tool loop does."""

import random

import pytest
from transformers import AutoTokenizer

from tandem.demo.tasks import calculator_schemas, make_problem, transcript
from tandem.demo.warmup import WarmupRecipe, transcript_trajectory
from tandem.models.tiny import SHIPPED_MODELS, build_tiny_model
from tandem.tools.calculator import evaluate_expression


def test_problems_are_consistent():
    rng = random.Random(0)
    for _ in range(200):
        problem = make_problem(rng)
        assert evaluate_expression(problem["expression"]) == problem["answer"]
        for number in problem["expression"].split()[::2]:
            assert number in problem["question"]


def test_transcript_masks_policy_tokens_only():
    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model())
    problem = {"question": "Ann has 123 eggs and gets 456 more. How many eggs?",
               "expression": "123 + 456", "answer": 579}
    trajectory = transcript_trajectory(tokenizer, transcript(problem, use_tool=True), calculator_schemas())
    tokens = trajectory.responses.tolist()
    mask = trajectory.response_mask.tolist()
    policy = tokenizer.decode([t for t, m in zip(tokens, mask) if m])
    context = tokenizer.decode([t for t, m in zip(tokens, mask) if not m])
    assert policy == ('<tool_call>{"name": "calculator", "arguments": {"expression": "123 + 456"}}'
                      '</tool_call><|im_end|>The answer is 579.<|im_end|>')
    assert context == "\n<|im_start|>user\n<tool_response>579</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert tokens[-1] == tokenizer.eos_token_id and mask[-1] == 1
    # the prompt is exactly what the tool loop renders
    prompt = tokenizer.apply_chat_template(transcript(problem, True)[:2], tools=calculator_schemas(),
                                           add_generation_prompt=True, return_dict=False)
    assert trajectory.prompts.tolist() == list(prompt)


def test_recipe_key_changes_with_recipe():
    assert WarmupRecipe("m").key() == WarmupRecipe("m").key()
    assert WarmupRecipe("m").key() != WarmupRecipe("m", tool_fraction=0.5).key()


def test_tool_copy_probability_is_the_product_of_the_policy_tokens_after_the_call_token():
    import math

    import torch
    from transformers import AutoModelForCausalLM

    from tandem.demo.warmup import tool_copy_log_probs, tool_copy_probability

    path = build_tiny_model()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    rng = random.Random(3)
    problems = [make_problem(rng) for _ in range(3)]
    expected = []
    for problem in problems:
        trajectory = transcript_trajectory(tokenizer, transcript(problem, True), calculator_schemas())
        ids = torch.cat([trajectory.prompts, trajectory.responses])[None]
        with torch.no_grad():
            log_probs = model(ids).logits[0, :-1].log_softmax(-1)
        prompt_length, mask = len(trajectory.prompts), trajectory.response_mask.tolist()
        policy = [i for i, m in enumerate(mask) if m][1:]  # every policy token but <tool_call>
        assert tokenizer.convert_ids_to_tokens(int(trajectory.responses[mask.index(1)])) == "<tool_call>"
        expected.append(sum(float(log_probs[prompt_length + i - 1, trajectory.responses[i]])
                            for i in policy))
    model.train()
    got = tool_copy_log_probs(model, tokenizer, problems)
    # float32 log-probs (~7 nats each) summed over ~35 tokens: error far below 1e-4 relative
    assert got.tolist() == pytest.approx(expected, rel=1e-4)
    assert expected[0] < -50  # a random model: copying is far from certain
    assert tool_copy_probability(model, tokenizer, problems) == pytest.approx(
        sum(math.exp(value) for value in expected) / 3, abs=1e-30)
    assert model.training  # the probe leaves the mode it found


def test_warm_up_gate_fails_clearly_when_copying_never_emerges(tmp_path, monkeypatch):
    from tandem.demo.warmup import warm_up

    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path))
    base = build_tiny_model()
    recipe = WarmupRecipe(str(base), steps=2, batch_size=2, tool_only_steps=1, gate_steps=1,
                          max_gate_steps=1, probe_problems=4)
    with pytest.raises(RuntimeError, match=r"after 2 tool-only steps .* < min_copy_probability 0.9"):
        warm_up(recipe, progress=False)
    assert not any(tmp_path.glob("demo-warmup-*/.complete"))  # nothing half-made is cached
    # a smoke warm-up (no longer than its tool-only phase) is not gated
    smoke = WarmupRecipe(str(base), steps=1, batch_size=2, probe_problems=4)
    assert (warm_up(smoke, progress=False) / "model.safetensors").exists()


@pytest.mark.parametrize("name", [
    pytest.param("tiny:demo", marks=pytest.mark.skipif(
        not (SHIPPED_MODELS["tiny:demo"] / "config.json").is_file(),
        reason="tiny:demo is not shipped yet: run `make demo-model` on a quiet box and commit "
               "src/tandem/models/demo_model")),
    "tiny:calculator"])
def test_the_shipped_models_load_and_say_how_they_were_made(name):
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tandem.demo.warmup import DEMO_MODEL
    from tandem.models.tiny import resolve_model_path

    path = resolve_model_path(name)
    assert path == SHIPPED_MODELS[name]
    recipe = json.loads((path / "recipe.json").read_text())
    assert recipe["made_by"].startswith("python -m tandem.demo.warmup")
    assert recipe["base_model"]["hidden_size"] == DEMO_MODEL.hidden_size
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert model.config.hidden_size == DEMO_MODEL.hidden_size
    prompt = tokenizer.apply_chat_template(transcript(make_problem(random.Random(0)), True)[:2],
                                           tools=calculator_schemas(), add_generation_prompt=True,
                                           return_dict=False)
    assert len(prompt) < 256  # fits demo.yaml's rollout.prompt_length
