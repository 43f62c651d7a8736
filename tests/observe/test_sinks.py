"""The MLflow, Trackio and SwanLab sinks: the same metrics by step, the config, a clean close, the run continued on
resume, and a missing package named with how to install it. Each is tested against a stub module that records the
calls (the real packages are heavy), and against the real one when it is installed."""

import importlib.machinery
import importlib.util
import json
import sys
import types

import pytest

from fastdpo.config import TrainConfig
from fastdpo.errors import FastDPOError
from fastdpo.observe.alerts import Alert
from fastdpo.observe.sinks import open_sinks, report_targets

RECORD = {"step": 3, "loss": 0.5, "rewards/margins": 0.1, "note": "x", "skipped": False}
METRICS = {"loss": 0.5, "rewards/margins": 0.1}


def stub(monkeypatch, name: str, calls: list | None = None, **attrs) -> list:
    """A module `name` in sys.modules whose functions note their calls in `calls` (returned; a new list if none)."""
    calls = [] if calls is None else calls
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    for attr, fn in attrs.items():
        setattr(module, attr, lambda *a, _attr=attr, _fn=fn, **kw: calls.append((_attr, a, kw)) or _fn(*a, **kw))
    monkeypatch.setitem(sys.modules, name, module)
    return calls


class Run:
    """A tracker's run object (Trackio's and SwanLab's have log and finish)."""

    def __init__(self, calls: list, run_id: str = "run-1"):
        self.calls, self.id = calls, run_id

    def log(self, data, step=None):
        self.calls.append(("run.log", data, step))

    def finish(self):
        self.calls.append(("run.finish",))


def config(tmp_path, report_to: str, **kw) -> TrainConfig:
    return TrainConfig(model="m", dataset=["d"], output_dir=str(tmp_path), report_to=report_to, run_name="exp1", **kw)


def run_sinks(tmp_path, cfg, start_step: int = 0) -> None:
    sinks = open_sinks(cfg, tmp_path, None, start_step)
    sinks.log(RECORD)
    sinks.alert(Alert("grad_spike", 3, "grad norm jumped", "lower the learning rate"))
    sinks.close()


def mlflow_stub(monkeypatch) -> list:
    active = types.SimpleNamespace(info=types.SimpleNamespace(run_id="mlrun-7"))
    return stub(monkeypatch, "mlflow", set_experiment=lambda name: None, start_run=lambda **kw: active,
                log_params=lambda params: None, log_metrics=lambda metrics, step: None,
                log_metric=lambda key, value, step: None, end_run=lambda: None)


