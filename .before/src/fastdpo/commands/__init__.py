"""The commands of the CLI, one module each (bench, tune, verify, demo, infer, eval, export, check-data, precompute-
ref): the top floor below `cli.py`; no command imports another."""
