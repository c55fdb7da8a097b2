"""Issue 28, "the HTTP endpoint": oversized bodies and fields are a 413, every malformed input a
400 naming what is wrong (lone surrogates, 100k-deep JSON, `stop: [""]`, invalid UTF-8, bad
tools), sessions exist only for calls that succeeded, a client that disconnects cancels its
generation, rendering runs off the event loop, and SIGINT stops `serve` cleanly (exit 0)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from openai_scripted import ScriptedEngine
from transformers import AutoTokenizer

from tandem.agent.chat_format import ChatFormat
from tandem.agent.recorder import ChatRecorder
from tandem.config.schema import RolloutConfig
from tandem.models.tiny import build_tiny_model
from tandem.agent.openai_endpoint import EndpointServer, create_app

QUESTION = [{"role": "user", "content": "What is 2 + 3?"}]
LIMIT = 1 << 20  # above the 200 KB of the 100k-deep body


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(build_tiny_model())


class Endpoint:
    """A recorder and server over a scripted engine, with a small body limit."""

    def __init__(self, tokenizer, engine=None) -> None:
        self.engine = engine or ScriptedEngine(tokenizer)
        self.recorder = ChatRecorder(self.engine, ChatFormat(tokenizer),
                                     RolloutConfig(prompt_length=400, response_length=200))
        self.server = EndpointServer(create_app(self.recorder, "tiny", max_request_bytes=LIMIT))

    async def __aenter__(self) -> "Endpoint":
        self.url = await self.server.start()
        self.http = httpx.AsyncClient(timeout=60)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.http.aclose()
        await self.server.stop()

    async def post(self, body: bytes | dict, session: str = "s", **headers) -> httpx.Response:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        return await self.http.post(f"{self.url}/chat/completions", content=content, headers={
            "content-type": "application/json", "x-session-id": session, **headers})


def chat(**fields) -> dict:
    return {"model": "tiny", "messages": QUESTION, **fields}


DEEP = b'{"model": "tiny", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
MALFORMED = [
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800b"}]}',
     "messages[0].content: holds a lone UTF-16 surrogate"),
    (DEEP, "nests deeper than 64 levels"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "\xff\xfe"}]}', "not UTF-8"),
    (b'{"model": "tiny", "messages": [', "not valid JSON"),
    (json.dumps(chat(stop=[""])).encode(), "stop: Value error, a stop string must not be empty"),
    (json.dumps(chat(stop=["a", "b", "c", "d", "e"])).encode(), "at most 4 stop strings"),
    (json.dumps(chat(messages=[])).encode(), "messages: Value error, must not be empty"),
    (json.dumps(chat(tools=[{"type": "function"}])).encode(), "every tool must be"),
    (json.dumps(chat(seed=2**64)).encode(), "seed: Input should be less than or equal to"),
    (json.dumps(chat(messages=[{"role": "user", "content": {"a": 1}}])).encode(),
     "message content must be a string"),
    (json.dumps([1, 2]).encode(), "Input should be a valid dictionary"),
]


@pytest.mark.parametrize("body, words", MALFORMED, ids=[w[:24] for _, w in MALFORMED])
async def test_malformed_input_is_a_400_and_leaves_no_session(tokenizer, body, words):
    async with Endpoint(tokenizer) as endpoint:
        reply = await endpoint.post(body)
        assert reply.status_code == 400, reply.text
        assert words in reply.json()["error"]["message"]
        assert endpoint.engine.calls == [] and endpoint.recorder.sessions == {}


async def test_oversized_bodies_and_fields_are_a_413(tokenizer):
    async with Endpoint(tokenizer) as endpoint:
        big = json.dumps(chat(messages=[{"role": "user", "content": "x" * LIMIT}])).encode()
        reply = await endpoint.post(big)
        assert reply.status_code == 413 and "larger than 1048576 bytes" in reply.text

        async def chunks():  # no Content-Length: the guard counts what arrives
            yield big[:1000]
            yield big[1000:]
        reply = await endpoint.http.post(f"{endpoint.url}/chat/completions", content=chunks(),
                                         headers={"content-type": "application/json"})
        assert reply.status_code == 413, reply.text
        reply = await endpoint.post(chat(), session="s" * 200_000)
        assert reply.status_code == 413 and "X-Session-Id" in reply.text
        reply = await endpoint.post(chat(user="u" * 300), session="")
        assert reply.status_code == 413 and reply.json()["error"]["param"] == "user"
        assert endpoint.engine.calls == [] and endpoint.recorder.sessions == {}
        # and the endpoint still answers a valid call
        reply = await endpoint.post(chat(seed=1))
        assert reply.status_code == 200 and list(endpoint.recorder.sessions) == ["s"]


async def test_a_failed_call_creates_no_session_and_changes_none(tokenizer):
    async with Endpoint(tokenizer) as endpoint:
        assert (await endpoint.post(chat(seed=4))).status_code == 200
        before = endpoint.recorder.sessions["s"].trajectories()[0].responses.tolist()

        async def broken(*args):
            raise RuntimeError("engine is down")
        endpoint.engine.generate = broken
        assert (await endpoint.post(chat(), session="new")).status_code == 500
        assert list(endpoint.recorder.sessions) == ["s"]
        follow_up = QUESTION + [{"role": "assistant", "content": "x"}, {"role": "user", "content": "?"}]
        assert (await endpoint.post(chat(messages=follow_up))).status_code == 500
        [trajectory] = endpoint.recorder.sessions["s"].trajectories()
        assert trajectory.responses.tolist() == before  # the failed fork left nothing behind


class BlockedEngine(ScriptedEngine):
    """Never finishes a call until released; records cancellations."""

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        self.started = asyncio.Event()
        self.cancelled = asyncio.Event()

    async def generate(self, request):
        request_id, prompt_ids, sampling_params = request.request_id, request.prompt_ids, request.sampling
        self.started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


async def test_a_disconnecting_client_cancels_its_generation(tokenizer):
    engine = BlockedEngine(tokenizer)
    async with Endpoint(tokenizer, engine) as endpoint:
        client = httpx.AsyncClient(timeout=60)
        call = asyncio.create_task(client.post(f"{endpoint.url}/chat/completions", json=chat(),
                                               headers={"x-session-id": "gone"}))
        await asyncio.wait_for(engine.started.wait(), 30)
        call.cancel()  # the client goes away mid-generation
        await asyncio.gather(call, return_exceptions=True)
        await client.aclose()
        await asyncio.wait_for(engine.cancelled.wait(), 30)
        for _ in range(100):
            if not endpoint.recorder.sessions:
                break
            await asyncio.sleep(0.05)
        assert endpoint.recorder.sessions == {}


async def test_rendering_runs_off_the_event_loop(tokenizer):
    """While one call's rendering blocks its thread, another request is answered."""
    async with Endpoint(tokenizer) as endpoint:
        release = asyncio.Event()
        loop = asyncio.get_running_loop()
        render = endpoint.recorder.chat_format.prompt_ids

        def slow_render(*args):
            asyncio.run_coroutine_threadsafe(release.wait(), loop).result(30)
            return render(*args)
        endpoint.recorder.chat_format.prompt_ids = slow_render
        call = asyncio.create_task(endpoint.post(chat()))
        models = await endpoint.http.get(f"{endpoint.url}/models")  # answered meanwhile
        assert models.status_code == 200 and not call.done()
        release.set()
        assert (await call).status_code == 200


