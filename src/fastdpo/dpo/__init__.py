"""The preference objective around the losses (`fastdpo.losses`): the beta schedule, the reference (online,
precomputed, adapters off) and its on-disk cache, and the reward functions of generation metrics."""
