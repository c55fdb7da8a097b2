"""Chat messages -> token ids through an HF tokenizer's chat template, without re-tokenizing
(docs/agent_loops.md, "The token stream"). The prompt is rendered once; a later tool turn is
the *delta* the template adds after the assistant's end-of-turn token in a fixed dummy
conversation, so boundary tokens land exactly as the template writes them and the model's own
tokens are never decoded and encoded again. Special tokens come from the template only
(agent/special_tokens.py), so a tool result cannot forge a turn.
"""

from __future__ import annotations

import re
from functools import cached_property
from typing import Any, Iterable, Sequence

from tandem.agent.special_tokens import PlainTextRenderer
from tandem.multimodal import IMAGE_PAD, ImageInputs, expand_image_pads, process_images

# A fixed conversation the tool turn is rendered after; its content never reaches the stream.
_DUMMY_HISTORY = [{"role": "user", "content": "."}, {"role": "assistant", "content": "."}]
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's token for one raw byte


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's character for each byte, inverted: a printable Latin-1 byte is its own
    character, the other 68 bytes take the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    others = [byte for byte in range(256) if byte not in printable]
    return {**{chr(byte): byte for byte in printable},
            **{chr(256 + index): byte for index, byte in enumerate(others)}}


_BYTE_OF_CHARACTER = _byte_level_alphabet()


