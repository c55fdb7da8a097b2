"""Dataset rows -> n agent-loop sessions -> Trajectory records (single-turn and tool-calling)."""

from tandem.agent.chat_format import ChatFormat
from tandem.agent.dataset import DatasetRow, PromptDataset, read_records, row_from_record
from tandem.agent.runner import AgentLoopRunner, RewardFn
from tandem.agent.sampling import remaining_budget, sampling_params
from tandem.agent.session import Session, TokenClient
from tandem.agent.single_turn import SingleTurnLoop
from tandem.agent.tool_loop import ToolAgentLoop, truncate_tool_text
from tandem.agent.tool_parser import ToolCall, parse_tool_calls

__all__ = ["AgentLoopRunner", "ChatFormat", "DatasetRow", "PromptDataset", "RewardFn", "Session",
           "SingleTurnLoop", "TokenClient", "ToolAgentLoop", "ToolCall", "parse_tool_calls",
           "read_records", "remaining_budget", "row_from_record", "sampling_params",
           "truncate_tool_text"]
