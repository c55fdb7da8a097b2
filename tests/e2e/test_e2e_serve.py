"""`tandem serve` end to end, as a user reaches it: the CLI over a config, the official `openai`
client against it (chat, tool schemas, streaming, logprobs, the API key), and Ctrl-C."""

import json
import random
import re
import signal
import subprocess
import sys

import pytest

from tandem.config.load import load_config, to_yaml
from tandem.demo.tasks import SYSTEM_PROMPT, make_datasets, make_problem
from tandem.tools.calculator import evaluate_expression, format_number
from tandem.tools.registry import build_tool_registry

pytestmark = pytest.mark.slow
# a word problem as tiny:calculator was warmed up on: greedy, it answers with a calculator call
QUESTION = [{"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": make_problem(random.Random(0))["question"]}]


def serve(tmp_path):
    train, _ = make_datasets(tmp_path / "data", 4, 2, seed=0)
    config = load_config(overrides=[
        "model.path=tiny:calculator", f"data.train_files=[{train}]", "data.train_batch_size=2",
        "rollout.response_length=48", "rollout.kv_cache_memory_bytes=16777216",
        "actor.ppo_mini_batch_size=1", "rollout.openai_agent.served_model_name=tiny",
        "rollout.openai_agent.api_key=secret", f"trainer.output_dir={tmp_path / 'run'}"])
    (tmp_path / "serve.yaml").write_text(to_yaml(config))
    return subprocess.Popen([sys.executable, "-m", "tandem.cli", "serve", str(tmp_path / "serve.yaml")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.timeout(600)
def test_tandem_serve_answers_the_openai_client_and_stops_on_ctrl_c(tmp_path):
    import openai

    process = serve(tmp_path)
    try:
        line = process.stdout.readline()
        match = re.match(r"serving 'tiny' at (http://\S+)", line)
        assert match, line + process.stderr.read()[-3000:]
        client = openai.OpenAI(base_url=match[1], api_key="secret", max_retries=0, timeout=120)

        reply = client.chat.completions.create(model="tiny", messages=QUESTION, temperature=0,
                                               max_tokens=16, logprobs=True)
        choice = reply.choices[0]
        assert reply.usage.completion_tokens == len(choice.logprobs.content) > 0
        assert all(item.logprob <= 0.0 for item in choice.logprobs.content)
        text = "".join(item.token for item in choice.logprobs.content)
        # the stop token ends the reply: it has a logprob (it was sampled) but no text; the
        # content is the text with its outer whitespace trimmed, as the chat template keeps it
        assert text.removesuffix("<|im_end|>").strip() == choice.message.content

        chunks = list(client.chat.completions.create(model="tiny", messages=QUESTION,
                                                     temperature=0, max_tokens=16, stream=True))
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
        assert streamed == choice.message.content  # greedy: the same reply, in pieces
        assert chunks[-1].choices[0].finish_reason == choice.finish_reason

        tools = build_tool_registry(["calculator"]).schemas()
        with_tools = client.chat.completions.create(model="tiny", messages=QUESTION, tools=tools,
                                                    temperature=0, max_tokens=48)
        assert with_tools.choices[0].finish_reason == "tool_calls", with_tools
        (call,) = with_tools.choices[0].message.tool_calls
        assert call.function.name == "calculator" and call.id
        expression = json.loads(call.function.arguments)["expression"]
        # the tool's result goes back as the client sends it: the next turn answers in text
        result = format_number(evaluate_expression(expression))
        follow = client.chat.completions.create(
            model="tiny", tools=tools, temperature=0, max_tokens=24,
            messages=[*QUESTION, with_tools.choices[0].message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": result}])
        assert follow.choices[0].finish_reason == "stop" and follow.choices[0].message.content

        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=match[1], api_key="wrong", max_retries=0).chat.completions.create(
                model="tiny", messages=QUESTION, max_tokens=4)
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 0, err[-3000:]
    assert "Traceback" not in err
