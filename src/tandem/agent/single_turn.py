"""The single-turn loop: render the prompt once, one generate call, every response token mask 1."""

from __future__ import annotations

from tandem.agent.chat_format import ChatFormat
from tandem.agent.response import ResponseBuilder
from tandem.agent.sampling import check_prompt_length, remaining_budget, sampling_params
from tandem.agent.session import Session, TokenClient
from tandem.batch.trajectory import Trajectory
from tandem.config.schema import RolloutConfig
from tandem.types import GenerateRequest


class SingleTurnLoop:
    """prompt -> one assistant turn -> Trajectory (stop_reason is the engine's)."""

    def __init__(self, client: TokenClient, chat_format: ChatFormat, config: RolloutConfig) -> None:
        self.client = client
        self.chat_format = chat_format
        self.config = config

    async def run(self, session: Session) -> Trajectory:
        """Generate one response for the session's row."""
        row = session.row
        images = self.chat_format.process(row.images) if row.images else None
        prompt = self.chat_format.prompt_ids(row.messages, images=images or ())
        check_prompt_length(len(prompt), self.config, row.uid)
        builder = ResponseBuilder(prompt, expect_log_probs=self.config.calculate_log_probs)
        budget = remaining_budget(self.config, len(prompt), 0)
        params = {**sampling_params(self.config, session.validate, row.do_sample, budget),
                  **session.sampling_seed(0)}
        output = await self.client.generate(
            GenerateRequest(session.request_id, list(prompt), params,
                            multi_modal_data={"image": list(row.images)} if row.images else None))
        builder.add_model_output(output, budget)
        text = self.chat_format.strip_stop_text(self.chat_format.decode(output.token_ids))
        metadata = {"response_text": text, "extra_info": row.extra_info,
                    "messages": [*row.messages, {"role": "assistant", "content": text}],
                    "assistant_turns": 1, "user_turns": 0, "tool_calls": 0, "tool_errors": 0,
                    "validate": session.validate}
        return builder.to_trajectory(row.uid, session.session_id, num_turns=2,
                                     stop_reason=output.stop_reason, data_source=row.data_source,
                                     ground_truth=row.ground_truth, metadata=metadata,
                                     images=images)
