"""Token-exact recording of OpenAI-style chat sessions (the endpoint's side of `openai_agent`;
docs/agent_loops.md, "Bring your own agent"). A call *extends* a branch when its messages are
that branch's conversation, the reply we returned, then only new tool/user messages, and the
chat template renders that history as before: the new prompt is the branch's tokens + the
template's delta, as the tool loop appends it. A call that continues a branch's conversation but
whose rendered prompt does not extend its tokens (the template or the harness re-rendered the
history, e.g. stripped earlier `<think>` blocks) *splits*: a new sample starts from the rendered
prompt and the old one ends where it was (`splits` counts it; the samples share the session's
reward). Any other call *forks* a new branch (`forks` counts it). Every branch becomes one
Trajectory; nothing is decoded and encoded again.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any, Sequence

from tandem.agent.chat_format import ChatFormat
from tandem.agent.response import ResponseBuilder
from tandem.agent.sampling import remaining_budget, sampling_params
from tandem.agent.session import TokenClient
from tandem.agent.tool_parser import parse_tool_calls
from tandem.batch.trajectory import Trajectory
from tandem.config.schema import RolloutConfig
from tandem.types import KEPT_MASS_FIELDS, GenerateRequest, TokenOutput, cut_version_runs

logger = logging.getLogger(__name__)
# a recorded token in Python lists (id, mask, logprob, version), rounded up: measured ~57 B
TOKEN_BYTES = 64


class RequestError(Exception):
    """A bad request, answered as an OpenAI error object with this HTTP status."""

    def __init__(self, status: int, message: str, code: str | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param


def message_text(content: Any) -> str:
    """OpenAI content (a string, None, or a list of {"type": "text", "text": ...} parts) -> text."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(part, dict) and part.get("type") == "text"
                                         for part in content):
        return "".join(str(part.get("text", "")) for part in content)
    raise RequestError(400, "message content must be a string or a list of text parts; images "
                       "and audio are not supported", param="messages")


def _arguments(raw: Any) -> dict[str, Any]:
    if isinstance(raw, dict):
        return raw
    try:
        value = json.loads(raw or "{}")
    except (TypeError, json.JSONDecodeError):
        value = None
    if not isinstance(value, dict):
        raise RequestError(400, f"tool_calls[].function.arguments must be a JSON object string, "
                           f"got {raw!r}", param="messages")
    return value


def normalize(message: dict[str, Any]) -> dict[str, Any]:
    """The chat-template form of one OpenAI message: role, text content, parsed tool calls."""
    role = message.get("role")
    if role not in ("system", "developer", "user", "assistant", "tool"):
        raise RequestError(400, f"message role {role!r} is not one of system, developer, user, "
                           "assistant, tool", param="messages")
    result: dict[str, Any] = {"role": "system" if role == "developer" else role,
                              "content": message_text(message.get("content")).strip()
                              if role == "assistant" else message_text(message.get("content"))}
    if role == "assistant" and message.get("tool_calls"):
        result["tool_calls"] = [_tool_call(call) for call in message["tool_calls"]]
    return result


def _tool_call(call: Any) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise RequestError(400, "every tool_calls[] entry needs a function with a string name, "
                           f"got {call!r}", param="messages")
    return {"type": "function", "function": {"name": function["name"],
                                             "arguments": _arguments(function.get("arguments"))}}


@dataclass
class Branch:
    """One token-exact conversation of a session: the rendered prompt and everything after it."""

    messages: list[dict[str, Any]]  # normalized, ending with the last assistant reply
    tools: list[dict] | None
    builder: ResponseBuilder
    ended_with_stop_token: bool = False
    stop_reason: str = "completed"
    assistant_turns: int = 0
    user_turns: int = 0
    tool_calls: int = 0
    response_text: str = ""
    split_from: int | None = None  # the index of the branch whose conversation this one continues


@dataclass
class Completion:
    """One sampled choice of a call: the reply, the engine's tokens and the call's prompt size."""

    text: str
    content: str | None
    tool_calls: list[dict[str, Any]]
    finish_reason: str
    token_ids: list[int]
    log_probs: list[float]
    prompt_tokens: int


