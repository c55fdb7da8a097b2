"""A multi-turn tool conversation through the real client and the native engine.

A random tiny model never emits a tool call, so the test rewires one (still an ordinary HF
Qwen2 directory): attention and MLP outputs are zeroed, so each next token depends only on the
current one, and the untied lm_head maps "\\n" -> <tool_call>{"name": "now"}</tool_call><|im_end|>
with probability ~0.97 per token. Every turn is then a real, engine-sampled tool call, and
the test checks masks, logprob counts and logprob values against a plain HF forward pass.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("tandem.rollout.native", reason="the native engine (tandem.rollout.native) "
                    "is not in this checkout yet")

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from tandem.agent import AgentLoopRunner, DatasetRow  # noqa: E402
from tandem.config.schema import MultiTurnConfig, RolloutConfig  # noqa: E402
from tandem.models.tiny import TinyModelSpec, build_tiny_model  # noqa: E402
from tandem.serving.manager import ServerManager  # noqa: E402
from tandem.serving.replica import ServerOptions  # noqa: E402
from tandem.serving.server import RolloutServer  # noqa: E402
from tandem.tools.registry import ToolRegistry, ToolResult  # noqa: E402

from float_bounds import assert_within, token_logprob_bounds  # noqa: E402

CALL = '<tool_call>{"name": "now"}</tool_call>'


class NowTool:
    name, description = "now", "the current time"
    parameters = {"type": "object", "properties": {}}

    async def execute(self, arguments, context):
        return ToolResult("12:00")


def rewire(source, target, tokenizer) -> None:
    """Save a copy of the model whose greedy continuation of "\\n" is CALL + eos."""
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    chain = [tokenizer.encode("\n", add_special_tokens=False)[-1]]
    chain += tokenizer.encode(CALL, add_special_tokens=False) + [tokenizer.eos_token_id]
    assert len(set(chain)) == len(chain), "the chain needs distinct tokens"
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        embeddings = model.model.embed_tokens.weight
        unit = embeddings / embeddings.norm(dim=-1, keepdim=True)
        # h = rmsnorm(E[t]) = sqrt(H) * unit[t]; logit(next) = scale * sqrt(H) = 10.
        scale = 10.0 / embeddings.shape[1] ** 0.5
        lm_head = torch.zeros_like(model.lm_head.weight)
        for current, following in zip(chain, chain[1:]):
            lm_head[following] += scale * unit[current]
        model.lm_head.weight.copy_(lm_head)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    source = build_tiny_model(TinyModelSpec(tie_word_embeddings=False))
    target = tmp_path_factory.mktemp("rewired")
    rewire(source, target, AutoTokenizer.from_pretrained(source))
    return target


async def test_tool_conversation_through_client_and_native_engine(model_dir):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = RolloutConfig(prompt_length=256, response_length=120, n=2,
                           kv_cache_memory_bytes=32 << 20,
                           multi_turn=MultiTurnConfig(enable=True, max_assistant_turns=3))
    manager = await ServerManager.create(config, ServerOptions(model_path=str(model_dir)),
                                         "hybrid", hosts=[RolloutServer("host-0")])
    try:
        runner = AgentLoopRunner.from_tokenizer(manager.client(), tokenizer, config,
                                                tools=ToolRegistry([NowTool()]))
        row = DatasetRow(messages=[{"role": "user", "content": "What time is it?"}], uid="p0",
                         do_sample=False)
        trajectories = await runner.run([row])
    finally:
        await manager.shutdown()

    call_ids = tokenizer.encode(CALL, add_special_tokens=False) + [tokenizer.eos_token_id]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert [t.session_id for t in trajectories] == [0, 1]
    for trajectory in trajectories:
        assert trajectory.stop_reason == "max_assistant_turns" and trajectory.num_turns == 6
        messages = trajectory.metadata["messages"]
        assert [m["content"] for m in messages[1:]] == [CALL, "12:00", CALL, "12:00", CALL]
        responses = trajectory.responses.tolist()
        mask = trajectory.response_mask.tolist()
        log_probs = trajectory.rollout_log_probs
        assert len(responses) == len(mask) == len(log_probs)
        # three model turns of the engine's tokens (mask 1), two tool turns between (mask 0)
        assert [t for t, m in zip(responses, mask) if m] == call_ids * 3
        assert sum(mask) == 3 * len(call_ids)
        tool_turn = tokenizer.decode([t for t, m in zip(responses, mask) if not m])
        assert tool_turn == ("\n<|im_start|>user\n<tool_response>12:00</tool_response><|im_end|>\n"
                             "<|im_start|>assistant\n") * 2
        masked = torch.tensor(mask, dtype=torch.bool)
        assert torch.all(log_probs[~masked] == 0.0) and torch.all(log_probs[masked] < 0.0)
        # the engine's logprobs are the model's own at every sampled position: the exact
        # (float64) ones within the float32 forward's error bound (tests/float_bounds.py)
        expected, bound = token_logprob_bounds(model, trajectory.prompts.tolist(), responses)
        assert_within(log_probs[masked], expected[masked], bound[masked], "rollout_log_probs")
