"""Dataset rows -> n agent-loop sessions -> Trajectory records (single-turn and tool-calling).

Names are imported on first use, so `tandem.agent.dataset` (read by the CLI's checks before
anything starts) does not pull torch in through the loops.
"""

from __future__ import annotations

import importlib
from typing import Any

_MODULES = {
    "ChatFormat": "chat_format", "DatasetRow": "dataset", "PromptDataset": "dataset",
    "read_records": "dataset", "row_from_record": "dataset", "AgentLoopRunner": "runner", "AllSessionsFailed": "runner",
    "RewardFn": "runner", "SessionFailure": "runner", "remaining_budget": "sampling",
    "sampling_params": "sampling", "Session": "session", "TokenClient": "session",
    "SingleTurnLoop": "single_turn", "ToolAgentLoop": "tool_loop",
    "truncate_tool_text": "tool_loop", "ToolCall": "tool_parser", "parse_tool_calls": "tool_parser",
}

__all__ = sorted(_MODULES)


def __getattr__(name: str) -> Any:
    if name not in _MODULES:
        raise AttributeError(f"module 'tandem.agent' has no attribute {name!r}")
    return getattr(importlib.import_module(f"tandem.agent.{_MODULES[name]}"), name)
