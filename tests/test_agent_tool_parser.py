"""Hermes/Qwen tool-call parsing: well-formed calls, and every malformed shape as an error."""

import pytest

from tandem.agent.tool_parser import parse_tool_calls


def test_calls_in_order_and_content_outside_them():
    text = ('Let me compute. <tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}'
            '</tool_call>\n<tool_call>\n{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}\n'
            '</tool_call>')
    content, calls = parse_tool_calls(text)
    assert content == "Let me compute."
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("calculator", {"expression": "1+2"}, None), ("python", {"code": "print(1)"}, None)]


def test_no_calls():
    assert parse_tool_calls("The answer is 5.") == ("The answer is 5.", [])


@pytest.mark.parametrize("body, words", [
    ('{"name": "calculator", "arguments": {"expression": 1', "not valid JSON"),
    ('["calculator"]', 'string "name"'),
    ('{"arguments": {}}', 'string "name"'),
    ('{"name": "calculator", "arguments": [1]}', '"arguments" must be a JSON object'),
    ('{"name": "calculator", "arguments": "nope"}', "string that is not a JSON object"),
])
def test_malformed_calls_are_errors(body, words):
    _, calls = parse_tool_calls(f"<tool_call>{body}</tool_call>")
    assert len(calls) == 1 and words in calls[0].error


def test_unclosed_call_is_an_error():
    _, calls = parse_tool_calls('ok <tool_call>{"name": "calculator", "arguments": {}}')
    assert len(calls) == 1 and "not closed" in calls[0].error
