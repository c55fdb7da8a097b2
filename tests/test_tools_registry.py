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


USER_TOOLS = '''
from tandem import ToolResult


class Echo:
    name = "echo"
    description = "Repeat the text."
    parameters = {"type": "object", "properties": {"text": {"type": "string"}},
                  "required": ["text"]}

    async def execute(self, arguments, context):
        return ToolResult(arguments["text"].upper())


class NotATool:
    name = "broken"
    description = "no schema, no execute"


class Raises:
    name = "raises"
    description = "fails to construct"
    parameters = {"type": "object", "properties": {}}

    def __init__(self):
        raise RuntimeError("needs a key")

    async def execute(self, arguments, context):
        return ToolResult("")
'''


def test_user_tools_by_file_path_and_by_module(tmp_path, monkeypatch):
    import asyncio

    (tmp_path / "my_tools.py").write_text(USER_TOOLS)
    monkeypatch.syspath_prepend(str(tmp_path))
    by_file = build_tool_registry(["calculator", f"{tmp_path / 'my_tools.py'}:Echo"])
    assert by_file.names() == ["calculator", "echo"]
    assert asyncio.run(by_file.call("echo", {"text": "hi"})).text == "HI"
    by_module = build_tool_registry(["my_tools:Echo"])
    assert by_module.names() == ["echo"]


class Instance:
    name = "instance"
    description = "given in Python"
    parameters = {"type": "object", "properties": {}}

    async def execute(self, arguments, context):
        from tandem import ToolResult

        return ToolResult("ok")


def test_tool_instances_join_the_configured_ones():
    registry = build_tool_registry(["calculator"], [Instance()])
    assert registry.names() == ["calculator", "instance"]
    with pytest.raises(ValueError, match="Trainer\\(tools=...\\): .* is not a tool: it lacks"):
        build_tool_registry([], [object()])


@pytest.mark.parametrize("entry, words", [
    ("my_tools:NotATool", "lacks \\['parameters', 'execute'\\]"),
    ("my_tools:Raises", "Raises\\(\\) raised RuntimeError: needs a key"),
    ("my_tools:Missing", "defines no 'Missing'"),
])
def test_bad_tool_entries_name_the_entry(tmp_path, monkeypatch, entry, words):
    from tandem.config.load import ConfigError, load_config
    from tandem.preflight import check_names

    (tmp_path / "my_tools.py").write_text(USER_TOOLS)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=f"rollout.multi_turn.tools: '{entry}'.*{words}"):
        build_tool_registry([entry])
    if "Raises" not in entry:  # construction happens when the run builds its tools
        config = load_config({"rollout": {"multi_turn": {"enable": True, "tools": [entry]}}})
        with pytest.raises(ConfigError, match=words):
            check_names(config)
