"""The OpenAI-compatible endpoint over a scripted engine and the tiny model's real chat template:
response objects validated with the `openai` package's own types, token-exact session
recording, forks, concurrent sessions, n, stop strings, streaming and OpenAI-style errors."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletion
from openai_scripted import ScriptedEngine
from transformers import AutoTokenizer

from tandem.agent.chat_format import ChatFormat
from tandem.agent.recorder import ChatRecorder
from tandem.config.schema import RolloutConfig
from tandem.demo.tasks import calculator_schemas
from tandem.models.tiny import build_tiny_model
from tandem.agent.openai_endpoint import EndpointServer, create_app
from tandem.types import GenerateRequest, TokenOutput

QUESTION = [{"role": "system", "content": "Use the calculator tool, then give the final number."},
            {"role": "user", "content": "What is 2 + 3?"}]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(build_tiny_model())


class Endpoint:
    """A recorder + server on the test's event loop, and an openai client for it."""

    def __init__(self, tokenizer, api_key: str = "", **config) -> None:
        self.engine = ScriptedEngine(tokenizer, delay=True)
        self.format = ChatFormat(tokenizer)
        self.config = RolloutConfig(**{"prompt_length": 400, "response_length": 200, **config})
        self.recorder = ChatRecorder(self.engine, self.format, self.config)
        self.server = EndpointServer(create_app(self.recorder, "tiny", api_key))
        self.clients: list[openai.AsyncOpenAI] = []

    async def __aenter__(self) -> "Endpoint":
        self.url = await self.server.start()
        return self

    async def __aexit__(self, *exc) -> None:
        for client in self.clients:  # closed on this loop, not by the garbage collector later
            await client.close()
        await self.server.stop()

    def client(self, session: str | None = None, api_key: str = "x") -> openai.AsyncOpenAI:
        headers = {"X-Session-Id": session} if session else {}
        client = openai.AsyncOpenAI(base_url=self.url, api_key=api_key, max_retries=0,
                                    default_headers=headers)
        self.clients.append(client)
        return client


async def test_response_validates_as_openai_chat_completion(tokenizer):
    async with Endpoint(tokenizer) as endpoint:
        async with httpx.AsyncClient() as http:
            for seed in range(8):
                reply = await http.post(f"{endpoint.url}/chat/completions", json={
                    "model": "tiny", "messages": QUESTION, "tools": calculator_schemas(),
                    "logprobs": True, "seed": seed, "user": f"s{seed}"})
                assert reply.status_code == 200, reply.text
                completion = ChatCompletion.model_validate(reply.json())
                _, prompt, params = endpoint.engine.calls[-1]
                assert params["seed"] == seed and params["logprobs"] is True
                [choice] = completion.choices
                trajectory = endpoint.recorder.sessions[f"s{seed}"].trajectories()[0]
                sampled = trajectory.responses.tolist()
                # usage and logprobs describe exactly the recorded tokens
                assert completion.usage.prompt_tokens == len(prompt) == len(trajectory.prompts)
                assert completion.usage.completion_tokens == len(sampled)
                assert [entry.logprob for entry in choice.logprobs.content] == \
                    trajectory.rollout_log_probs.tolist()
                assert trajectory.response_mask.tolist() == [1] * len(sampled)
                assert trajectory.prompts.tolist() == ChatFormat(tokenizer).prompt_ids(
                    QUESTION, calculator_schemas())
                if choice.finish_reason == "tool_calls":
                    [call] = choice.message.tool_calls
                    assert call.type == "function" and call.function.name == "calculator"
                    assert set(json.loads(call.function.arguments)) == {"expression"}
                    assert choice.message.content is None
                else:
                    assert choice.finish_reason == "stop"
                    assert choice.message.content.startswith("The answer is ")
                    assert choice.message.tool_calls is None
        models = await endpoint.client().models.list()
        assert [model.id for model in models.data] == ["tiny"]


async def conversation(client: openai.AsyncOpenAI, messages: list[dict], turns: int) -> list[dict]:
    """Chat until a plain answer (or `turns` calls), answering each tool call with '5'."""
    messages = list(messages)
    for _ in range(turns):
        response = await client.chat.completions.create(model="tiny", messages=messages,
                                                         tools=calculator_schemas(), seed=1)
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        messages += [{"role": "tool", "tool_call_id": c.id, "content": "5"}
                     for c in message.tool_calls]
    return messages