class ChatFormat:
    """Renders prompts and tool turns to token ids with one tokenizer's chat template."""

    def __init__(self, tokenizer: Any, stop_token_ids: Iterable[int] = (),
                 image_processor: Any = None) -> None:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("the tokenizer has no chat_template; the agent loops render every "
                             "prompt with it. Use a chat model or set tokenizer.chat_template.")
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no eos_token_id; the agent loops need it to find "
                             "where an assistant turn ends")
        self.tokenizer = tokenizer
        self.stop_token_ids = frozenset([tokenizer.eos_token_id, *stop_token_ids])
        self.image_processor = image_processor  # a vision-language policy's (tandem.multimodal)
        self._plain = {prompt: PlainTextRenderer(tokenizer, self._text_renderer(prompt))
                       for prompt in (False, True)}

    def _text_renderer(self, add_generation_prompt: bool) -> Any:
        def render(messages: list[dict[str, Any]], tools: list[dict] | None) -> str:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools or None, add_generation_prompt=add_generation_prompt,
                tokenize=False)
        return render

    def _render(self, messages: Sequence[dict[str, Any]], tools: list[dict] | None,
                add_generation_prompt: bool) -> list[int]:
        return self._plain[add_generation_prompt].render(list(messages), tools or None)

    def prompt_ids(self, messages: Sequence[dict[str, Any]], tools: list[dict] | None = None,
                   images: Sequence[Any] | ImageInputs = ()) -> list[int]:
        """The initial prompt with the tool schemas and the assistant generation prompt; with
        `images` (one per image part, in order, or their `process`ed inputs) each image's
        `<|image_pad|>` repeated to its token count, as the policy's processor does."""
        ids = self._render(messages, tools, add_generation_prompt=True)
        if isinstance(images, ImageInputs):
            counts = images.token_counts
        elif not images:
            return ids
        else:
            counts = self.process(images).token_counts
        pad = self.tokenizer.convert_tokens_to_ids(IMAGE_PAD)
        return expand_image_pads(ids, pad, counts, "prompt")

    def process(self, images: Sequence[Any], where: str = "prompt") -> ImageInputs:
        """The policy's image processor's inputs of `images` (pixel values, grids, counts);
        `where` (a prompt, a tool result) names them in errors."""
        if self.image_processor is None:
            raise ValueError(f"{where}: {len(images)} image(s), but the policy has no image "
                             "processor: images need a vision-language model (Qwen2-VL family) "
                             "with its preprocessor_config.json")
        return process_images(self.image_processor, images, where)

    @cached_property
    def _history(self) -> list[int]:
        return self._render(_DUMMY_HISTORY, None, add_generation_prompt=False)

    def tool_turn_ids(self, tool_messages: Sequence[dict[str, Any]], after_stop_token: bool,
                      images: ImageInputs | None = None) -> list[int]:
        """Tokens that follow a finished assistant turn: its closing boundary (the end-of-turn token
        too, unless after_stop_token: the model's tokens already end with it), the rendered tool
        messages and the next generation prompt; with `images` (the tool messages' image parts'
        processed inputs) each image's `<|image_pad|>` repeated to its token count."""
        if images is not None:
            pad = self.tokenizer.convert_tokens_to_ids(IMAGE_PAD)
            return expand_image_pads(self.tool_turn_ids(tool_messages, after_stop_token), pad,
                                     images.token_counts, "tool turn")
        history = self._history
        full = self._render([*_DUMMY_HISTORY, *tool_messages], None, add_generation_prompt=True)
        if full[:len(history)] != history:
            raise ValueError("the chat template renders earlier turns differently once a tool "
                             "turn follows, so tool tokens cannot be appended without "
                             "re-tokenizing; use a template whose history rendering is stable")
        ends = [i for i, token in enumerate(history) if token in self.stop_token_ids]
        if not ends:
            raise ValueError(f"the chat template does not end an assistant turn with a stop token "
                             f"{sorted(self.stop_token_ids)}; pass stop_token_ids to ChatFormat")
        closing = ends[-1] + (1 if after_stop_token else 0)
        return history[closing:] + full[len(history):]

    def continuation_ids(self, history: Sequence[dict[str, Any]], messages: Sequence[dict[str, Any]],
                         tools: list[dict] | None, after_stop_token: bool) -> list[int] | None:
        """Tokens that follow the last assistant turn of `history` when the template renders
        `messages` (history + new tool/user messages) with the generation prompt: its closing
        boundary (the end-of-turn token too, unless after_stop_token), the new messages and the
        next generation prompt. None when the template writes this history differently once
        the new messages follow (e.g. it strips earlier `<think>` blocks), or never writes the
        reply's content as given (e.g. it strips reasoning from every assistant turn): then the
        new prompt does not extend the recorded tokens and the session must split."""
        history = list(history)
        before = self._render(history, tools, add_generation_prompt=False)
        after = self._render(messages, tools, add_generation_prompt=True)
        if after[:len(before)] != before:
            return None
        content = history[-1].get("content") or ""
        if content:  # the reply as the template writes it must hold what the model said
            text = self._plain[False].render_text(history, tools or None)
            start = len(self._plain[False].render_text(history[:-1], tools or None))
            if text.find(content, start) < 0:
                return None
        ends = [i for i, token in enumerate(before) if token in self.stop_token_ids]
        if not ends:
            raise ValueError(f"the chat template does not end an assistant turn with a stop token "
                             f"{sorted(self.stop_token_ids)}; pass stop_token_ids to ChatFormat")
        return after[ends[-1] + (1 if after_stop_token else 0):]

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of model tokens, special tokens kept (tool-call tags may be special tokens)."""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=False)

    def strip_stop_text(self, text: str) -> str:
        """Remove a trailing end-of-turn token's text from decoded model output."""
        for token_id in self.stop_token_ids:
            token = self.tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(token, str) and token and text.endswith(token):
                return text[: -len(token)]
        return text

    def encode_text(self, text: str) -> list[int]:
        """Plain text -> ids, special-token text kept as text (to measure and cut tool output)."""
        return self._plain[True].encode_plain(text)

    def decode_text(self, token_ids: Sequence[int]) -> str:
        """Inverse of encode_text."""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=False)

    @cached_property
    def _byte_level(self) -> bool:
        from tokenizers import decoders

        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        return isinstance(getattr(backend, "decoder", None), decoders.ByteLevel)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token, also when they are part of a UTF-8 character (its decoded
        text is then the replacement character): a byte-level BPE token through that format's
        byte alphabet, a byte-fallback token (<0xE2>) as its byte, others as UTF-8 of its text."""
        token = self.tokenizer.convert_ids_to_tokens(int(token_id))
        if isinstance(token, str):
            byte = _BYTE_FALLBACK.fullmatch(token)
            if byte:
                return bytes([int(byte[1], 16)])
            if self._byte_level and all(char in _BYTE_OF_CHARACTER for char in token):
                return bytes(_BYTE_OF_CHARACTER[char] for char in token)
        return self.decode_text([token_id]).encode()