SERVE = """
import asyncio, sys
sys.path.insert(0, {tests!r})
from openai_scripted import ScriptedEngine
from transformers import AutoTokenizer
from tandem.agent.chat_format import ChatFormat
from tandem.agent.recorder import ChatRecorder
from tandem.config.schema import RolloutConfig
from tandem.models.tiny import build_tiny_model
from tandem.agent.openai_endpoint import EndpointServer, create_app

tokenizer = AutoTokenizer.from_pretrained(build_tiny_model())
recorder = ChatRecorder(ScriptedEngine(tokenizer), ChatFormat(tokenizer), RolloutConfig())
server = EndpointServer(create_app(recorder, "tiny"))
asyncio.run(server.serve_until_signal(lambda url: print(url, flush=True)))
print("stopped", flush=True)
"""


def test_sigint_stops_the_server_cleanly(tmp_path):
    script = tmp_path / "serve.py"
    script.write_text(SERVE.format(tests=str(Path(__file__).resolve().parents[1])))
    process = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=os.environ.copy())
    try:
        url = process.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:"), process.stderr.read()
        reply = httpx.post(f"{url}/chat/completions", json=chat(), timeout=60)
        assert reply.status_code == 200
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 0 and "Traceback" not in err, err
    assert out.strip() == "stopped"


async def test_connections_reused_just_before_the_clients_expiry_still_work(tokenizer):
    """bench/stack.py's failing HTTP rounds: the openai client (httpx) keeps an idle connection
    for 5 s, and uvicorn's default keep-alive closed it after 5 s too, so requests sent ~5 s
    after a round raced the close (APIConnectionError). The endpoint keeps connections longer."""
    import openai

    async with Endpoint(tokenizer) as endpoint:
        client = openai.AsyncOpenAI(base_url=endpoint.url, api_key="x", max_retries=0)
        try:
            for gap in (0.0, 4.9, 4.95):
                await asyncio.sleep(gap)
                replies = await asyncio.gather(*(client.chat.completions.create(
                    model="tiny", messages=QUESTION, seed=i, user=f"{gap}-{i}") for i in range(64)),
                    return_exceptions=True)
                assert not [reply for reply in replies if isinstance(reply, Exception)], gap
        finally:
            await client.close()


def test_ctrl_c_outside_serving_is_one_line_not_a_traceback(monkeypatch, capsys):
    """Ctrl-C while `tandem serve` starts (or during train/eval): exit 130 and one line."""
    from tandem import cli

    def interrupted(args):
        raise KeyboardInterrupt
    monkeypatch.setattr(cli, "_run", interrupted)
    with pytest.raises(SystemExit) as exit_status:
        cli.main(["serve", "config.yaml"])
    assert exit_status.value.code == 130
    assert capsys.readouterr().err == "tandem serve: interrupted\n"