async def test_a_session_appends_one_token_exact_trajectory(tokenizer):
    async with Endpoint(tokenizer) as endpoint:
        messages = await conversation(endpoint.client("s"), QUESTION, turns=3)
        calls = endpoint.engine.calls
        assert len(calls) >= 2, "the scripted engine calls the tool on seed 1's first turn"
        assert {request_id for request_id, _, _ in calls} == {"s"}  # sticky on the session id
        [trajectory] = endpoint.recorder.close("s")
        stream = trajectory.input_ids.tolist()
        prompt = trajectory.prompts.tolist()
        mask = trajectory.response_mask.tolist()
        for (_, sent, _), (_, later, _) in zip(calls, calls[1:]):
            assert later[:len(sent)] == sent  # turn k+1 extends turn k's prompt + its tokens
        # every prompt the engine saw is a prefix of the recorded stream; what it sampled is
        # mask 1 and the template's tool turns are mask 0 with logprob 0.0
        sampled = [i for i, m in enumerate(mask) if m == 1]
        for _, sent, _ in calls:
            assert stream[:len(sent)] == sent
        starts = [len(sent) - len(prompt) for _, sent, _ in calls]
        assert sampled[0] == 0 and all(mask[s] == 1 for s in starts)
        context = [i for i, m in enumerate(mask) if m == 0]
        assert context and all(trajectory.rollout_log_probs[i] == 0.0 for i in context)
        tool_turn = ChatFormat(tokenizer).tool_turn_ids([{"role": "tool", "content": "5"}], True)
        assert stream[len(prompt) + starts[1] - len(tool_turn):len(prompt) + starts[1]] == tool_turn
        assert trajectory.min_global_steps == trajectory.max_global_steps == 3
        assert endpoint.recorder.forks == 0
        assert trajectory.metadata["assistant_turns"] == len(calls)
        assert messages[-1]["role"] == "assistant"


async def test_an_edited_history_forks_and_counts_it(tokenizer):
    async with Endpoint(tokenizer) as endpoint:
        client = endpoint.client("s")
        messages = await conversation(client, QUESTION, turns=1)
        assert "tool_calls" in messages[-2] and messages[-1]["role"] == "tool"
        first_calls = len(endpoint.engine.calls)
        edited = list(messages)
        edited[1] = {"role": "user", "content": "What is 2 + 4?"}  # a mid-conversation edit
        await client.chat.completions.create(model="tiny", messages=edited,
                                             tools=calculator_schemas(), seed=1)
        assert endpoint.recorder.forks == 1
        _, sent, _ = endpoint.engine.calls[first_calls]
        # the fork renders the edited conversation from scratch; nothing of branch one leaks in
        assert sent == ChatFormat(tokenizer).prompt_ids(
            [{**m, "tool_calls": [{"type": "function", "function": {
                "name": c["function"]["name"],
                "arguments": json.loads(c["function"]["arguments"])}} for c in m["tool_calls"]]}
             if m.get("tool_calls") else {"role": m["role"], "content": m["content"]}
             for m in edited], calculator_schemas())
        first, second = endpoint.recorder.close("s")
        # branch one keeps exactly its single turn: the edit appended nothing to it
        _, first_prompt, first_params = endpoint.engine.calls[0]
        replay = await ScriptedEngine(tokenizer).generate(GenerateRequest("r", first_prompt, first_params))
        assert first.input_ids.tolist() == first_prompt + replay.token_ids
        assert first.response_mask.tolist() == [1] * len(first.responses)
        assert second.prompts.tolist() == sent and second.metadata["forks"] == 1


async def test_concurrent_sessions_never_share_tokens(tokenizer):
    async with Endpoint(tokenizer) as endpoint:
        questions = [[{"role": "user", "content": f"What is {i} + {i}? session {i}"}]
                     for i in range(12)]
        await asyncio.gather(*(conversation(endpoint.client(f"s{i}"), q, turns=3)
                               for i, q in enumerate(questions)))
        for i, question in enumerate(questions):
            [trajectory] = endpoint.recorder.close(f"s{i}")
            calls = [(sent, params) for rid, sent, params in endpoint.engine.calls if rid == f"s{i}"]
            assert trajectory.prompts.tolist() == ChatFormat(tokenizer).prompt_ids(
                question, calculator_schemas())
            # the recorded stream is exactly the last prompt this session sent + its tokens
            last_sent, last_params = calls[-1]
            replay = await ScriptedEngine(tokenizer).generate(GenerateRequest("r", last_sent, last_params))
            assert trajectory.input_ids.tolist() == last_sent + replay.token_ids
            assert f"session {i}" in tokenizer.decode(trajectory.prompts)
        assert endpoint.recorder.forks == 0


