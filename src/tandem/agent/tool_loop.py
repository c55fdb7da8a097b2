"""The tool-calling loop: model turns (mask 1) interleaved with tool turns (mask 0, logprob 0.0;
docs/agent_loops.md). The prompt is rendered once with the tool schemas; each model turn's
tokens are appended as sampled and, if it calls tools, the template's delta for their results.
The engine always gets the prompt + everything appended so far, never re-tokenized. At most
rollout.multi_turn.max_tool_calls_per_turn calls of a turn run (the rest get one error
message), each within rollout.multi_turn.tool_timeout_seconds (a call past it is an error message).
"""

from __future__ import annotations

import asyncio
from typing import Any

from tandem.agent.chat_format import ChatFormat
from tandem.agent.response import ResponseBuilder
from tandem.agent.sampling import check_prompt_length, remaining_budget, sampling_params
from tandem.agent.session import Session, TokenClient
from tandem.agent.tool_parser import ToolCall, parse_tool_calls
from tandem.batch.trajectory import Trajectory
from tandem.config.schema import RolloutConfig
from tandem.multimodal import IMAGE_PAD, join_inputs, pad_runs
from tandem.tools.registry import ToolRegistry, ToolResult
from tandem.types import GenerateRequest
from tandem.user_code import UserCodeTimeout

TRUNCATION_MARKER = "...(truncated)..."


