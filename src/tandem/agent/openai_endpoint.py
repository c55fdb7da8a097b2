"""An OpenAI-compatible chat endpoint over the rollout servers (FastAPI + uvicorn).

POST /v1/chat/completions and GET /v1/models, through a ChatRecorder and its TokenClient
(sticky on the session id: the `X-Session-Id` header, else `user`, else a fresh id per call).
The same routes under /sessions/<id>/v1 record into session <id> whatever the headers say, for
harnesses that take only a base URL or send a session header of their own (verifiers does).
Every request is untrusted (docs/serving.md, "The OpenAI-compatible endpoint's limits"): bad
bodies are a 400 or 413 naming the field (http_guard.py), parsing and rendering run off the
event loop, a client that disconnects cancels its generation, and only a call that passes
validation creates a session.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
import uuid
from typing import Any
from urllib.parse import quote

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from tandem.agent.chat_format import ChatFormat
from tandem.agent.recorder import ChatRecorder, Completion, RequestError
from tandem.agent.http_guard import BadBody, BodyTooLarge, RequestGuard, parse_json_body

SESSION_HEADER = "x-session-id"
MAX_SESSION_ID_CHARS = 256
MAX_STOP_STRINGS = 4  # as OpenAI's API
MAX_STOP_CHARS = 256
DEFAULT_MAX_REQUEST_BYTES = 8 << 20
# An idle connection stays open this long: well past clients' own idle expiry (httpx and so
# the openai client: 5 s), so a client never reuses a connection the server is closing (with
# uvicorn's 5 s default, a request sent ~5 s after the last one raced the close and failed
# with APIConnectionError: bench/stack.py's HTTP rounds after a ~5 s direct round).
KEEP_ALIVE_S = 75
INT64 = 2**63 - 1


class ChatRequest(BaseModel):
    """The chat-completions fields this endpoint serves; any other field is a 400 naming it."""

    model_config = ConfigDict(extra="forbid")

    model: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | None = None  # only "auto" (or none given): the model decides
    parallel_tool_calls: bool | None = None  # the model may emit several calls in one turn
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(default=None, ge=1, le=INT64)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT64)
    n: int = Field(default=1, ge=1, le=64)
    stop: str | list[str] | None = None
    logprobs: bool = False
    top_logprobs: int | None = None  # only 0: the engine returns the sampled token's logprob
    seed: int | None = Field(default=None, ge=-INT64 - 1, le=INT64)
    user: str | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    # clients send these at their defaults (0); the engine applies neither, so only 0 is served
    frequency_penalty: float | None = None
    presence_penalty: float | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
        if any(not text for text in stops):
            raise ValueError("a stop string must not be empty (it would match at once)")
        if any(len(text) > MAX_STOP_CHARS for text in stops):
            raise ValueError(f"a stop string may have at most {MAX_STOP_CHARS} characters")
        return stop

    @field_validator("messages")
    @classmethod
    def _messages(cls, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if not messages:
            raise ValueError("must not be empty")
        for message in messages:  # refused, never served as if the image were not there
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, list) and any(
                    isinstance(part, dict) and part.get("type") not in (None, "text")
                    for part in content):
                raise ValueError("only text content parts are served here; images reach a "
                                 "policy through the agent loops' datasets (docs/agent_loops.md, "
                                 "\"Rows with images\"), not this endpoint yet")
        return messages

    @field_validator("tools")
    @classmethod
    def _tools(cls, tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for tool in tools or []:
            function = tool.get("function")
            if (tool.get("type", "function") != "function" or not isinstance(function, dict)
                    or not isinstance(function.get("name"), str)):
                raise ValueError("every tool must be {\"type\": \"function\", \"function\": "
                                 "{\"name\": ..., \"parameters\": {...}}}")
        return tools


def error_response(status: int, message: str, code: str | None = None,
                   param: str | None = None) -> JSONResponse:
    """An OpenAI-style error object."""
    kind = {401: "authentication_error", 404: "invalid_request_error"}.get(
        status, "invalid_request_error" if status < 500 else "server_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param,
                                   "code": code}}, status_code=status)


def _logprobs(completion: Completion, chat_format: ChatFormat) -> dict[str, Any]:
    """Each sampled token's text, logprob and raw bytes (a token holding part of a UTF-8
    character has its own bytes there, not those of the replacement character its text shows)."""
    content = []
    for token, log_prob in zip(completion.token_ids, completion.log_probs):
        content.append({"token": chat_format.decode_text([token]), "logprob": log_prob,
                        "bytes": list(chat_format.token_bytes(token)), "top_logprobs": []})
    return {"content": content, "refusal": None}


def _message(completion: Completion) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": completion.content}
    if completion.tool_calls:
        message["tool_calls"] = completion.tool_calls
    return message


def _usage(completions: list[Completion]) -> dict[str, int]:
    prompt = completions[0].prompt_tokens
    sampled = sum(len(completion.token_ids) for completion in completions)
    return {"prompt_tokens": prompt, "completion_tokens": sampled, "total_tokens": prompt + sampled}


def create_app(recorder: ChatRecorder, model_name: str, api_key: str = "",
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> Any:
    """The ASGI app serving `model_name` through `recorder`: bearer `api_key` if non-empty,
    bodies up to max_request_bytes."""
    app = FastAPI(title="tandem OpenAI-compatible endpoint")
    token_text = recorder.chat_format.decode_text

    @app.exception_handler(RequestError)
    async def bad_request(request: Request, error: RequestError) -> JSONResponse:
        return error_response(error.status, error.message, error.code, error.param)

    @app.exception_handler(BodyTooLarge)
    async def too_large(request: Request, error: BodyTooLarge) -> JSONResponse:
        return error_response(413, str(error), code="request_too_large")

    @app.exception_handler(Exception)
    async def failed(request: Request, error: Exception) -> JSONResponse:
        return error_response(500, f"the rollout backend failed: {type(error).__name__}: {error}",
                              code="server_error")

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    @app.get("/sessions/{session_id}/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "tandem"}]}

    @app.post("/sessions/{session_id}/v1/chat/completions")
    async def session_chat(request: Request, session_id: str) -> Any:
        return await chat(request, session_id)

    @app.post("/v1/chat/completions")
    async def chat(request: Request, session_id: str = "") -> Any:
        body = await _chat_request(request)
        if body.model != model_name:
            raise RequestError(404, f"the model {body.model!r} does not exist; this endpoint "
                               f"serves {model_name!r}", code="model_not_found", param="model")
        if body.tool_choice not in (None, "auto"):
            raise RequestError(400, f"tool_choice={body.tool_choice!r} is not supported; use "
                               "'auto' (the model decides)", param="tool_choice")
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(body, name):
                raise RequestError(400, f"{name}={getattr(body, name)} is not supported: the "
                                   "engine samples without it; send 0 or leave it out",
                                   code="invalid_request", param=name)
        if body.top_logprobs:
            raise RequestError(400, f"top_logprobs={body.top_logprobs} is not supported: the "
                               "engine returns the sampled token's logprob only; use "
                               "logprobs=true without top_logprobs", param="top_logprobs")
        session = (session_id or request.headers.get(SESSION_HEADER) or body.user
                   or uuid.uuid4().hex)
        if len(session) > MAX_SESSION_ID_CHARS:
            where = ("the URL's session id" if session_id else "X-Session-Id"
                     if request.headers.get(SESSION_HEADER) else "user")
            raise RequestError(413, f"{where}: the session id has {len(session)} characters; at "
                               f"most {MAX_SESSION_ID_CHARS}", code="request_too_large", param=where)
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        max_tokens = body.max_completion_tokens or body.max_tokens
        completions = await _unless_disconnected(request, recorder.complete(
            session, body.messages, body.tools or None,
            {"n": body.n, "max_tokens": max_tokens, "temperature": body.temperature,
             "top_p": body.top_p, "seed": body.seed, "stop": stop}))
        if completions is None:  # the client is gone: nobody reads a response
            return Response(status_code=499)
        response = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
                    "created": int(time.time()), "model": model_name,
                    "choices": [{"index": index, "message": _message(completion),
                                 "finish_reason": completion.finish_reason,
                                 "logprobs": _logprobs(completion, recorder.chat_format)
                                 if body.logprobs else None}
                                for index, completion in enumerate(completions)],
                    "usage": _usage(completions)}
        if body.stream:
            usage = bool((body.stream_options or {}).get("include_usage"))
            return StreamingResponse(_stream(response, completions, token_text, usage),
                                     media_type="text/event-stream")
        return response

    return RequestGuard(app, api_key, max_request_bytes)


async def _chat_request(request: Request) -> ChatRequest:
    """The validated body; RequestError 400 naming the field for anything malformed."""
    raw = await request.body()
    try:
        return await asyncio.to_thread(lambda: ChatRequest.model_validate(parse_json_body(raw)))
    except BadBody as error:
        raise RequestError(400, str(error), code="invalid_request") from None
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise RequestError(400, f"{where}: {first['msg']}", code="invalid_request",
                           param=where or None) from None


async def _unless_disconnected(request: Request, work: Any) -> Any:
    """Await `work`, but cancel it (and return None) when the client disconnects first."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this handler itself is cancelled (the server stops)
        task.cancel()
        gone.cancel()
        raise
    gone.cancel()
    if task in done:
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return None


