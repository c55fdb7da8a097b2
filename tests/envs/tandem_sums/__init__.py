"""A verifiers (0.4, `verifiers.v1`) environment made for tandem's tests, installed by being on
sys.path: sums to compute, a two-turn chat harness that runs in-process (its model calls go
through verifiers' interception to the client the run gives it), and a rubric that gives 1 when
the final reply holds the sum and 0.25 for any reply (so a random model still earns something).
Its id is "tandem-sums"; `count` sets how many tasks it has."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import verifiers.v1 as vf

__all__ = ["ChatHarness", "SumsTaskset"]


class SumData(vf.TaskData):
    answer: int


class SumTask(vf.Task[SumData]):
    @vf.reward
    async def correct(self, task: SumData, trace: vf.Trace) -> float:
        return 1.0 if str(task.answer) in trace.last_reply else 0.25


class SumsConfig(vf.TasksetConfig):
    count: int = 4


class SumsTaskset(vf.Taskset[SumTask, SumsConfig]):
    def load(self) -> Iterator[SumTask]:
        for index in range(self.config.count):
            a, b = 100 + 17 * index, 200 + 31 * index
            yield SumTask(SumData(id=f"sum-{index}", answer=a + b, system_prompt="Use the "
                                  "calculator tool, then give the final number.",
                                  prompt=f"Ann has {a} apples and gets {b} more. How many "
                                         "apples?"), self.config.task)


class ChatHarnessConfig(vf.HarnessConfig):
    id: str = "tandem-sums"


class ChatHarness(vf.Harness[ChatHarnessConfig]):
    """Two turns: the question, then a request for the final number; in-process."""

    APPENDS_SYSTEM_PROMPT = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data,
                     tool_interception_url=None) -> vf.ProgramResult:
        system, prompt = self.resolve_prompt(data)
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": prompt}]
        async with openai.AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0) as client:
            for follow_up in ("Now say only the final number.", None):
                reply = await client.chat.completions.create(model=ctx.model, messages=messages)
                messages.append({"role": "assistant",
                                 "content": reply.choices[0].message.content or ""})
                if follow_up is not None:
                    messages.append({"role": "user", "content": follow_up})
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")
