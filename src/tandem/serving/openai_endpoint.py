"""An OpenAI-compatible chat endpoint over the rollout servers (FastAPI + uvicorn).

POST /v1/chat/completions and GET /v1/models. Calls go through a ChatRecorder (rendering with
the model's chat template, tool-call parsing, token-exact session recording) and its
TokenClient (the serving client: balancer, sticky on the session id). The session id is the
`X-Session-Id` header, else the request's `user` field, else a fresh id per call.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from tandem.agent.recorder import ChatRecorder, Completion, RequestError

SESSION_HEADER = "x-session-id"


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
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    n: int = Field(default=1, ge=1, le=64)
    stop: str | list[str] | None = None
    logprobs: bool = False
    top_logprobs: int | None = None  # only 0: the engine returns the sampled token's logprob
    seed: int | None = None
    user: str | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None


def error_response(status: int, message: str, code: str | None = None,
                   param: str | None = None) -> JSONResponse:
    """An OpenAI-style error object."""
    kind = {401: "authentication_error", 404: "invalid_request_error"}.get(
        status, "invalid_request_error" if status < 500 else "server_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param,
                                   "code": code}}, status_code=status)


def _logprobs(completion: Completion, token_text: Any) -> dict[str, Any]:
    content = []
    for token, log_prob in zip(completion.token_ids, completion.log_probs):
        text = token_text([token])
        content.append({"token": text, "logprob": log_prob, "bytes": list(text.encode()),
                        "top_logprobs": []})
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


def create_app(recorder: ChatRecorder, model_name: str, api_key: str = "") -> FastAPI:
    """The FastAPI app serving `model_name` through `recorder` (bearer `api_key` if non-empty)."""
    app = FastAPI(title="tandem OpenAI-compatible endpoint")
    token_text = recorder.chat_format.decode_text
    expected_auth = f"Bearer {api_key}"

    @app.middleware("http")
    async def authorize(request: Request, call_next: Any) -> Any:
        if api_key and request.headers.get("authorization") != expected_auth:
            return error_response(401, "missing or wrong bearer token: send the endpoint's api "
                                  "key as 'Authorization: Bearer <key>'", code="invalid_api_key")
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"] if part != "body")
        return error_response(400, f"{where}: {first['msg']}", code="invalid_request",
                              param=where or None)

    @app.exception_handler(RequestError)
    async def bad_request(request: Request, error: RequestError) -> JSONResponse:
        return error_response(error.status, error.message, error.code, error.param)

    @app.exception_handler(Exception)
    async def failed(request: Request, error: Exception) -> JSONResponse:
        return error_response(500, f"the rollout backend failed: {type(error).__name__}: {error}",
                              code="server_error")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "tandem"}]}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request) -> Any:
        if body.model != model_name:
            raise RequestError(404, f"the model {body.model!r} does not exist; this endpoint "
                               f"serves {model_name!r}", code="model_not_found", param="model")
        if body.tool_choice not in (None, "auto"):
            raise RequestError(400, f"tool_choice={body.tool_choice!r} is not supported; use "
                               "'auto' (the model decides)", param="tool_choice")
        if body.top_logprobs:
            raise RequestError(400, f"top_logprobs={body.top_logprobs} is not supported: the "
                               "engine returns the sampled token's logprob only; use "
                               "logprobs=true without top_logprobs", param="top_logprobs")
        session = request.headers.get(SESSION_HEADER) or body.user or uuid.uuid4().hex
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        max_tokens = body.max_completion_tokens or body.max_tokens
        completions = await recorder.complete(
            session, body.messages, body.tools or None,
            {"n": body.n, "max_tokens": max_tokens, "temperature": body.temperature,
             "top_p": body.top_p, "seed": body.seed, "stop": stop})
        response = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
                    "created": int(time.time()), "model": model_name,
                    "choices": [{"index": index, "message": _message(completion),
                                 "finish_reason": completion.finish_reason,
                                 "logprobs": _logprobs(completion, token_text)
                                 if body.logprobs else None}
                                for index, completion in enumerate(completions)],
                    "usage": _usage(completions)}
        if body.stream:
            usage = bool((body.stream_options or {}).get("include_usage"))
            return StreamingResponse(_stream(response, usage), media_type="text/event-stream")
        return response

    return app


async def _stream(response: dict[str, Any], include_usage: bool) -> Any:
    """The finished response as server-sent chunks: one delta per choice, then [DONE]."""
    base = {key: response[key] for key in ("id", "created", "model")}
    for choice in response["choices"]:
        delta = dict(choice["message"])
        if "tool_calls" in delta:
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(delta["tool_calls"])]
        chunk = {**base, "object": "chat.completion.chunk",
                 "choices": [{"index": choice["index"], "delta": delta, "logprobs": choice["logprobs"],
                              "finish_reason": choice["finish_reason"]}]}
        yield f"data: {json.dumps(chunk)}\n\n"
    if include_usage:
        chunk = {**base, "object": "chat.completion.chunk", "choices": [], "usage": response["usage"]}
        yield f"data: {json.dumps(chunk)}\n\n"
    yield "data: [DONE]\n\n"


class EndpointServer:
    """Runs an app with uvicorn on the current event loop; port 0 picks a free port."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> None:
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                                    lifespan="off", access_log=False))
        self.host = host
        self.port = port
        self._task: asyncio.Task | None = None

    @property
    def base_url(self) -> str:
        """The URL an OpenAI client takes as base_url."""
        return f"http://{self.host}:{self.port}/v1"

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
        """Serve until the server exits (tandem serve: until interrupted)."""
        if self._task is not None:
            await self._task

    async def stop(self) -> None:
        """Stop accepting requests and wait for the server task to end."""
        if self._task is not None:
            self.server.should_exit = True
            await self._task
            self._task = None