def truncate_tool_text(text: str, limit: int, side: str, chat_format: ChatFormat) -> str:
    """Keep at most `limit` tokens of a tool's output, cutting on the left, right or middle;
    a marker (not counted) shows where text was cut. A long text is measured by windows of
    characters at its kept ends, never tokenized whole (10 MB would hold the loop for seconds)."""
    if side not in ("left", "right", "middle"):
        raise ValueError(f"rollout.multi_turn.tool_response_truncate_side={side!r}: use left, "
                         "right or middle")
    keep_head = {"left": 0, "right": limit, "middle": limit // 2}[side]
    keep_tail = limit - keep_head
    window = 16 * limit + 64  # characters; grows while its tokens are longer than that
    while len(text) > 2 * window:
        head = chat_format.encode_text(text[:window]) if keep_head else []
        tail = chat_format.encode_text(text[-window:]) if keep_tail else []
        # more tokens than kept at each end (a window's cut edge token is never kept)
        if (not keep_head or len(head) > keep_head) and (not keep_tail or len(tail) > keep_tail):
            return _cut(head[:keep_head], tail[len(tail) - keep_tail:], chat_format)
        window *= 4
    ids = chat_format.encode_text(text)
    if len(ids) <= limit:
        return text
    return _cut(ids[:keep_head], ids[len(ids) - keep_tail:], chat_format)


def _cut(head: list[int], tail: list[int], chat_format: ChatFormat) -> str:
    return ((chat_format.decode_text(head) if head else "") + TRUNCATION_MARKER
            + (chat_format.decode_text(tail) if tail else ""))


def tool_message(result: ToolResult, text: str) -> dict[str, Any]:
    """The tool message of a result: its (truncated) text, after its images' parts if any."""
    if not result.images:
        return {"role": "tool", "content": text}
    return {"role": "tool", "content": [{"type": "image"} for _ in result.images]
            + [{"type": "text", "text": text}]}


def _pads(token_ids: list[int], chat_format: ChatFormat) -> list[tuple[int, int]]:
    """The runs of the image token in `token_ids` (tandem.multimodal.pad_runs)."""
    return pad_runs(token_ids, chat_format.tokenizer.convert_tokens_to_ids(IMAGE_PAD))


class ToolAgentLoop:
    """Multi-turn generation with tool calls, bounded by rollout.multi_turn and the budgets."""

    def __init__(self, client: TokenClient, chat_format: ChatFormat, config: RolloutConfig,
                 tools: ToolRegistry) -> None:
        self.client = client
        self.chat_format = chat_format
        self.config = config
        self.tools = tools

    async def _call_tool(self, tools: ToolRegistry, call: ToolCall, tools_kwargs: dict[str, Any]
                         ) -> ToolResult:
        if call.error is not None:
            return ToolResult(f"Error: {call.error}. Call a tool as <tool_call>{{\"name\": ..., "
                              f"\"arguments\": {{...}}}}</tool_call>", ok=False)
        timeout = self.config.multi_turn.tool_timeout_seconds
        try:
            return await tools.call(call.name, call.arguments,
                                         tools_kwargs.get(call.name) or {}, timeout)
        except UserCodeTimeout:
            return ToolResult(f"Error: the {call.name} call ran longer than {timeout:g} s and was "
                              "stopped", ok=False)

    async def _run_tools(self, tools: ToolRegistry, calls: list[ToolCall],
                         tools_kwargs: dict[str, Any]) -> list[ToolResult]:
        """Results of the first max_tool_calls_per_turn calls (run concurrently), then one error
        result for the calls over the cap, which are not run."""
        cap = self.config.multi_turn.max_tool_calls_per_turn
        results = list(await asyncio.gather(*(self._call_tool(tools, c, tools_kwargs)
                                              for c in calls[:cap])))
        if len(calls) > cap:
            results.append(ToolResult(
                f"Error: {len(calls)} tool calls in one turn; only the first {cap} ran "
                f"(rollout.multi_turn.max_tool_calls_per_turn={cap}). Make fewer calls per turn.",
                ok=False))
        return results

    def _shown_images(self, results: list[ToolResult], calls: list[ToolCall],
                      sequence: list[int], images: int) -> tuple[list[ToolResult], Any]:
        """The results whose images the next turn shows, and those images' processed inputs
        (None if none). A result whose images cannot be shown becomes an error result naming
        its tool: an image that cannot be read, a text policy, or a sequence already holding an
        image token the policy wrote (images fill the first runs of image tokens: that token
        would take their place)."""
        if not any(result.images for result in results):
            return results, None
        stray = len(_pads(sequence, self.chat_format)) != images
        shown, processed = [], []
        for index, result in enumerate(results):
            name = calls[index].name if index < len(calls) else "tool"
            if not result.images:
                shown.append(result)
                continue
            try:
                if stray:
                    raise ValueError(f"its {len(result.images)} image(s) cannot follow the image "
                                     f"token ({IMAGE_PAD}) written earlier in this reply")
                processed.append(self.chat_format.process(result.images, f"tool {name}'s result"))
                shown.append(result)
            except ValueError as error:
                shown.append(ToolResult(f"{result.text}\n[Error: {error}; not shown]", ok=False,
                                        done=result.done))
        joined = None
        for inputs in processed:
            joined = join_inputs(joined, inputs)
        return shown, joined

    async def run(self, session: Session, messages: list[dict[str, Any]] | None = None,
                  tools: ToolRegistry | None = None) -> Trajectory:
        """Run the conversation of one session until a stop condition; return its Trajectory.
        messages and tools: this session's own (an environment's episode), else the row's
        messages and the loop's tools."""
        row, config, turns = session.row, self.config, self.config.multi_turn
        tools = self.tools if tools is None else tools
        # an episode's messages start with the row's (an environment's turns follow): its images
        own = messages is None or list(messages[:len(row.messages)]) == list(row.messages)
        images = list(row.images) if own else []
        inputs = self.chat_format.process(images) if images else None
        messages = [dict(message) for message in (row.messages if messages is None else messages)]
        first_reply = len(messages)
        prompt = self.chat_format.prompt_ids(messages, tools.schemas(), images=inputs or ())
        media = {"image": images} if images else None
        check_prompt_length(len(prompt), config, row.uid)
        builder = ResponseBuilder(prompt, expect_log_probs=config.calculate_log_probs)
        assistant_turns = user_turns = tool_calls = tool_errors = 0
        while True:
            budget = remaining_budget(config, len(prompt), len(builder))
            if budget <= 0:
                stop_reason = "length"
                break
            params = {**sampling_params(config, session.validate, row.do_sample, budget),
                      **session.sampling_seed(assistant_turns)}
            output = await self.client.generate(
                GenerateRequest(session.request_id, prompt + builder.token_ids, params,
                                multi_modal_data=media))
            builder.add_model_output(output, budget)
            assistant_turns += 1
            text = self.chat_format.strip_stop_text(self.chat_format.decode(output.token_ids))
            messages.append({"role": "assistant", "content": text})
            _, calls = parse_tool_calls(text)
            if output.stop_reason in ("aborted", "length"):
                stop_reason = output.stop_reason  # nothing may follow a cut-off turn
                break
            if not calls:
                stop_reason = "completed"
                break
            if assistant_turns >= turns.max_assistant_turns:
                stop_reason = "max_assistant_turns"
                break
            if user_turns >= turns.max_user_turns:
                stop_reason = "max_user_turns"
                break
            results = await self._run_tools(tools, calls, row.tools_kwargs)
            tool_calls += len(calls)
            done = any(result.done for result in results[:turns.max_tool_calls_per_turn])
            added = None
            if not done:  # images the next turn shows; nothing follows a finished episode
                results, added = self._shown_images(results, calls, prompt + builder.token_ids,
                                                    len(images))
            shown = [image for result in results for image in result.images]
            ran = results[:turns.max_tool_calls_per_turn]  # the cap's message is not a call
            tool_errors += sum(not result.ok for result in ran) + len(calls) - len(ran)
            tool_messages = [tool_message(result, truncate_tool_text(
                result.text, turns.max_tool_response_length, turns.tool_response_truncate_side,
                self.chat_format)) for result in results]
            messages.extend(tool_messages)
            user_turns += 1
            if done:  # the episode is over: nothing to sample
                stop_reason = "completed"
                break
            stop_ids = self.chat_format.stop_token_ids
            ended = bool(output.token_ids) and output.token_ids[-1] in stop_ids
            with_images = {"images": added} if added is not None else {}
            delta = self.chat_format.tool_turn_ids(tool_messages, after_stop_token=ended,
                                                   **with_images)
            room = config.response_length - len(builder)
            kept = delta[:room]
            runs = _pads(delta, self.chat_format) if added is not None else []
            if runs and room < runs[-1][0] + runs[-1][1]:  # a cut run would not match its image
                kept, added = delta[:runs[0][0]][:room], None
            builder.add_context_tokens(kept)
            if added is not None:  # the next requests and the trajectory carry them too
                images = images + shown  # a new list: requests sent so far keep their own
                inputs = join_inputs(inputs, added)
                media = {"image": images}
            if len(delta) >= room:
                stop_reason = "length"
                break
        replies = [m["content"] for m in messages[first_reply:] if m["role"] == "assistant"]
        metadata = {"response_text": replies[-1],
                    "messages": messages, "extra_info": row.extra_info,
                    "assistant_turns": assistant_turns, "user_turns": user_turns,
                    "tool_calls": tool_calls, "tool_errors": tool_errors,
                    "validate": session.validate}
        return builder.to_trajectory(row.uid, session.session_id,
                                     num_turns=1 + assistant_turns + user_turns,
                                     stop_reason=stop_reason, data_source=row.data_source,
                                     ground_truth=row.ground_truth, metadata=metadata,
                                     images=inputs)
