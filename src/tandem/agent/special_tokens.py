"""Special tokens come from the chat template only: text written by users, tools or API callers
is tokenized as text, so a tool result holding "<|im_end|>\\n<|im_start|>user" cannot forge a turn.

Strings of the messages (and tool schemas) holding a special token's text are replaced by
placeholders while the template renders; the template's own special tokens then split the
rendered string into runs, each encoded with `split_special_tokens=True` (docs/agent_loops.md).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Callable

# (messages, tools) -> the rendered conversation as one string
RenderText = Callable[[list[dict[str, Any]], "list[dict] | None"], str]


@dataclass(frozen=True)
class SpecialToken:
    """One special token of a tokenizer: its text, id, and whether it absorbs whitespace."""

    text: str
    token_id: int
    lstrip: bool = False
    rstrip: bool = False


def special_tokens(tokenizer: Any) -> dict[str, SpecialToken]:
    """text -> SpecialToken for every special token of an HF tokenizer."""
    tokens: dict[str, SpecialToken] = {}
    for token_id, added in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if getattr(added, "special", False) and added.content:
            tokens[added.content] = SpecialToken(added.content, int(token_id),
                                                 bool(added.lstrip), bool(added.rstrip))
    for text in getattr(tokenizer, "all_special_tokens", []):
        if text and text not in tokens:
            tokens[text] = SpecialToken(text, int(tokenizer.convert_tokens_to_ids(text)))
    return tokens


class PlainTextRenderer:
    """Renders conversations so that caller text never yields a special token."""

    def __init__(self, tokenizer: Any, render_text: RenderText) -> None:
        self.tokenizer = tokenizer
        self.render_text = render_text
        self.specials = special_tokens(tokenizer)
        # longest first: the tokenizer matches the longest special token at a position
        names = sorted(self.specials, key=len, reverse=True)
        self._pattern = re.compile("|".join(map(re.escape, names))) if names else None
        self._exact: bool | None = None

    def holds_special_text(self, value: Any) -> bool:
        """Whether any string in a nested message/tool structure holds special-token text."""
        if self._pattern is None:
            return False
        return any(self._pattern.search(text) for text in _strings(value))

    def encode(self, text: str) -> list[int]:
        """Template output -> ids, special tokens parsed (apply_chat_template's tokenization)."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def encode_plain(self, text: str) -> list[int]:
        """Caller text -> ids, special-token text tokenized as text."""
        return list(self.tokenizer(text, add_special_tokens=False,
                                   split_special_tokens=True)["input_ids"])

    def render(self, messages: list[dict[str, Any]], tools: list[dict] | None) -> list[int]:
        """The conversation's ids; special tokens only where the template wrote them."""
        if not self.holds_special_text([messages, tools]):
            return self.encode(self.render_text(messages, tools))
        if not self.exact:
            raise ValueError(
                "a message holds special-token text, and this tokenizer encodes the text between "
                "special tokens differently when it is split there (e.g. a sentencepiece prefix "
                "space), so that text cannot be kept plain exactly; remove the special-token text "
                f"({self._found([messages, tools])!r}) from the message")
        return self._render_segments(messages, tools, lambda text: self._pattern.search(text))

    @property
    def exact(self) -> bool:
        """Whether encoding the text runs between special tokens one by one reproduces this
        tokenizer's whole-string encoding (checked once, on text around every special token)."""
        if self._exact is None:
            probe = "".join(f"Hello, world {text}\n 12 + 3 =  {text}x" for text in self.specials)
            self._exact = self._encode_segments([(probe, False)]) == self.encode(probe)
        return self._exact

    def _found(self, value: Any) -> str:
        for text in _strings(value):
            match = self._pattern.search(text)
            if match:
                return match.group(0)
        return ""

    def _render_segments(self, messages: list[dict[str, Any]], tools: list[dict] | None,
                         is_caller_text: Callable[[str], Any]) -> list[int]:
        nonce = uuid.uuid4().hex[:12]
        originals: list[str] = []

        def mask(value: Any) -> Any:
            if isinstance(value, str):
                if not is_caller_text(value):
                    return value
                originals.append(value)
                return f"\ue000{nonce}:{len(originals) - 1}\ue001"
            if isinstance(value, dict):
                return {mask(key): mask(item) for key, item in value.items()}
            if isinstance(value, (list, tuple)):
                return [mask(item) for item in value]
            return value

        skeleton = self.render_text(mask(messages), mask(tools))
        pieces = re.split(f"\ue000{nonce}:(\\d+)\ue001", skeleton)
        segments = _align(self.render_text(messages, tools), pieces, originals)
        return self._encode_segments(segments)

    def _encode_segments(self, segments: list[tuple[str, bool]]) -> list[int]:
        """(text, is_caller_text) runs -> ids: the template's special tokens split the stream;
        text between them (template and caller text together) is encoded as text."""
        ids: list[int] = []
        pending = ""
        strip_left = False  # the previous special token absorbs whitespace after it
        for text, caller in segments:
            if caller or self._pattern is None:
                pending += text
                continue
            position = 0
            for match in self._pattern.finditer(text):
                token = self.specials[match.group(0)]
                pending += text[position:match.start()]
                ids += self._flush(pending, strip_left, token.lstrip)
                ids.append(token.token_id)
                pending, strip_left, position = "", token.rstrip, match.end()
            pending += text[position:]
        return ids + self._flush(pending, strip_left, False)

    def _flush(self, text: str, strip_left: bool, strip_right: bool) -> list[int]:
        text = text.lstrip() if strip_left else text
        text = text.rstrip() if strip_right else text
        return self.encode_plain(text) if text else []


def _align(real: str, pieces: list[str], originals: list[str]) -> list[tuple[str, bool]]:
    """Split the real rendering into template runs and caller text, given the placeholder
    rendering's pieces [template, index, template, index, ..., template]. A template may write
    a string as is, trimmed, or JSON-escaped (tojson); anything else cannot be aligned."""
    def refuse() -> ValueError:
        return ValueError("the chat template rewrites the text of a message that holds special-"
                          f"token text ({originals[0][:60]!r}...) instead of inserting it, so "
                          "that text cannot be tokenized as plain text; remove the special-token "
                          "text from the message")
    if not real.startswith(pieces[0]):
        raise refuse()
    segments = [(pieces[0], False)]
    position = len(pieces[0])
    for k in range(1, len(pieces), 2):
        original, following = originals[int(pieces[k])], pieces[k + 1]
        last = k + 2 >= len(pieces)
        for candidate in (original, original.strip(), json.dumps(original, ensure_ascii=False)[1:-1]):
            end = position + len(candidate) + len(following)
            if real.startswith(candidate + following, position) and (not last or end == len(real)):
                break
        else:
            raise refuse()
        segments += [(candidate, True), (following, False)]
        position = end
    if position != len(real):
        raise refuse()
    return segments


def _strings(value: Any) -> Any:
    """Every string (keys included) in a nested structure of dicts, lists and tuples."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
