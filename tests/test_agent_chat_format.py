"""ChatFormat with the tiny model's tokenizer: tool turns are appended as template deltas, and
the stream equals what the template renders for the whole conversation (never re-tokenized)."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from tandem.agent import ChatFormat, DatasetRow, Session, ToolAgentLoop
from tandem.config.schema import MultiTurnConfig, RolloutConfig
from tandem.models.tiny import build_tiny_model
from tandem.tools.calculator import CalculatorTool
from tandem.tools.registry import ToolRegistry
from tandem.types import TokenOutput

# Separators before every message but the first and before the generation prompt, a blank line
# after every end-of-turn token, and tool results wrapped as a user turn.
SEPARATOR_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools: {{ tools | map(attribute='function.name') | join(',') }}"
    "<|im_end|>\n\n{% endif %}"
    "{%- for message in messages %}{%- if not loop.first %}=== {% endif %}"
    "{%- if message.role == 'tool' %}<|im_start|>user\n<tool_response>{{ message.content }}"
    "</tool_response><|im_end|>\n\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n\n{% endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}=== <|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(build_tiny_model())


@pytest.fixture
def separator_tokenizer(tokenizer):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    tokenizer.chat_template = SEPARATOR_TEMPLATE
    return tokenizer


def render(tokenizer, messages, tools=None, add_generation_prompt=False):
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=False,
                                         add_generation_prompt=add_generation_prompt)


class TextClient:
    """Replies with the canonical tokens of scripted texts, each followed by the eos token."""

    def __init__(self, tokenizer, replies, with_eos=True):
        self.tokenizer, self.replies, self.with_eos = tokenizer, list(replies), with_eos
        self.prompts = []

    async def generate(self, request):
        request_id, prompt_ids, sampling_params = request.request_id, request.prompt_ids, request.sampling
        self.prompts.append(list(prompt_ids))
        ids = self.tokenizer.encode(self.replies.pop(0), add_special_tokens=False)
        ids += [self.tokenizer.eos_token_id] if self.with_eos else []
        return TokenOutput(ids, [-0.5] * len(ids), "completed", {"global_steps": 0})


def calculator_call(expression):
    return '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>' % expression


@pytest.mark.parametrize("with_eos", [True, False])
@pytest.mark.parametrize("template", ["tiny", "separators"])
async def test_stream_equals_the_template_render_of_the_whole_conversation(
        tokenizer, separator_tokenizer, template, with_eos):
    tok = separator_tokenizer if template == "separators" else tokenizer
    replies = [calculator_call("2 + 3") + calculator_call("4 * 5"), calculator_call("5 - 1"),
               "The answer is 4."]
    client = TextClient(tok, replies, with_eos)
    tools = ToolRegistry([CalculatorTool()])
    config = RolloutConfig(prompt_length=256, response_length=512,
                           multi_turn=MultiTurnConfig(enable=True, tools=["calculator"]))
    row = DatasetRow(messages=[{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": "What is 2 + 3?"}], uid="u")
    trajectory = await ToolAgentLoop(client, ChatFormat(tok), config, tools).run(
        Session(row, 0, "u-0"))

    conversation = row.messages + [
        {"role": "assistant", "content": replies[0]}, {"role": "tool", "content": "5"},
        {"role": "tool", "content": "20"}, {"role": "assistant", "content": replies[1]},
        {"role": "tool", "content": "4"}, {"role": "assistant", "content": replies[2]}]
    assert trajectory.metadata["messages"] == conversation
    expected = render(tok, conversation, tools.schemas())
    stream = trajectory.input_ids.tolist()
    # The stream is the render up to the last model token; only the closing newline(s) follow.
    end = len(stream) if with_eos else len(stream) + 1  # the engine dropped the final eos
    assert stream == expected[:len(stream)]
    assert tok.decode(expected[end:]) == ("\n\n" if template == "separators" else "\n")
    assert trajectory.prompts.tolist() == render(tok, row.messages, tools.schemas(), True)
    # mask 1 exactly on the model's own tokens, each turn sent as prompt + response so far
    model_tokens = [t for reply in replies for t in
                    tok.encode(reply, add_special_tokens=False)
                    + ([tok.eos_token_id] if with_eos else [])]
    response = trajectory.responses.tolist()
    mask = trajectory.response_mask.tolist()
    assert [t for t, m in zip(response, mask) if m == 1] == model_tokens
    assert sum(mask) == len(model_tokens)
    assert client.prompts[1] == stream[:len(client.prompts[1])]
    assert trajectory.stop_reason == "completed" and trajectory.metadata["tool_calls"] == 3


def test_tool_turn_delta_tokens(tokenizer):
    chat_format = ChatFormat(tokenizer)
    after_eos = chat_format.tool_turn_ids([{"role": "tool", "content": "5"}], after_stop_token=True)
    assert tokenizer.decode(after_eos) == ("\n<|im_start|>user\n<tool_response>5</tool_response>"
                                           "<|im_end|>\n<|im_start|>assistant\n")
    without = chat_format.tool_turn_ids([{"role": "tool", "content": "5"}], after_stop_token=False)
    assert without == [tokenizer.eos_token_id] + after_eos


def test_unstable_history_template_is_rejected(tokenizer):
    tok = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    # renders the last message differently, like templates that strip earlier reasoning
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n"
                         "{% if loop.last %}LAST {% endif %}{{ m.content }}<|im_end|>\n{% endfor %}")
    with pytest.raises(ValueError, match="renders earlier turns differently"):
        ChatFormat(tok).tool_turn_ids([{"role": "tool", "content": "5"}], True)


def test_tokenizer_without_chat_template_is_rejected(tokenizer):
    tok = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat_template"):
        ChatFormat(tok)
