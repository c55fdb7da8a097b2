"""Bring your own job from Python: your reward (verl's signature), your tool, your JSONL data."""

import tandem
from my_reward import compute_score
from my_tools import Arithmetic

config = tandem.load_config({
    "model": {"path": "tiny:calculator"},  # or a hub id ("Qwen/Qwen2.5-0.5B-Instruct") or a directory
    "rollout": {"n": 4, "prompt_length": 256, "response_length": 48,
                "kv_cache_memory_bytes": 64 << 20,
                "multi_turn": {"enable": True, "max_assistant_turns": 2, "max_user_turns": 1}},
    "actor": {"ppo_mini_batch_size": 2, "optim": {"lr": 1e-4}},
    "data": {"train_files": ["data/train.jsonl"], "val_files": ["data/val.jsonl"],
             "train_batch_size": 2},
    "trainer": {"total_steps": 2, "output_dir": "runs/python"},
})
trainer = tandem.Trainer(config, reward_fn=compute_score, tools=[Arithmetic()])
print("validation", trainer.fit())
print("tool calls", Arithmetic.calls, "model", trainer.model_dir)  # an HF model directory
