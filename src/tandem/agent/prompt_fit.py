"""Dataset rows whose prompt, rendered as the agent loop renders it (chat template and tool
schemas, tokenizer only), is longer than rollout.prompt_length: found before Ray starts
(preflight) and, with data.filter_overlong_prompts, dropped from the run's datasets."""

from __future__ import annotations

from tandem.agent.chat_format import ChatFormat
from tandem.agent.dataset import PromptDataset
from tandem.config.schema import RolloutConfig
from tandem.multimodal import image_processor_of
from tandem.tools.registry import ToolRegistry, tool_class, tool_schema


def loop_tool_schemas(config: RolloutConfig, tools: ToolRegistry | None) -> list[dict] | None:
    """The tool schemas the configured loop renders its first prompt with ([] for the
    single-turn loop); None for the OpenAI-agent loop and environments, which render their own."""
    if config.openai_agent.enable or config.environment.kind:  # the environment renders its own
        return None
    if not config.multi_turn.enable:
        return []
    if tools is not None:
        return tools.schemas()
    return [tool_schema(tool_class(entry)) for entry in config.multi_turn.tools]


def overlong_rows(dataset: PromptDataset, chat_format: ChatFormat, schemas: list[dict],
                  limit: int) -> list[tuple[int, int]]:
    """(position, rendered length) of every row whose prompt exceeds `limit` tokens."""
    found = []
    for position, row in enumerate(dataset.rows):
        length = len(chat_format.prompt_ids(row.messages, schemas or None, images=row.images))
        if length > limit:
            found.append((position, length))
    return found


def describe(dataset: PromptDataset, found: list[tuple[int, int]], split: str, limit: int) -> str:
    """One line naming how many rows are too long and the first of them."""
    position, length = found[0]
    return (f"{len(found)} of the {len(dataset)} rows of data.{split}_files render longer than "
            f"rollout.prompt_length={limit} (chat template and tool schemas), the first "
            f"({dataset.origins[position]}) at {length} tokens")


def tokenizer_chat_format(model_path: str) -> ChatFormat:
    """The chat format of a model's tokenizer (imports transformers)."""
    from transformers import AutoTokenizer

    return ChatFormat(AutoTokenizer.from_pretrained(model_path),
                      image_processor=image_processor_of(model_path))


def drop_overlong(dataset: PromptDataset, chat_format: ChatFormat, schemas: list[dict] | None,
                  limit: int) -> list[tuple[int, int]]:
    """Remove the rows longer than `limit` from `dataset`; returns what was removed."""
    if schemas is None:
        return []
    found = overlong_rows(dataset, chat_format, schemas, limit)
    dataset.drop([position for position, _ in found])
    return found