async def test_n_choices_are_branches_and_stop_strings_cut_tokens(tokenizer):
    async with Endpoint(tokenizer) as endpoint:
        client = endpoint.client("s")
        response = await client.chat.completions.create(model="tiny", messages=QUESTION, n=3,
                                                         seed=5, max_tokens=50)
        assert [choice.index for choice in response.choices] == [0, 1, 2]
        seeds = [params["seed"] for _, _, params in endpoint.engine.calls]
        assert len(set(seeds)) == 3 and seeds[0] == 5
        assert all(params["max_tokens"] == 50 for _, _, params in endpoint.engine.calls)
        branches = endpoint.recorder.close("s")
        assert len(branches) == 3
        assert response.usage.completion_tokens == sum(len(b.responses) for b in branches)

        response = await endpoint.client("t").chat.completions.create(
            model="tiny", messages=QUESTION, stop=["calculator"], seed=1)
        [choice] = response.choices
        _, _, params = endpoint.engine.calls[-1]
        full = (await ScriptedEngine(tokenizer).generate(GenerateRequest("r", endpoint.engine.calls[-1][1],
                                                          params))).token_ids
        [trajectory] = endpoint.recorder.close("t")
        kept = trajectory.responses.tolist()
        assert kept == full[:len(kept)] and len(kept) < len(full)
        # the fewest tokens holding everything before the stop string; their text is the reply
        text = tokenizer.decode(full)
        before = text[:text.index("calculator")]
        assert tokenizer.decode(kept).startswith(before)
        assert not tokenizer.decode(kept[:-1]).startswith(before)
        assert choice.finish_reason == "stop" and choice.message.content == tokenizer.decode(kept)


async def test_streaming_returns_openai_chunks_with_the_same_reply(tokenizer):
    async with Endpoint(tokenizer) as endpoint:
        stream = await endpoint.client("s").chat.completions.create(
            model="tiny", messages=QUESTION, tools=calculator_schemas(), seed=1, stream=True,
            stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
        [trajectory] = endpoint.recorder.close("s")
        assert chunks[0].choices[0].delta.role == "assistant"
        calls = [c for c in chunks if c.choices and c.choices[0].delta.tool_calls]
        assert len(calls) == 1
        call = calls[0].choices[0].delta.tool_calls[0]
        assert call.index == 0 and call.function.name == "calculator"
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert finishes[-1] == "tool_calls" and set(finishes[:-1]) == {None}
        assert chunks[-1].usage.completion_tokens == len(trajectory.responses)

        # a plain reply comes token by token and adds up to the non-streamed content
        plain = 0
        for seed in range(8):  # the scripted engine's seed decides between a call and a reply
            reply = await endpoint.client(f"r{seed}").chat.completions.create(
                model="tiny", messages=QUESTION, tools=calculator_schemas(), seed=seed)
            if reply.choices[0].message.tool_calls:
                continue
            stream = await endpoint.client(f"q{seed}").chat.completions.create(
                model="tiny", messages=QUESTION, tools=calculator_schemas(), seed=seed, stream=True)
            pieces = [c.choices[0].delta.content for c in [chunk async for chunk in stream]
                      if c.choices and c.choices[0].delta.content]
            assert len(pieces) > 1 and "".join(pieces) == reply.choices[0].message.content
            plain += 1
        assert plain


async def test_penalties_at_their_defaults_and_health(tokenizer):
    async with Endpoint(tokenizer, api_key="secret") as endpoint:
        response = await endpoint.client("s", api_key="secret").chat.completions.create(
            model="tiny", messages=QUESTION, frequency_penalty=0, presence_penalty=0.0, seed=1)
        assert response.choices[0].finish_reason in ("stop", "tool_calls", "length")
        async with httpx.AsyncClient() as http:  # no bearer token needed for the probe
            health = await http.get(endpoint.url.removesuffix("/v1") + "/health")
        assert (health.status_code, health.json()) == (200, {"status": "ok"})


@pytest.mark.parametrize("request_fields, error_type, status, code, words", [
    ({"model": "gpt-4"}, openai.NotFoundError, 404, "model_not_found", "'gpt-4' does not exist"),
    ({"messages": [{"role": "user", "content": "x " * 500}]}, openai.BadRequestError, 400,
     "context_length_exceeded", "rollout.prompt_length=400"),
    ({"messages": [{"role": "robot", "content": "x"}]}, openai.BadRequestError, 400, None,
     "role 'robot'"),
    ({"top_logprobs": 5, "logprobs": True}, openai.BadRequestError, 400, None,
     "the engine returns the sampled token's logprob only"),
    ({"tool_choice": "required"}, openai.BadRequestError, 400, None, "tool_choice='required'"),
    ({"frequency_penalty": 0.5}, openai.BadRequestError, 400, "invalid_request",
     "frequency_penalty=0.5 is not supported"),
    ({"presence_penalty": -1.0}, openai.BadRequestError, 400, "invalid_request",
     "presence_penalty=-1.0 is not supported"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "text", "text": "what is it?"}]}]}, openai.BadRequestError, 400,
     "invalid_request", "only text content parts are served here"),
])
async def test_bad_requests_get_openai_errors(tokenizer, request_fields, error_type, status, code,
                                              words):
    async with Endpoint(tokenizer) as endpoint:
        fields = {"model": "tiny", "messages": QUESTION, **request_fields}
        with pytest.raises(error_type) as raised:
            await endpoint.client("s").chat.completions.create(**fields)
        assert raised.value.status_code == status and raised.value.code == code
        assert words in raised.value.message
        assert endpoint.engine.calls == []  # nothing reached the engine
        assert not endpoint.recorder.sessions.get("s") or not \
            endpoint.recorder.sessions["s"].trajectories()


