"""Find Hermes/Qwen tool calls in a model turn:
<tool_call>{"name": ..., "arguments": {...}}</tool_call>.

Malformed calls are returned as ToolCall records with an `error`, so the loop can answer them
with a tool error message instead of crashing: that includes JSON too deep for the parser
(RecursionError) and integers over Python's digit limit (ValueError), not only syntax errors.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(CALL_OPEN) + r"(.*?)(?:" + re.escape(CALL_CLOSE) + r"|$)", re.DOTALL)


@dataclass
class ToolCall:
    """One call: name and arguments when well formed; otherwise error says what is wrong."""

    name: str = ""
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    raw: str = ""


def _load_json(text: str) -> tuple[Any, str | None]:
    """(value, None), or (None, what is wrong) for anything json.loads refuses."""
    try:
        return json.loads(text), None
    except json.JSONDecodeError as error:
        return None, f"{error.msg} at char {error.pos}"
    except RecursionError:
        return None, "nested too deeply"
    except ValueError as error:  # e.g. an integer longer than sys.get_int_max_str_digits()
        return None, str(error).split(";")[0]


def _parse_one(body: str, closed: bool) -> ToolCall:
    raw = body.strip()
    if not closed:
        return ToolCall(error=f"the tool call is not closed with {CALL_CLOSE}", raw=raw)
    payload, problem = _load_json(raw)
    if problem is not None:
        return ToolCall(error=f"the tool call is not valid JSON ({problem})", raw=raw)
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        return ToolCall(error='the tool call must be a JSON object with a string "name"', raw=raw)
    arguments = payload.get("arguments", {})
    if isinstance(arguments, str):  # some models emit the arguments as a JSON string
        arguments, problem = _load_json(arguments)
        if problem is not None:
            return ToolCall(name=payload["name"], raw=raw,
                            error=f'"arguments" is a string that is not a JSON object ({problem})')
    if not isinstance(arguments, dict):
        return ToolCall(name=payload["name"], raw=raw, error='"arguments" must be a JSON object')
    return ToolCall(name=payload["name"], arguments=arguments, raw=raw)


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """Split a model turn into its plain content and the tool calls in order of appearance."""
    calls = []
    for match in _CALL.finditer(text):
        closed = match.group(0).endswith(CALL_CLOSE)
        calls.append(_parse_one(match.group(1), closed))
    content = _CALL.sub("", text).strip()
    return content, calls
