"""The tool registry: schemas for the chat template, argument checks, dispatch and errors."""

import pytest

from tandem.tools.calculator import CalculatorTool
from tandem.tools.registry import ToolRegistry, build_tool_registry, validate_arguments


def test_schemas_are_openai_function_descriptions():
    registry = ToolRegistry([CalculatorTool()])
    [schema] = registry.schemas()
    assert schema["type"] == "function" and schema["function"]["name"] == "calculator"
    assert schema["function"]["parameters"]["required"] == ["expression"]


def test_duplicate_and_unknown_names():
    registry = ToolRegistry([CalculatorTool()])
    with pytest.raises(ValueError, match="already registered"):
        registry.register(CalculatorTool())
    with pytest.raises(KeyError, match="registered: \\['calculator'\\]"):
        registry.get("python")
    with pytest.raises(ValueError, match="rollout.multi_turn.tools: unknown tool 'search'"):
        build_tool_registry(["search"])


@pytest.mark.parametrize("arguments, words", [
    ([1], "must be a JSON object"),
    ({}, "missing required argument(s) ['a']"),
    ({"a": "x", "b": 1}, "unknown argument(s) ['b']"),
    ({"a": 1}, "'a' must be of type string"),
    ({"a": "x", "n": True}, "'n' must be of type integer"),
])
def test_argument_validation(arguments, words):
    schema = {"type": "object", "properties": {"a": {"type": "string"}, "n": {"type": "integer"}},
              "required": ["a"], "additionalProperties": False}
    problem = validate_arguments(schema, arguments)
    assert problem is not None and words in problem
    assert validate_arguments(schema, {"a": "x", "n": 3}) is None


async def test_call_turns_mistakes_into_error_results():
    registry = ToolRegistry([CalculatorTool()])
    assert (await registry.call("calculator", {"expression": "1+1"})).text == "2"
    unknown = await registry.call("search", {})
    assert not unknown.ok and "unknown tool 'search'" in unknown.text
    invalid = await registry.call("calculator", {"expression": 3})
    assert not invalid.ok and "must be of type string" in invalid.text


def test_build_builtin_registry():
    registry = build_tool_registry(["calculator"])
    assert registry.names() == ["calculator"] and "python" not in registry