@dataclass
class SessionSettings:
    """What the openai_agent loop registers for a session; ad-hoc sessions use the defaults."""

    uid: str = ""
    session_id: int = 0
    seed: int | None = None  # turn t of the session samples with seed + t unless the call sets one
    validate: bool = False
    do_sample: bool | None = None
    data_source: str = ""
    ground_truth: Any = None
    extra_info: dict[str, Any] = field(default_factory=dict)


class SessionRecorder:
    """The branches of one session; calls are serialized so they append in order."""

    def __init__(self, key: str, settings: SessionSettings, registered: bool) -> None:
        self.key = key
        self.settings = settings
        self.registered = registered  # opened by the openai_agent loop: never evicted
        self.branches: list[Branch] = []
        self.forks = 0
        self.splits = 0
        self.lock = asyncio.Lock()
        self.active = 0  # calls in progress (a session no call succeeded in is dropped)
        self.nbytes = 0  # estimate of what it holds (session_bytes), as of its last call

    def find_branch(self, messages: list[dict[str, Any]], tools: list[dict] | None
                    ) -> Branch | None:
        """The latest branch this call extends, or None (the call forks)."""
        for branch in reversed(self.branches):
            known = branch.messages
            new = messages[len(known):]
            if (branch.tools == tools and messages[:len(known)] == known and new
                    and all(m["role"] in ("tool", "user") for m in new)):
                return branch
        return None

    def find_rewritten(self, messages: list[dict[str, Any]], tools: list[dict] | None
                       ) -> Branch | None:
        """The latest branch whose conversation this call continues with earlier assistant
        replies rewritten by the caller (their text changed, their tool calls not), or None."""
        for branch in reversed(self.branches):
            known = branch.messages
            new = messages[len(known):]
            if (branch.tools == tools and new and all(m["role"] in ("tool", "user") for m in new)
                    and all(_same_but_reply_text(m, k) for m, k in zip(messages, known))):
                return branch
        return None

    def trajectories(self) -> list[Trajectory]:
        """One Trajectory per branch that sampled at least once, in creation order. A branch a
        split continued names its continuation in metadata["continued_by"] (a "sample_id")."""
        settings = self.settings
        continued_by = {branch.split_from: index for index, branch in enumerate(self.branches)
                        if branch.split_from is not None
                        and self.branches[index].builder.min_version is not None}
        result = []
        for index, branch in enumerate(self.branches):
            if branch.builder.min_version is None:
                continue
            following = continued_by.get(index)
            metadata = {"response_text": branch.response_text, "messages": branch.messages,
                        "extra_info": settings.extra_info,
                        "assistant_turns": branch.assistant_turns,
                        "user_turns": branch.user_turns, "tool_calls": branch.tool_calls,
                        "tool_errors": 0, "validate": settings.validate, "forks": self.forks,
                        "splits": self.splits, "sample_id": f"{self.key}/{index}",
                        "continued_by": None if following is None else f"{self.key}/{following}"}
            result.append(branch.builder.to_trajectory(
                settings.uid or self.key, settings.session_id,
                num_turns=1 + branch.assistant_turns + branch.user_turns,
                stop_reason=branch.stop_reason, data_source=settings.data_source,
                ground_truth=settings.ground_truth, metadata=metadata))
        return result


def _same_but_reply_text(message: dict[str, Any], known: dict[str, Any]) -> bool:
    if message == known:
        return True
    return (message["role"] == known["role"] == "assistant"
            and message.get("tool_calls") == known.get("tool_calls"))


def session_bytes(session: SessionRecorder) -> int:
    """An estimate of the memory a session's recording holds: TOKEN_BYTES per token of every
    branch, plus the JSON size of its messages and tools."""
    return sum(TOKEN_BYTES * (len(branch.builder.prompt_ids) + len(branch.builder))
               + len(json.dumps(branch.messages, default=str))
               + len(json.dumps(branch.tools, default=str)) for branch in session.branches)


