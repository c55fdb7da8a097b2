"""Issue 28's soak test: 200 concurrent requests to the endpoint (in a process of its own)
mixing valid, malformed, oversized and disconnecting clients. Every valid call is answered,
the server's memory comes back to within 10% of its start, and the only sessions left are
those of the valid calls."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

LIMIT = 1 << 20
SERVER = """
import asyncio, json, random, sys
sys.path.insert(0, {tests!r})
from openai_scripted import ScriptedEngine
from transformers import AutoTokenizer
from tandem.agent.chat_format import ChatFormat
from tandem.agent.recorder import ChatRecorder
from tandem.config.schema import RolloutConfig
from tandem.models.tiny import build_tiny_model
from tandem.agent.openai_endpoint import EndpointServer, create_app


class SlowEngine(ScriptedEngine):
    async def generate(self, request):
        await asyncio.sleep(random.uniform(0.3, 0.8))  # long enough to disconnect meanwhile
        return await super().generate(request)


tokenizer = AutoTokenizer.from_pretrained(build_tiny_model())
recorder = ChatRecorder(SlowEngine(tokenizer), ChatFormat(tokenizer),
                        RolloutConfig(prompt_length=400, response_length=200))
server = EndpointServer(create_app(recorder, "tiny", max_request_bytes={limit}))
asyncio.run(server.serve_until_signal(lambda url: print(url, flush=True)))
print(json.dumps(sorted(recorder.sessions)), flush=True)
"""


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def question(i: int) -> dict:
    return {"model": "tiny", "seed": i, "max_tokens": 32,
            "messages": [{"role": "user", "content": f"What is {i} + {i % 7}?"}]}


MALFORMED = [b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}',
             b'{"model": "tiny", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
             json.dumps({**question(0), "stop": [""]}).encode(),
             b'{"model": "tiny", "messages": [', b"\xff\xfe\xfd",
             json.dumps({**question(0), "messages": [{"role": "robot", "content": "x"}]}).encode()]


async def soak(url: str, rng: random.Random) -> dict[str, list]:
    """200 concurrent clients; returns the status codes (or errors) per kind."""
    http = httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=300))
    endpoint = f"{url}/chat/completions"

    async def valid(i: int):
        reply = await http.post(endpoint, json=question(i), headers={"x-session-id": f"valid-{i}"})
        return reply.status_code

    async def malformed(i: int):
        reply = await http.post(endpoint, content=rng.choice(MALFORMED),
                                headers={"content-type": "application/json",
                                         "x-session-id": f"malformed-{i}"})
        return reply.status_code

    async def oversized(i: int):
        body = json.dumps({**question(i), "messages": [{"role": "user", "content": "x" * (4 * LIMIT)}]}).encode()
        headers = {"content-type": "application/json", "x-session-id": f"oversized-{i}"}
        try:
            if i % 2:
                reply = await http.post(endpoint, content=body, headers=headers)
            else:  # streamed without a Content-Length
                async def chunks():
                    for start in range(0, len(body), 256 * 1024):
                        yield body[start:start + 256 * 1024]
                reply = await http.post(endpoint, content=chunks(), headers=headers)
            return reply.status_code
        except httpx.TransportError as error:  # the server may close before the upload ends
            return type(error).__name__

    async def disconnecting(i: int):
        client = httpx.AsyncClient(timeout=120)
        call = asyncio.create_task(client.post(endpoint, json=question(i),
                                               headers={"x-session-id": f"gone-{i}"}))
        await asyncio.sleep(rng.uniform(0.05, 0.25))
        call.cancel()
        await asyncio.gather(call, return_exceptions=True)
        await client.aclose()
        return "gone"

    kinds = {"valid": valid, "malformed": malformed, "oversized": oversized,
             "disconnecting": disconnecting}
    plan = ["valid"] * 80 + ["malformed"] * 40 + ["oversized"] * 40 + ["disconnecting"] * 40
    rng.shuffle(plan)
    results = await asyncio.gather(*(kinds[kind](i) for i, kind in enumerate(plan)))
    await http.aclose()
    by_kind: dict[str, list] = {kind: [] for kind in kinds}
    for i, (kind, result) in enumerate(zip(plan, results)):
        by_kind[kind].append((i, result))
    return by_kind


@pytest.mark.slow
def test_endpoint_soak(tmp_path):
    script = tmp_path / "server.py"
    script.write_text(SERVER.format(tests=str(Path(__file__).resolve().parents[1]), limit=LIMIT))
    process = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=os.environ.copy())
    try:
        url = process.stdout.readline().strip()
        assert url.startswith("http://"), process.stderr.read()

        async def warm_up() -> None:  # every code path once, so the baseline includes them
            async with httpx.AsyncClient(timeout=120) as http:
                for i, body in enumerate(MALFORMED):
                    await http.post(f"{url}/chat/completions", content=body,
                                    headers={"content-type": "application/json"})
                for i in range(20):
                    await http.post(f"{url}/chat/completions", json=question(i),
                                    headers={"x-session-id": f"warm-{i}"})
        asyncio.run(warm_up())
        start = rss_bytes(process.pid)
        results = asyncio.run(soak(url, random.Random(0)))
        assert [code for _, code in results["valid"]] == [200] * 80
        assert {code for _, code in results["malformed"]} == {400}
        assert {code for _, code in results["oversized"]} <= {413, "WriteError", "ReadError",
                                                              "RemoteProtocolError"}
        assert 413 in {code for _, code in results["oversized"]}
        # after the soak it still answers
        reply = httpx.post(f"{url}/chat/completions", json=question(999),
                           headers={"x-session-id": "after"}, timeout=120)
        assert reply.status_code == 200
        deadline = time.monotonic() + 30
        while rss_bytes(process.pid) > 1.1 * start and time.monotonic() < deadline:
            time.sleep(0.5)  # freed bodies and cancelled generations settle
        end = rss_bytes(process.pid)
        assert end <= 1.1 * start, f"RSS {start / 2**20:.0f} MiB -> {end / 2**20:.0f} MiB"
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 0, err
    sessions = json.loads(out.strip().splitlines()[-1])
    expected = {f"warm-{i}" for i in range(20)} | {f"valid-{i}" for i, _ in results["valid"]} | {"after"}
    assert set(sessions) == expected  # none of the malformed, oversized or disconnected ones
