"""The preference objective: losses as pure functions with a registry, the beta schedule, the reference (online,
precomputed, adapters off) and its on-disk cache."""