def cut_at_stop_strings(output: TokenOutput, stops: Sequence[str], chat_format: ChatFormat
                        ) -> tuple[TokenOutput, bool]:
    """Cut the sampled tokens where the first stop string begins, on a token boundary: the
    tokens before it, plus the token it begins inside of, kept whole, when it does not begin on
    a boundary. The caller's text is these tokens' text, so what it sees and what is recorded
    agree; the tokens after the cut are dropped, never re-tokenized. True when one was found."""
    text = chat_format.decode(output.token_ids)
    starts = [text.find(stop) for stop in stops if stop in text]
    if not starts:
        return output, False
    before = text[:min(starts)]
    low, high = 0, len(output.token_ids)
    while low < high:  # the fewest tokens whose text holds everything before the stop string
        middle = (low + high) // 2
        if chat_format.decode(output.token_ids[:middle]).startswith(before):
            high = middle
        else:
            low = middle + 1
    log_probs = None if output.log_probs is None else output.log_probs[:low]
    extra = {key: value for key, value in output.extra_fields.items()
             if key not in KEPT_MASS_FIELDS}  # sums over tokens cut here: not known any more
    extra["version_runs"] = cut_version_runs(output.version_runs, low)
    kept_sets = None if output.kept_sets is None else output.kept_sets.head(low)
    return TokenOutput(output.token_ids[:low], log_probs, "completed", extra, kept_sets), True


