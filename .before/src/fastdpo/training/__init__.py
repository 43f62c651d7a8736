"""Training: the setup, `Trainer.step` (the one optimizer step), the loop, checkpoints and resume, evaluation during
training, the monitor, signals, and the timing of steps for bench/tune/auto."""
