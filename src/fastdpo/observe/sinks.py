"""Where logged steps and alerts go: `metrics.jsonl` (+ `alerts.jsonl`) and the console always; TensorBoard, Weights &
Biases, MLflow, Trackio and SwanLab on request (`--report_to tensorboard,wandb,mlflow,trackio,swanlab`), several at
once. Each tracker gets the same metrics by step and the run's config, and a resumed run continues its own tracker
run where the tracker can (its id is kept in `output_dir`)."""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

from fastdpo.config import check_installed, report_targets
from fastdpo.observe.progress import clock

log = logging.getLogger("fastdpo")

def _scalars(record: dict) -> dict[str, float]:
    return {k: float(v) for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


class JsonlSink:
    """One JSON object per logged step in `metrics.jsonl`; one per alert in `alerts.jsonl`. Non-finite floats are
    written as the strings "nan" / "inf" so every line stays valid JSON."""

    def __init__(self, out_dir: Path, append: bool):
        mode = "a" if append else "w"
        self.file = open(out_dir / "metrics.jsonl", mode, encoding="utf-8")
        self.alerts = open(out_dir / "alerts.jsonl", mode, encoding="utf-8")

    def log(self, record: dict) -> None:
        clean = {k: (v if not isinstance(v, float) or math.isfinite(v) else str(v)) for k, v in record.items()}
        self.file.write(json.dumps(clean) + "\n")
        self.file.flush()

    def alert(self, alert) -> None:
        self.alerts.write(json.dumps(alert.to_dict()) + "\n")
        self.alerts.flush()

    def close(self) -> None:
        self.file.close()
        self.alerts.close()


class ConsoleSink:
    """One line per logged step on the rich console, never wrapped (a log file keeps one line per step at any
    width), ending with the time left once the run's progress is known (`Sinks.follow`); alerts go through the
    `fastdpo` logger."""

    KEYS = ("loss", "rewards/margins", "rewards/accuracies", "logratio/mean", "grad_norm", "learning_rate", "pairs_per_second",
            "eval_loss", "eval_rewards/margins", "eval_rewards/accuracies")

    def __init__(self, console):
        self.console = console
        self.progress = None  # a RunProgress: the total steps and the time left

    def log(self, record: dict) -> None:
        shown = "  ".join(f"{_label(k)}={_fmt(record[k])}" for k in self.KEYS if k in record)
        step = f"{record['step']:>5}"
        if self.progress is not None:
            step += f"/{self.progress.total}"
            shown += f"  eta={clock(self.progress.eta(record['step']))}"
        self.console.print(f"step {step}  {shown}", highlight=False, markup=False, soft_wrap=True)

    def alert(self, alert) -> None:
        pass

    def close(self) -> None:
        pass


def _label(key: str) -> str:
    """`rewards/margins` -> `margins`, `eval_rewards/margins` -> `eval_margins`, `logratio/mean` -> `logratio`."""
    prefix = "eval_" if key.startswith("eval_") else ""
    return prefix + key.removeprefix("eval_").removesuffix("/mean").split("/")[-1]


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


class TensorBoardSink:
    """Scalars under their metric names; alerts as text. A resumed run purges events after the resume step."""

    def __init__(self, log_dir: Path, start_step: int):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=start_step + 1 if start_step else None)

    def log(self, record: dict) -> None:
        for k, v in _scalars(record).items():
            self.writer.add_scalar(k, v, record["step"])
        self.writer.flush()

    def alert(self, alert) -> None:
        self.writer.add_text(f"alerts/{alert.name}", alert.text(), alert.step)

    def close(self) -> None:
        self.writer.close()


def _run_id(out_dir: Path, name: str) -> str | None:
    """The tracker run id a previous start of this run saved in `output_dir/.NAME_run_id` (None: a new run)."""
    f = out_dir / f".{name}_run_id"
    return (f.read_text().strip() or None) if f.is_file() else None


def _keep_run_id(out_dir: Path, name: str, run_id) -> None:
    if run_id:
        (out_dir / f".{name}_run_id").write_text(str(run_id))


class _TrackerRun:
    """A tracker's run object (`self.run`, with log(data, step) and finish()): metrics by step, each alert as
    `alerts/NAME` = 1 at its step."""

    run: Any

    def log(self, record: dict) -> None:
        self.run.log(_scalars(record), step=record["step"])

    def alert(self, alert) -> None:
        self.run.log({f"alerts/{alert.name}": 1}, step=alert.step)

    def close(self) -> None:
        self.run.finish()


class WandbSink(_TrackerRun):
    """A W&B run (project from WANDB_PROJECT, default `fastdpo`; resumed by id when training resumes)."""

    def __init__(self, out_dir: Path, run_name: str, config: dict):
        import wandb

        self.wandb = wandb
        run_id = _run_id(out_dir, "wandb")
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "fastdpo"), name=run_name or out_dir.name,
                              dir=str(out_dir), config=config, id=run_id, resume="allow" if run_id else None)
        if run_id is None:
            _keep_run_id(out_dir, "wandb", getattr(self.run, "id", None))


