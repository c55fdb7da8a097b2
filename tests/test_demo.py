"""The demo's pieces: problems are right, transcripts tokenise exactly as the tool loop does."""

import random

from transformers import AutoTokenizer

from tandem.demo.tasks import calculator_schemas, make_problem, transcript
from tandem.demo.warmup import WarmupRecipe, transcript_trajectory
from tandem.models.tiny import build_tiny_model
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