async def _disconnected(request: Request) -> None:
    """Returns once the ASGI server reports the client's disconnect (the body is read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _stream(response: dict[str, Any], completions: list[Completion], token_text: Any,
                  include_usage: bool) -> Any:
    """The finished response as OpenAI's chunk sequence per choice: the role, the content token by
    token, the tool calls, then an empty delta with finish_reason; [DONE] last. The chunks go
    out once the turn is complete (the recorder records whole turns)."""
    base = {key: response[key] for key in ("id", "created", "model")}

    def chunk(index: int, delta: dict[str, Any], finish_reason: str | None = None,
              logprobs: Any = None) -> str:
        body = {**base, "object": "chat.completion.chunk",
                "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                             "finish_reason": finish_reason}]}
        return f"data: {json.dumps(body)}\n\n"

    for choice, completion in zip(response["choices"], completions):
        index, message = choice["index"], choice["message"]
        yield chunk(index, {"role": "assistant", "content": ""})
        pieces = [token_text([token]) for token in completion.token_ids]
        content = message["content"] or ""
        # token by token when the tokens spell the content, else the content whole
        joined = "".join(pieces)
        if content and joined.startswith(content) and not message.get("tool_calls"):
            text = ""
            for piece in pieces:
                piece = piece[:max(len(content) - len(text), 0)]
                if piece:
                    text += piece
                    yield chunk(index, {"content": piece})
        elif content:
            yield chunk(index, {"content": content})
        if message.get("tool_calls"):
            yield chunk(index, {"tool_calls": [{"index": i, **call}
                                               for i, call in enumerate(message["tool_calls"])]})
        yield chunk(index, {}, choice["finish_reason"], choice["logprobs"])
    if include_usage:
        body = {**base, "object": "chat.completion.chunk", "choices": [], "usage": response["usage"]}
        yield f"data: {json.dumps(body)}\n\n"
    yield "data: [DONE]\n\n"


class EndpointServer:
    """Runs an app with uvicorn on the current event loop; port 0 picks a free port."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0) -> None:
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                                    lifespan="off", access_log=False,
                                                    timeout_keep_alive=KEEP_ALIVE_S))
        self.host = host
        self.port = port
        self._task: asyncio.Task | None = None

    @property
    def base_url(self) -> str:
        """The URL an OpenAI client takes as base_url."""
        return f"http://{self.host}:{self.port}/v1"

    def session_url(self, session: str) -> str:
        """A base_url whose calls record into `session`, whatever their headers say."""
        return f"http://{self.host}:{self.port}/sessions/{quote(session, safe='')}/v1"

    async def start(self) -> str:
        """Bind and serve in the background; returns base_url once requests are accepted."""
        self._task = asyncio.create_task(self.server.serve())
        while not self.server.started:
            if self._task.done():
                self._task.result()  # raises the bind error
                raise RuntimeError(f"the endpoint on {self.host}:{self.port} stopped at start")
            await asyncio.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self.base_url

    async def wait(self) -> None:
        """Serve until the server exits."""
        if self._task is not None:
            await self._task

    async def serve_until_signal(self, on_start: Any = None) -> str:
        """tandem serve: start, call on_start(base_url), serve until SIGINT or SIGTERM, then
        stop cleanly (no KeyboardInterrupt): uvicorn re-raises the signal it caught once it
        stops, and the handler here takes it. Returns base_url."""
        def stop(signum: int, frame: Any) -> None:
            self.server.should_exit = True
        previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            url = await self.start()
            if on_start is not None:
                on_start(url)
            await self.wait()
            return url
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    async def stop(self) -> None:
        """Stop accepting requests and wait for the server task to end."""
        if self._task is not None:
            self.server.should_exit = True
            await self._task
            self._task = None