def _params(config: dict, limit: int = 500) -> dict[str, str]:
    """The config as MLflow params: one string per field (lists and dicts as JSON), cut to MLflow's value limit."""
    return {k: (v if isinstance(v, str) else json.dumps(v, default=str))[:limit] for k, v in config.items()}


class MlflowSink:
    """An MLflow run in the experiment MLFLOW_EXPERIMENT_NAME (default `fastdpo`), at MLFLOW_TRACKING_URI (MLflow's
    default when unset): the config as params, metrics by step; a resumed run continues the same MLflow run."""

    def __init__(self, out_dir: Path, run_name: str, config: dict):
        import mlflow

        self.mlflow = mlflow
        run_id = _run_id(out_dir, "mlflow")
        if run_id is None:
            mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", "fastdpo"))
        self.run = mlflow.start_run(run_id=run_id, run_name=None if run_id else run_name or out_dir.name)
        _keep_run_id(out_dir, "mlflow", self.run.info.run_id)
        if run_id is None:  # MLflow refuses to change a logged param; a resume keeps the first start's
            params = list(_params(config).items())
            for i in range(0, len(params), 100):  # MLflow takes at most 100 params per call
                mlflow.log_params(dict(params[i:i + 100]))

    def log(self, record: dict) -> None:
        self.mlflow.log_metrics(_scalars(record), step=record["step"])

    def alert(self, alert) -> None:
        self.mlflow.log_metric(f"alerts/{alert.name}", 1, step=alert.step)

    def close(self) -> None:
        self.mlflow.end_run()


class TrackioSink(_TrackerRun):
    """A Trackio run in project TRACKIO_PROJECT (default `fastdpo`; TRACKIO_SPACE_ID logs to a Hugging Face Space), the
    config with it; a resumed run continues the run of the same name."""

    def __init__(self, out_dir: Path, run_name: str, config: dict, resume: bool):
        import trackio

        self.run = trackio.init(project=os.environ.get("TRACKIO_PROJECT", "fastdpo"), name=run_name or out_dir.name,
                                config=config, resume="allow" if resume else "never")


class SwanlabSink(_TrackerRun):
    """A SwanLab experiment in project SWANLAB_PROJECT (default `fastdpo`; SwanLab's own login and SWANLAB_MODE), the
    config with it; a resumed run continues the same experiment."""

    def __init__(self, out_dir: Path, run_name: str, config: dict):
        import swanlab

        run_id = _run_id(out_dir, "swanlab")
        kw = {"id": run_id, "resume": "allow"} if run_id else {}
        self.run = swanlab.init(project=os.environ.get("SWANLAB_PROJECT", "fastdpo"),
                                experiment_name=run_name or out_dir.name, config=config, **kw)
        _keep_run_id(out_dir, "swanlab", getattr(self.run, "id", None))


class Sinks:
    """All sinks of a run behind one `log` / `alert` / `close`."""

    def __init__(self, sinks: list):
        self.sinks = sinks

    def log(self, record: dict) -> None:
        for s in self.sinks:
            s.log(record)

    def alert(self, alert) -> None:
        log.warning("%s", alert.text())
        for s in self.sinks:
            s.alert(alert)

    def follow(self, progress) -> None:
        """Hand the run's progress (`observe.progress.RunProgress`) to the sinks that show it."""
        for s in self.sinks:
            if hasattr(s, "progress"):
                s.progress = progress

    def close(self) -> None:
        for s in self.sinks:
            s.close()


def open_sinks(cfg, out_dir: Path, console, start_step: int) -> Sinks:
    """The sinks `cfg` asks for. A resumed run (start_step > 0) appends to its files."""
    sinks: list = [JsonlSink(out_dir, append=start_step > 0)]
    if console is not None:
        sinks.append(ConsoleSink(console))
    targets = report_targets(cfg.report_to)
    check_installed(targets)
    if "tensorboard" in targets:
        sinks.append(TensorBoardSink(Path(cfg.logging_dir) if cfg.logging_dir else out_dir / "runs", start_step))
    if "wandb" in targets:
        sinks.append(WandbSink(out_dir, cfg.run_name, cfg.to_dict()))
    if "mlflow" in targets:
        sinks.append(MlflowSink(out_dir, cfg.run_name, cfg.to_dict()))
    if "trackio" in targets:
        sinks.append(TrackioSink(out_dir, cfg.run_name, cfg.to_dict(), resume=start_step > 0))
    if "swanlab" in targets:
        sinks.append(SwanlabSink(out_dir, cfg.run_name, cfg.to_dict()))
    return Sinks(sinks)
