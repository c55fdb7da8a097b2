"""Training engine over HF models: packed/padded forwards, log-probs, actor, reference, critic,
optimizer, FSDP2, checkpoints and weight export. See docs/training.md."""
