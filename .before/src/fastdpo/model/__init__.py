"""Models: loading (HF dirs, hub ids, QLoRA), LoRA, the packed attention backends, micro-batch building, completion
log-probs, checkpointing policies, generation."""
