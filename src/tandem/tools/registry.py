"""Tools the model may call: the Tool contract, JSON-schema descriptions and a registry by name.

A tool returns a ToolResult for anything the model got wrong (bad input, failing code); an
exception from a tool means the host is broken and propagates (the agent loop fails that one
session). A result's text is made valid UTF-8 here (lone surrogates escaped), so the tokenizer
can always encode it. Tools run on an event loop of user code, not the rollout's
(user_code.call_user_code): one that blocks or ignores its cancellation is abandoned at the
deadline (rollout.multi_turn.tool_timeout_seconds) and never freezes the sessions.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field
from typing import Any, Iterable, Protocol

from tandem.user_code import call_user_code

JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
    "object": (dict,), "array": (list,), "null": (type(None),)}


@dataclass
class ToolResult:
    """What the model sees as the tool message; ok=False marks an error message; done=True ends
    the session after this tool turn (an environment's episode is over); `images` (PIL images,
    encoded bytes or paths) are shown to a vision-language policy before the text."""

    text: str
    ok: bool = True
    done: bool = False
    images: list[Any] = field(default_factory=list)


class Tool(Protocol):
    """name, description and a JSON-schema `parameters` object; execute() is async."""

    name: str
    description: str
    parameters: dict[str, Any]

    async def execute(self, arguments: dict[str, Any], context: dict[str, Any]) -> ToolResult:
        """Run with validated arguments; context holds the row's tools_kwargs for this tool."""


def tool_schema(tool: Tool) -> dict[str, Any]:
    """The OpenAI-style function description a chat template's `tools` expects."""
    return {"type": "function", "function": {"name": tool.name, "description": tool.description,
                                             "parameters": tool.parameters}}


def validate_arguments(parameters: dict[str, Any], arguments: Any) -> str | None:
    """Check arguments against a flat JSON schema; return an error message or None."""
    if not isinstance(arguments, dict):
        return f"arguments must be a JSON object, got {type(arguments).__name__}"
    properties = parameters.get("properties", {})
    missing = [name for name in parameters.get("required", []) if name not in arguments]
    if missing:
        return f"missing required argument(s) {missing}"
    if parameters.get("additionalProperties") is False:
        unknown = sorted(set(arguments) - set(properties))
        if unknown:
            return f"unknown argument(s) {unknown}; expected {sorted(properties)}"
    for name, value in arguments.items():
        expected = properties.get(name, {}).get("type")
        if expected is None:
            continue
        names = expected if isinstance(expected, list) else [expected]
        python_types = tuple(t for n in names for t in JSON_TYPES.get(n, (object,)))
        is_bool = isinstance(value, bool)
        if not isinstance(value, python_types) or (is_bool and "boolean" not in names):
            return f"argument {name!r} must be of type {expected}, got {type(value).__name__}"
    return None


class ToolRegistry:
    """Tools by name, their schemas in registration order, and error-safe dispatch."""

    def __init__(self, tools: Iterable[Tool] = ()) -> None:
        self._tools: dict[str, Tool] = {}
        for tool in tools:
            self.register(tool)

    def register(self, tool: Tool) -> None:
        """Add a tool; a second tool with the same name is an error."""
        if tool.name in self._tools:
            raise ValueError(f"a tool named {tool.name!r} is already registered")
        self._tools[tool.name] = tool

    def names(self) -> list[str]:
        """Registered names in registration order."""
        return list(self._tools)

    def __contains__(self, name: str) -> bool:
        return name in self._tools

    def __len__(self) -> int:
        return len(self._tools)

    def get(self, name: str) -> Tool:
        """The tool called `name`; KeyError listing the registered names otherwise."""
        if name not in self._tools:
            raise KeyError(f"no tool named {name!r}; registered: {self.names()}")
        return self._tools[name]

    def schemas(self) -> list[dict[str, Any]]:
        """The `tools` list for the chat template."""
        return [tool_schema(tool) for tool in self._tools.values()]

    async def call(self, name: str, arguments: Any, context: dict[str, Any] | None = None,
                   timeout: float = 30.0) -> ToolResult:
        """Run a tool; an unknown name or invalid arguments become an error result. The tool runs
        off the event loop on copies of its arguments (user_code.call_user_code), within
        `timeout` seconds (UserCodeTimeout past it); a plain str it returns is a successful
        result, anything else but a ToolResult is a TypeError naming the tool."""
        if name not in self._tools:
            return ToolResult(f"Error: unknown tool {name!r}; available tools: {self.names()}",
                              ok=False)
        tool = self._tools[name]
        problem = validate_arguments(tool.parameters, arguments)
        if problem:
            return ToolResult(f"Error: invalid arguments for {name}: {problem}", ok=False)
        result = await call_user_code(tool.execute, (arguments, context or {}), name=f"tool {name}",
                                      timeout=timeout, field=TIMEOUT_FIELD)
        if isinstance(result, str):
            result = ToolResult(result)
        what = None
        if not isinstance(result, ToolResult):
            what = type(result).__name__
        elif not isinstance(result.text, str):
            what = f"a ToolResult whose text is {type(result.text).__name__}"
        elif not isinstance(result.images, (list, tuple)):
            what = f"a ToolResult whose images are a {type(result.images).__name__}"
        if what:
            raise TypeError(f"tool {name} returned {what}; execute() returns a "
                            "ToolResult(text, ok, images=[...]) or a str")
        return ToolResult(encodable(result.text), bool(result.ok), bool(result.done),
                          list(result.images))


