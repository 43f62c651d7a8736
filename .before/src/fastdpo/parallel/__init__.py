"""Several processes: the process group, DDP/FSDP2 wrapping, collectives, the rank split of a step, the launcher, the
heartbeat; `parallelize` composes the memory and speed layers."""