async def test_bearer_token_is_required_when_set(tokenizer):
    async with Endpoint(tokenizer, api_key="secret") as endpoint:
        with pytest.raises(openai.AuthenticationError) as raised:
            await endpoint.client(api_key="wrong").models.list()
        assert raised.value.status_code == 401 and raised.value.code == "invalid_api_key"
        models = await endpoint.client(api_key="secret").models.list()
        assert models.data[0].id == "tiny"
    assert endpoint.server.host == "127.0.0.1"  # localhost unless configured otherwise


async def test_session_budget_is_an_error_and_cuts_the_tool_turn(tokenizer):
    async with Endpoint(tokenizer, response_length=40) as endpoint:
        client = endpoint.client("s")
        messages = await conversation(client, QUESTION, turns=1)
        first_prompt = len(endpoint.engine.calls[0][1])
        messages[-1]["content"] = "5 " * 30
        with pytest.raises(openai.BadRequestError) as raised:
            await client.chat.completions.create(model="tiny", messages=messages,
                                                 tools=calculator_schemas())
        assert raised.value.code == "context_length_exceeded"
        [trajectory] = endpoint.recorder.close("s")
        assert len(trajectory.responses) == 40 and trajectory.stop_reason == "length"
        assert first_prompt == len(trajectory.prompts) and len(endpoint.engine.calls) == 1


async def test_ad_hoc_sessions_are_capped_but_registered_ones_stay(tokenizer):
    from tandem.agent.recorder import SessionSettings

    async with Endpoint(tokenizer) as endpoint:
        endpoint.recorder.max_sessions = 2
        endpoint.recorder.open("loop-0", SessionSettings(uid="u"))
        for name in ("a", "b", "c"):
            await endpoint.client(name).chat.completions.create(model="tiny", messages=QUESTION)
        assert list(endpoint.recorder.sessions) == ["loop-0", "b", "c"]


async def test_a_malformed_tool_call_in_history_and_a_failing_engine_get_openai_errors(tokenizer):
    async with Endpoint(tokenizer) as endpoint:
        client = endpoint.client("s")
        with pytest.raises(openai.BadRequestError, match="needs a function with a string name"):
            await client.chat.completions.create(model="tiny", messages=[
                *QUESTION, {"role": "assistant", "tool_calls": [{"id": "1", "type": "function"}]}])

        async def broken(*args):
            raise RuntimeError("engine is down")

        endpoint.engine.generate = broken
        with pytest.raises(openai.InternalServerError) as raised:
            await client.chat.completions.create(model="tiny", messages=QUESTION)
        assert "RuntimeError: engine is down" in raised.value.message


class CharacterEngine(ScriptedEngine):
    """Samples the same texts one character per token: a tokenization the tokenizer itself
    would never produce, so any re-tokenization of the reply would show."""

    async def generate(self, request):
        request_id, prompt_ids, sampling_params = request.request_id, request.prompt_ids, request.sampling
        output = await super().generate(GenerateRequest(request_id, prompt_ids, sampling_params))
        text = self.tokenizer.decode(output.token_ids[:-1])
        output.token_ids = [token for char in text
                            for token in self.tokenizer.encode(char, add_special_tokens=False)]
        output.token_ids.append(self.tokenizer.eos_token_id)
        output.log_probs = [-0.5] * len(output.token_ids)
        return output


