"""fastdpo: fast, memory-lean Direct Preference Optimization on a packed, prefix-shared pair layout.

The Python API, for people who script::

    from fastdpo import TrainConfig, Trainer, train, LOSSES

    cfg = TrainConfig(model="Qwen/Qwen3-0.6B", dataset="prefs.jsonl", output_dir="out", max_steps=100)
    result = train(cfg)              # the whole run, as `fastdpo train` does it: result.model is the trained model

    trainer = Trainer(cfg)           # or one optimizer step at a time
    result = trainer.step()
    print(result.metrics.finish()["loss"])

`dataset` also takes rows in memory (a list of dicts, an HF Dataset). TRL scripts switch with one line:
`from fastdpo import DPOConfig, DPOTrainer`.

The names load on first use, so `fastdpo --help` and `import fastdpo.config` do not pay for torch and the model code.
"""

from fastdpo.version import __version__

_API = {
    "TrainConfig": "fastdpo.config",
    "LOSSES": "fastdpo.losses",
    "train": "fastdpo.training.loop",
    "Trainer": "fastdpo.training.trainer",
    "StepResult": "fastdpo.training.trainer",
    "TrainResult": "fastdpo.training.result",
    "DPOConfig": "fastdpo.trl",
    "DPOTrainer": "fastdpo.trl",
}
__all__ = ["LOSSES", "DPOConfig", "DPOTrainer", "StepResult", "TrainConfig", "TrainResult", "Trainer", "__version__",
           "train"]


def __getattr__(name: str):
    if name not in _API:
        raise AttributeError(f"module 'fastdpo' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_API[name]), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