def encodable(text: str) -> str:
    """text with lone surrogates written as \\udXXXX escapes (tokenizers refuse them)."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


# name -> "module:class" of the built-in tools; imported only when built.
BUILTIN_TOOLS = {"calculator": "tandem.tools.calculator:CalculatorTool",
                 "python": "tandem.tools.python_tool:PythonTool"}
FIELD = "rollout.multi_turn.tools"
TIMEOUT_FIELD = "rollout.multi_turn.tool_timeout_seconds"


def builtin_tool_names() -> tuple[str, ...]:
    """The built-in names accepted in rollout.multi_turn.tools."""
    return tuple(BUILTIN_TOOLS)


def tool_class(entry: str) -> type:
    """The class an entry of rollout.multi_turn.tools names: a built-in name,
    "path/to/tools.py:ClassName" or "package.module:ClassName"; ValueError naming the entry."""
    from tandem.user_code import load_object

    if entry in BUILTIN_TOOLS:
        module_name, class_name = BUILTIN_TOOLS[entry].split(":")
        return getattr(importlib.import_module(module_name), class_name)
    if ":" not in entry:
        raise ValueError(f"{FIELD}: unknown tool {entry!r}; built-in tools are "
                         f"{list(BUILTIN_TOOLS)}, and your own are named 'path/to/tools.py:ClassName' "
                         "or 'package.module:ClassName'")
    cls = load_object(entry, FIELD)
    missing = [name for name in ("name", "description", "parameters", "execute")
               if not hasattr(cls, name)] if isinstance(cls, type) else []
    if not isinstance(cls, type) or missing:
        what = f"lacks {missing}" if missing else f"is a {type(cls).__name__}, not a class"
        raise ValueError(f"{FIELD}: {entry!r} {what}; a tool class has name, description, "
                         "parameters (JSON schema) and async execute(arguments, context) "
                         "(tandem.Tool)")
    return cls


def check_tool(tool: Any, where: str) -> Tool:
    """`tool` if it follows the Tool contract, else ValueError naming `where`."""
    problems = [name for name in ("name", "description", "parameters") if not hasattr(tool, name)]
    if not problems and not isinstance(tool.name, str):
        problems.append("name (a string)")
    if not problems and not isinstance(tool.parameters, dict):
        problems.append("parameters (a JSON-schema dict)")
    if not inspect.iscoroutinefunction(getattr(tool, "execute", None)):
        problems.append("async execute(arguments, context)")
    if problems:
        raise ValueError(f"{where}: {tool!r} is not a tool: it lacks {', '.join(problems)} "
                         "(tandem.Tool)")
    return tool


def build_tool_registry(entries: Iterable[str], tools: Iterable[Tool] = ()) -> ToolRegistry:
    """A registry of the tools rollout.multi_turn.tools names (each class constructed with no
    arguments), then `tools` (instances, e.g. `Trainer(tools=[...])`)."""
    registry = ToolRegistry()
    for entry in entries:
        cls = tool_class(entry)
        try:
            tool = cls()
        except Exception as error:
            raise ValueError(f"{FIELD}: {entry!r}: {cls.__name__}() raised "
                             f"{type(error).__name__}: {error}") from error
        registry.register(check_tool(tool, f"{FIELD}: {entry!r}"))
    for tool in tools:
        registry.register(check_tool(tool, "Trainer(tools=...)"))
    return registry
