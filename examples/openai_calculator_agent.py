"""The calculator task's agent, written with the official `openai` package (rollout.openai_agent).

    rollout.openai_agent.enable=true
    rollout.openai_agent.agent=examples.openai_calculator_agent:run   # with the repo root on PYTHONPATH

It behaves like tandem's built-in tool loop with rollout.multi_turn defaults: up to
MAX_ASSISTANT_TURNS model turns, each tool call answered by tandem's calculator (the same tool
text the built-in loop would render), stopping at a turn without tool calls. It returns None,
so the configured reward function scores the final answer.
"""

from __future__ import annotations

import json

import openai

from tandem.tools.calculator import CalculatorTool
from tandem.tools.registry import ToolRegistry, tool_schema

MAX_ASSISTANT_TURNS = 4
TOOLS = ToolRegistry([CalculatorTool()])
CALCULATOR = [tool_schema(CalculatorTool())]


async def run(client: openai.AsyncOpenAI, row, max_assistant_turns: int = MAX_ASSISTANT_TURNS
              ) -> None:
    """Solve one arithmetic row: chat, call the calculator when asked, until a plain answer."""
    messages = [dict(message) for message in row.messages]
    model = (await client.models.list()).data[0].id
    for turn in range(max_assistant_turns):
        try:
            response = await client.chat.completions.create(model=model, messages=messages,
                                                             tools=CALCULATOR)
        except openai.BadRequestError as error:
            if error.code == "context_length_exceeded":
                return None  # the session's token budget is spent, as the built-in loop stops
            raise
        choice = response.choices[0]
        messages.append(choice.message.model_dump(exclude_none=True))
        if choice.finish_reason != "tool_calls" or turn == max_assistant_turns - 1:
            return None
        for call in choice.message.tool_calls:
            result = await TOOLS.call(call.function.name, json.loads(call.function.arguments), {})
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result.text})
    return None


async def run_demo(client: openai.AsyncOpenAI, row) -> None:
    """The agent with the demo's limit (src/tandem/demo/demo.yaml: two model turns)."""
    return await run(client, row, max_assistant_turns=2)