class ChatRecorder:
    """Serves chat calls through a TokenClient and records every session's branches. Ad-hoc
    sessions (tandem serve) are bounded by count and by bytes: past max_sessions, or past
    max_session_bytes of recordings (session_bytes), the oldest idle ones are evicted, logged;
    sessions the openai_agent loop opened stay until it closes them."""

    def __init__(self, client: TokenClient, chat_format: ChatFormat, config: RolloutConfig,
                 max_sessions: int = 10_000, max_session_bytes: int = 1 << 30) -> None:
        self.client = client
        self.chat_format = chat_format
        self.config = config
        self.max_sessions = max_sessions
        self.max_session_bytes = max_session_bytes
        self.sessions: dict[str, SessionRecorder] = {}
        self.session_bytes = 0  # the sum of every session's nbytes
        self.forks = 0  # forked calls over all sessions (a metric)
        self.splits = 0  # split calls over all sessions (a metric)

    def open(self, key: str, settings: SessionSettings) -> SessionRecorder:
        """Register a session before its agent runs (its trajectories are collected by close)."""
        if key in self.sessions:
            raise ValueError(f"session {key!r} is already open; session ids must be unique")
        self.sessions[key] = SessionRecorder(key, settings, registered=True)
        return self.sessions[key]

    def close(self, key: str) -> list[Trajectory]:
        """Forget a session and return its trajectories."""
        session = self._forget(key)
        return session.trajectories()

    def _forget(self, key: str) -> SessionRecorder:
        session = self.sessions.pop(key)
        self.session_bytes -= session.nbytes
        return session

    def _enter(self, key: str) -> SessionRecorder:
        """The session of a call, created if new (kept only if the call succeeds, see _leave)."""
        session = self.sessions.get(key)
        if session is None:  # an ad-hoc caller (tandem serve): room for one more
            self._evict(keep=None, sessions=self.max_sessions - 1, nbytes=self.max_session_bytes)
            session = SessionRecorder(key, SessionSettings(uid=key), registered=False)
            self.sessions[key] = session
        session.active += 1
        return session

    def _leave(self, session: SessionRecorder) -> None:
        session.active -= 1
        if (not session.registered and not session.branches and not session.active
                and self.sessions.get(session.key) is session):
            self._forget(session.key)  # no call of it succeeded: it never existed

    def _recorded(self, session: SessionRecorder) -> None:
        """Account a call's growth; past max_session_bytes the oldest idle sessions go."""
        nbytes = session_bytes(session)
        self.session_bytes += nbytes - session.nbytes
        session.nbytes = nbytes
        self._evict(keep=session, sessions=self.max_sessions, nbytes=self.max_session_bytes)

    def _evict(self, keep: SessionRecorder | None, sessions: int, nbytes: int) -> None:
        """Drop the oldest idle ad-hoc sessions (not `keep`) until at most `sessions` ad-hoc
        ones remain and all of them hold at most `nbytes`."""
        idle = [s for s in self.sessions.values()
                if not s.registered and not s.active and s is not keep]
        count = sum(not s.registered for s in self.sessions.values())
        evicted = []
        for old in idle:
            if count <= sessions and self.session_bytes <= nbytes:
                break
            evicted.append(self._forget(old.key))
            count -= 1
        if evicted:
            logger.warning("endpoint: evicted the %d oldest idle session(s) (%s), their recordings "
                           "gone, to stay within max_sessions=%d and max_session_bytes=%d MiB (%d "
                           "MiB recorded now)", len(evicted),
                           ", ".join(repr(s.key) for s in evicted[:3])
                           + (", ..." if len(evicted) > 3 else ""), self.max_sessions,
                           self.max_session_bytes >> 20, self.session_bytes >> 20)

    def _prompt(self, messages: list[dict[str, Any]], tools: list[dict] | None,
                split: bool = False) -> list[int]:
        """The rendered prompt of a new branch; RequestError when it cannot be rendered or is
        longer than rollout.prompt_length (a split's, which holds the conversation so far:
        longer than prompt_length + response_length, the context of one sample)."""
        try:
            prompt = self.chat_format.prompt_ids(messages, tools)
        except Exception as error:  # the template met input it cannot render
            raise RequestError(400, f"the chat template cannot render these messages: "
                               f"{type(error).__name__}: {error}", param="messages") from None
        config = self.config
        limit = config.prompt_length + (config.response_length if split else 0)
        if len(prompt) > limit:
            field = (f"rollout.prompt_length + rollout.response_length={limit} (the context of a "
                     "split sample)" if split else f"rollout.prompt_length={limit}")
            raise RequestError(400, f"the messages render to {len(prompt)} tokens, more than the "
                               f"prompt limit {field}",
                               code="context_length_exceeded", param="messages")
        return prompt

    def _delta(self, branch: Branch, messages: list[dict[str, Any]],
               tools: list[dict] | None) -> list[int] | None:
        """The template's tokens for the messages a call adds to a branch, or None when the
        rendered prompt would not extend the branch's tokens (the call splits)."""
        try:
            return self.chat_format.continuation_ids(branch.messages, messages, tools,
                                                     after_stop_token=branch.ended_with_stop_token)
        except Exception as error:
            raise RequestError(400, f"the chat template cannot render the new messages: "
                               f"{type(error).__name__}: {error}", param="messages") from None

    def _extend(self, branch: Branch, messages: list[dict[str, Any]], delta: list[int]) -> list[int]:
        builder = branch.builder
        if branch.stop_reason == "length":
            raise RequestError(400, "this session has used its whole token budget "
                               f"(rollout.response_length={self.config.response_length})",
                               code="context_length_exceeded", param="messages")
        room = self.config.response_length - len(builder)
        builder.add_context_tokens(delta[:room])
        branch.messages = list(messages)
        branch.user_turns += 1
        if len(delta) >= room:
            branch.stop_reason = "length"
            raise RequestError(400, f"the new messages do not fit in the session's token budget "
                               f"(rollout.response_length={self.config.response_length})",
                               code="context_length_exceeded", param="messages")
        return builder.prompt_ids + builder.token_ids

    def _params(self, settings: SessionSettings, turn: int, choice: int, budget: int,
                request: dict[str, Any]) -> dict[str, Any]:
        params = sampling_params(self.config, settings.validate, settings.do_sample, budget)
        for name in ("temperature", "top_p"):
            if request.get(name) is not None:
                params[name] = float(request[name])
        seed = request.get("seed")
        if seed is None and settings.seed is not None:
            seed = settings.seed + turn
        if seed is not None:
            params["seed"] = (int(seed) + choice * 100_003) % (1 << 31)
        return params

    async def complete(self, key: str, messages: list[dict[str, Any]], tools: list[dict] | None,
                       request: dict[str, Any]) -> list[Completion]:
        """Run one chat call of session `key` (request: n, max_tokens, temperature, top_p, seed,
        stop): n choices, each recorded on its branch. Rendering runs in a thread; the session
        changes only once the call has its replies (a failed or cancelled call leaves it as it was),
        except that messages overflowing the token budget are recorded as the branch's end."""
        normalized = [normalize(message) for message in messages]
        if not normalized:
            raise RequestError(400, "messages must not be empty", param="messages")
        session = self._enter(key)
        try:
            async with session.lock:
                return await self._complete(session, normalized, tools, request)
        finally:
            self._leave(session)

    async def _complete(self, session: SessionRecorder, normalized: list[dict[str, Any]],
                        tools: list[dict] | None, request: dict[str, Any]) -> list[Completion]:
        extended = session.find_branch(normalized, tools)
        split_from = None
        if extended is not None:
            delta = await asyncio.to_thread(self._delta, extended, normalized, tools)
            if delta is None:  # the template re-renders this history
                split_from, extended = extended, None
        else:
            split_from = session.find_rewritten(normalized, tools)  # the caller re-rendered it
        if extended is None:
            prompt = await asyncio.to_thread(self._prompt, normalized, tools, split_from is not None)
            branch = Branch(messages=list(normalized), tools=tools,
                            builder=ResponseBuilder(prompt, self.config.calculate_log_probs),
                            split_from=None if split_from is None
                            else session.branches.index(split_from))
        else:
            branch = copy.deepcopy(extended)
            try:
                prompt = self._extend(branch, normalized, delta)
            except RequestError:
                if branch.stop_reason == "length":  # the cut tool turn ends the trajectory
                    session.branches[session.branches.index(extended)] = branch
                    self._recorded(session)
                raise
        builder = branch.builder
        budget = remaining_budget(self.config, len(builder.prompt_ids), len(builder))
        if budget <= 0:
            raise RequestError(400, "this session has used its whole token budget "
                               f"(rollout.response_length={self.config.response_length})",
                               code="context_length_exceeded", param="messages")
        if request.get("max_tokens") is not None:
            budget = min(budget, int(request["max_tokens"]))
        n = int(request.get("n") or 1)
        branches = [branch] + [copy.deepcopy(branch) for _ in range(n - 1)]
        outputs = await asyncio.gather(*(self.client.generate(GenerateRequest(
            session.key, list(prompt), self._params(session.settings, branch.assistant_turns, i,
                                                    budget, request))) for i in range(n)))
        stops = request.get("stop") or []
        completions = await asyncio.to_thread(lambda: [
            self._record(b, output, budget, stops, len(prompt))
            for b, output in zip(branches, outputs)])
        if split_from is not None:
            session.splits += 1
            self.splits += 1
            session.branches.append(branch)
        elif extended is None:
            if session.branches:
                session.forks += 1
                self.forks += 1
            session.branches.append(branch)
        else:
            session.branches[session.branches.index(extended)] = branch
        session.branches.extend(branches[1:])
        self._recorded(session)
        return completions

    def _record(self, branch: Branch, output: TokenOutput, budget: int, stops: list[str],
                prompt_tokens: int) -> Completion:
        output, _ = cut_at_stop_strings(output, stops, self.chat_format)
        branch.builder.add_model_output(output, budget)
        branch.assistant_turns += 1
        text = self.chat_format.strip_stop_text(self.chat_format.decode(output.token_ids))
        branch.response_text = text
        branch.ended_with_stop_token = (bool(output.token_ids)
                                        and output.token_ids[-1] in self.chat_format.stop_token_ids)
        content, calls = parse_tool_calls(text)
        if any(call.error is not None for call in calls):
            content, calls = text, []  # a malformed call reaches the caller as plain text
        tool_calls = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                       "function": {"name": call.name, "arguments": json.dumps(call.arguments)}}
                      for call in calls]
        reply = normalize({"role": "assistant", "content": content, "tool_calls": tool_calls})
        branch.messages = [*branch.messages, reply]
        branch.tool_calls += len(calls)
        branch.stop_reason = output.stop_reason
        finish = ("length" if output.stop_reason != "completed"
                  else "tool_calls" if calls else "stop")
        log_probs = list(output.log_probs) if output.log_probs is not None else (
            [0.0] * len(output.token_ids))
        return Completion(text, content or (None if calls else ""), tool_calls, finish,
                          list(output.token_ids), log_probs, prompt_tokens)
