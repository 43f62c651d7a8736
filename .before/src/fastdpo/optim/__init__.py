"""AdamW (with stochastic rounding into bfloat16 weights), the learning-rate schedules and the update that skips
NaN/Inf steps."""
