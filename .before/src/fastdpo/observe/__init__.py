"""Watching a run: step metrics and MFU, alerts, sinks (JSONL, TensorBoard, W&B), the dashboard plot, profiling, memory
traces, environment facts, OOM advice."""