def test_mlflow_sink_logs_params_metrics_by_step_and_ends(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    calls = mlflow_stub(monkeypatch)
    run_sinks(tmp_path, config(tmp_path, "mlflow", lr_scheduler_kwargs={"min_lr": 1e-7}))
    names = [c[0] for c in calls]
    assert names == ["set_experiment", "start_run"] + ["log_params"] * (len(names) - 5) + [
        "log_metrics", "log_metric", "end_run"]
    assert calls[0][1] == ("fastdpo",) and calls[1][2] == {"run_id": None, "run_name": "exp1"}
    params = {k: v for c in calls if c[0] == "log_params" for k, v in c[1][0].items()}
    assert all(len(c[1][0]) <= 100 for c in calls if c[0] == "log_params")
    assert params["report_to"] == "mlflow" and params["beta"] == "0.1"
    assert json.loads(params["lr_scheduler_kwargs"]) == {"min_lr": 1e-7}
    assert set(params) == set(TrainConfig.__dataclass_fields__)
    assert calls[-3] == ("log_metrics", (METRICS,), {"step": 3})
    assert calls[-2] == ("log_metric", ("alerts/grad_spike", 1), {"step": 3})
    assert (tmp_path / ".mlflow_run_id").read_text() == "mlrun-7"


def test_mlflow_resume_continues_the_run_without_logging_params_again(tmp_path, monkeypatch):
    (tmp_path / ".mlflow_run_id").write_text("mlrun-7")
    calls = mlflow_stub(monkeypatch)
    run_sinks(tmp_path, config(tmp_path, "mlflow"), start_step=5)
    assert [c[0] for c in calls] == ["start_run", "log_metrics", "log_metric", "end_run"]
    assert calls[0][2] == {"run_id": "mlrun-7", "run_name": None}


@pytest.mark.parametrize("start_step,resume", [(0, "never"), (4, "allow")])
def test_trackio_sink_logs_by_step_and_finishes(tmp_path, monkeypatch, start_step, resume):
    monkeypatch.setenv("TRACKIO_PROJECT", "dpo-runs")
    calls: list = []
    stub(monkeypatch, "trackio", calls, init=lambda **kw: Run(calls))
    run_sinks(tmp_path, config(tmp_path, "trackio"), start_step)
    init = next(c for c in calls if c[0] == "init")[2]
    assert init["project"] == "dpo-runs" and init["name"] == "exp1" and init["resume"] == resume
    assert init["config"]["report_to"] == "trackio"
    logged = [c for c in calls if c[0] == "run.log"]
    assert logged == [("run.log", METRICS, 3), ("run.log", {"alerts/grad_spike": 1}, 3)]
    assert calls[-1] == ("run.finish",)


def test_swanlab_sink_logs_by_step_finishes_and_resumes_by_id(tmp_path, monkeypatch):
    monkeypatch.delenv("SWANLAB_PROJECT", raising=False)
    calls: list = []
    stub(monkeypatch, "swanlab", calls, init=lambda **kw: Run(calls, "swan-42"))
    run_sinks(tmp_path, config(tmp_path, "swanlab"))
    init = next(c for c in calls if c[0] == "init")[2]
    assert init["project"] == "fastdpo" and init["experiment_name"] == "exp1" and "id" not in init
    assert init["config"]["run_name"] == "exp1"
    assert [c for c in calls if c[0] == "run.log"][0] == ("run.log", METRICS, 3) and calls[-1] == ("run.finish",)
    assert (tmp_path / ".swanlab_run_id").read_text() == "swan-42"

    calls.clear()
    run_sinks(tmp_path, config(tmp_path, "swanlab"), start_step=5)
    init = next(c for c in calls if c[0] == "init")[2]
    assert init["id"] == "swan-42" and init["resume"] == "allow"


@pytest.mark.parametrize("name", ["mlflow", "trackio", "swanlab"])
def test_a_missing_tracker_is_named_with_how_to_install_it(monkeypatch, name):
    assert report_targets(f"tensorboard,{name}") == ["tensorboard", name]
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda mod: None if mod == name else real(mod))
    with pytest.raises(FastDPOError, match=f"--report_to {name}: the {name} package is not installed. Run `pip install "
                                           f"{name}`"):
        TrainConfig(model="m", dataset=["d"], report_to=name).validate()


def test_several_trackers_at_once(tmp_path, monkeypatch):
    calls: list = []
    mlflow_calls = mlflow_stub(monkeypatch)
    stub(monkeypatch, "trackio", calls, init=lambda **kw: Run(calls))
    run_sinks(tmp_path, config(tmp_path, "mlflow,trackio"))
    assert ("log_metrics", (METRICS,), {"step": 3}) in mlflow_calls and ("run.log", METRICS, 3) in calls


@pytest.mark.skipif(importlib.util.find_spec("mlflow") is None, reason="mlflow is not installed")
def test_the_real_mlflow_records_the_run(tmp_path, monkeypatch):
    import mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    out = tmp_path / "out"
    out.mkdir()
    run_sinks(out, config(out, "mlflow"))
    run = mlflow.get_run((out / ".mlflow_run_id").read_text())
    assert run.data.metrics["loss"] == 0.5 and run.data.params["report_to"] == "mlflow"
    assert run.info.status == "FINISHED"
