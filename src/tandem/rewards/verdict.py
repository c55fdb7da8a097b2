"""An LLM judge's prompt and verdict, as pure functions: the template filled with the question
and the reply, and the score a verdict's text gives (None for a bad verdict)."""

from __future__ import annotations

import math
import re
from typing import Any


def judge_prompt(template: str, prompt: str, response: str) -> str:
    """template with {prompt} and {response} filled in (other braces are left as written)."""
    return template.replace("{prompt}", prompt).replace("{response}", response)


def parse_verdict(text: str, pattern: str, scale: float = 1.0) -> float | None:
    """number x scale, the number being the first group of the first match of `pattern` in
    text; None when nothing matches or the number is not finite."""
    match = re.search(pattern, text)
    if match is None:
        return None
    try:
        value = float(match.group(1))
    except (IndexError, ValueError):
        return None
    return value * scale if math.isfinite(value) else None


def last_user_text(messages: list[Any]) -> str:
    """The content of the last user message of a chat ("" without one)."""
    for message in reversed(messages or []):
        if isinstance(message, dict) and message.get("role") == "user":
            content = message.get("content")
            return content if isinstance(content, str) else str(content)
    return ""
