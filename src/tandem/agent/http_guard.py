"""What the OpenAI-compatible endpoint checks before a request reaches the recorder: the bearer
token and the body size (a pure ASGI middleware, so nothing wraps the app's own task), and the
JSON body itself (valid UTF-8 text, bounded nesting, no lone surrogates) parsed off the loop."""

from __future__ import annotations

import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

MAX_JSON_DEPTH = 64  # nesting of arrays/objects in a request body; chat requests need ~6


class BodyTooLarge(Exception):
    """The request body grew past the endpoint's limit while it was being read."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the request body is larger than {limit} bytes "
                         "(rollout.openai_agent.max_request_bytes)")


class BadBody(ValueError):
    """The body is not a usable JSON document; the message says why (a 400)."""


class RequestGuard:
    """Answers 401 (wrong or missing bearer token) and 413 (Content-Length over the limit)
    itself; a body streamed past the limit raises BodyTooLarge from receive()."""

    def __init__(self, app: ASGIApp, api_key: str, max_body_bytes: int) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        # /health is a liveness probe (load balancers, k8s): it needs no token
        if self.expected is not None and scope.get("path") != "/health" and \
                headers.get(b"authorization") != self.expected:
            await _send_error(send, 401, "missing or wrong bearer token: send the endpoint's api "
                              "key as 'Authorization: Bearer <key>'", "invalid_api_key")
            return
        length = headers.get(b"content-length", b"0")
        if not length.isdigit() or int(length) > self.max_body_bytes:
            await _send_error(send, 413, str(BodyTooLarge(self.max_body_bytes)),
                              "request_too_large")
            return
        await self.app(scope, self._counting(receive), send)

    def _counting(self, receive: Receive) -> Receive:
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise BodyTooLarge(self.max_body_bytes)
            return message
        return counted


async def _send_error(send: Send, status: int, message: str, code: str) -> None:
    kind = "authentication_error" if status == 401 else "invalid_request_error"
    body = json.dumps({"error": {"message": message, "type": kind, "param": None,
                                 "code": code}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def parse_json_body(raw: bytes) -> Any:
    """A request body -> Python value; BadBody for invalid UTF-8 or JSON, nesting deeper than
    MAX_JSON_DEPTH, or a string holding a lone surrogate (no tokenizer can encode it)."""
    try:
        value = json.loads(raw)
    except UnicodeDecodeError as error:
        raise BadBody(f"the body is not UTF-8 text (byte {error.start})") from None
    except json.JSONDecodeError as error:
        raise BadBody(f"the body is not valid JSON: {error.msg} at line {error.lineno} column "
                      f"{error.colno}") from None
    except RecursionError:
        raise BadBody(f"the body nests deeper than {MAX_JSON_DEPTH} levels") from None
    _check_values(value)
    return value


def _check_values(value: Any) -> None:
    stack: list[tuple[Any, int, str]] = [(value, 0, "")]
    while stack:
        item, depth, where = stack.pop()
        if isinstance(item, str):
            _check_text(item, where)
        elif isinstance(item, (dict, list)):
            if depth >= MAX_JSON_DEPTH:
                raise BadBody(f"the body nests deeper than {MAX_JSON_DEPTH} levels")
            pairs = item.items() if isinstance(item, dict) else enumerate(item)
            for key, child in pairs:
                if not isinstance(child, (str, dict, list)) and not isinstance(key, str):
                    continue  # numbers, booleans and null need no check (nor a path)
                path = f"{where}.{key}" if isinstance(item, dict) else f"{where}[{key}]"
                if isinstance(key, str):
                    _check_text(key, path)
                stack.append((child, depth + 1, path))


def _check_text(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise BadBody(f"{where.lstrip('.') or 'the body'}: holds a lone UTF-16 surrogate "
                      f"(position {error.start}); send valid Unicode text") from None