async def test_the_next_prompt_carries_the_sampled_tokens_not_a_re_tokenization(tokenizer):
    async with Endpoint(tokenizer) as endpoint:
        endpoint.recorder.client = engine = CharacterEngine(tokenizer)
        await conversation(endpoint.client("s"), QUESTION, turns=2)
        (_, first, _), (_, second, _) = engine.calls[:2]
        replay = await CharacterEngine(tokenizer).generate(GenerateRequest("r", first, engine.calls[0][2]))
        reply_text = tokenizer.decode(replay.token_ids[:-1])
        assert tokenizer.encode(reply_text, add_special_tokens=False) != replay.token_ids[:-1]
        assert second[:len(first) + len(replay.token_ids)] == first + replay.token_ids
        [trajectory] = endpoint.recorder.close("s")
        assert trajectory.responses.tolist()[:len(replay.token_ids)] == replay.token_ids


class FixedTextEngine(ScriptedEngine):
    """Samples one fixed text (its tokens as the tokenizer splits it, then EOS)."""

    def __init__(self, tokenizer, text: str) -> None:
        super().__init__(tokenizer)
        self.text = text

    async def generate(self, request):
        self.calls.append((request.request_id, list(request.prompt_ids), dict(request.sampling)))
        tokens = self.tokenizer.encode(self.text, add_special_tokens=False)
        tokens = tokens[:request.sampling["max_tokens"] - 1] + [self.tokenizer.eos_token_id]
        return TokenOutput(tokens, [-0.5] * len(tokens), "completed", {"global_steps": 1})


async def test_a_stop_string_inside_a_token_keeps_that_token_in_the_text_and_the_trajectory(
        tokenizer):
    """Issue 42: the reply was cut mid-token at the stop string while the recording kept the
    whole token. Now both end on the same token boundary: before the stop string when it begins
    on one (as OpenAI's API), else after the token it begins inside of."""
    text = "The answer is 42, final."
    tokens = tokenizer.encode(text, add_special_tokens=False)
    pieces = [tokenizer.decode(tokens[:k]) for k in range(len(tokens) + 1)]
    inside = "nswer"  # begins inside the token that spells "answer"
    assert not any(piece == text[:text.index(inside)] for piece in pieces)
    async with Endpoint(tokenizer) as endpoint:
        endpoint.recorder.client = FixedTextEngine(tokenizer, text)
        cases = [(inside, pieces[[p.endswith("answer") for p in pieces].index(True)]),
                 (" is", "The answer")]
        for index, (stop, kept_text) in enumerate(cases):
            response = await endpoint.client(f"s{index}").chat.completions.create(
                model="tiny", messages=QUESTION, stop=[stop])
            [choice] = response.choices
            [trajectory] = endpoint.recorder.close(f"s{index}")
            assert choice.message.content == kept_text == tokenizer.decode(trajectory.responses)
            assert choice.finish_reason == "stop"
            assert response.usage.completion_tokens == len(trajectory.responses)


async def test_logprob_bytes_are_each_tokens_raw_bytes_even_inside_a_character(tokenizer):
    text = "héllo — 日本"  # the tiny byte-level tokenizer splits é, — and 日本 into byte tokens
    async with Endpoint(tokenizer) as endpoint:
        endpoint.recorder.client = FixedTextEngine(tokenizer, text)
        response = await endpoint.client("s").chat.completions.create(
            model="tiny", messages=QUESTION, logprobs=True)
        entries = response.choices[0].logprobs.content
        assert any(entry.token == "\ufffd" for entry in entries)  # half characters exist here
        raw = b"".join(bytes(entry.bytes) for entry in entries[:-1])  # the last one is EOS
        assert raw.decode("utf-8") == text == response.choices[0].message.content


async def test_ad_hoc_sessions_are_bounded_by_bytes_oldest_first(tokenizer, caplog):
    import logging

    from tandem.agent.recorder import SessionSettings, session_bytes

    async with Endpoint(tokenizer) as endpoint:
        recorder = endpoint.recorder
        recorder.open("loop-0", SessionSettings(uid="u"))  # the agent loop's: never evicted
        await endpoint.client("probe").chat.completions.create(model="tiny", messages=QUESTION,
                                                               seed=4)
        one = session_bytes(recorder.sessions["probe"])
        recorder.close("probe")
        recorder.max_session_bytes = int(3.5 * one)
        with caplog.at_level(logging.WARNING):
            for name in "abcdef":
                await endpoint.client(name).chat.completions.create(model="tiny",
                                                                    messages=QUESTION, seed=4)
        assert list(recorder.sessions) == ["loop-0", "d", "e", "f"]
        assert recorder.session_bytes == sum(map(session_bytes, recorder.sessions.values()))
        assert recorder.session_bytes <= recorder.max_session_bytes
        assert "evicted the 1 oldest idle session(s) ('a')" in caplog.text
        assert "max_session_bytes=0 MiB" in caplog.text
