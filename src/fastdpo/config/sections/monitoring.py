"""The monitoring section: how often metrics are logged, where else they go, and the vital-sign alerts."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from fastdpo.config.fields import Section, at_least, check_choice, option
from fastdpo.errors import FastDPOError

REPORT_TARGETS = ("tensorboard", "wandb", "mlflow", "trackio", "swanlab")
_PACKAGES = {t: t for t in REPORT_TARGETS}  # the module each sink imports, and the package that installs it


def report_targets(value: str) -> list[str]:
    """Parse --report_to: `none`, `all` (every installed one), or a comma-separated list of REPORT_TARGETS."""
    v = str(value).strip().lower()
    if v in ("", "none"):
        return []
    if v == "all":
        return [t for t in REPORT_TARGETS if importlib.util.find_spec(_PACKAGES[t]) is not None]
    names = [n.strip() for n in v.split(",") if n.strip()]
    for n in names:
        if n not in REPORT_TARGETS:
            raise FastDPOError(f"--report_to {value!r}: {n!r} is not one of: none, all, {', '.join(REPORT_TARGETS)}.")
    return names


def check_installed(targets: list[str]) -> None:
    """Fail before training (not after hours of it) when a requested sink's package is missing."""
    for t in targets:
        if importlib.util.find_spec(_PACKAGES[t]) is None:
            raise FastDPOError(f"--report_to {t}: the {_PACKAGES[t]} package is not installed. "
                               f"Run `pip install {_PACKAGES[t]}`, or drop {t} from --report_to.")


def require_matplotlib(what: str) -> None:
    if importlib.util.find_spec("matplotlib") is None:
        raise FastDPOError(f"{what} needs matplotlib, which is not installed. Run `pip install matplotlib`.")


@dataclass
class MonitoringSection(Section):
    """The metrics' sinks and the alerts watching them."""

    name = "monitoring"
    title = "Logging and monitoring"

    logging_steps: int = option(1, "Log metrics every N optimizer steps.")
    report_to: str = option("none", "Extra metric sinks: none|all (the installed ones)|tensorboard|wandb|mlflow|trackio|"
                            "swanlab, comma-separated (metrics.jsonl and the console are always written).")
    logging_dir: str = option("", "TensorBoard log dir (default: output_dir/runs).")
    run_name: str = option("", "Run name for Weights & Biases, MLflow, Trackio and SwanLab (default: the output_dir name).")
    plot: bool = option(False, "Write the dashboard output_dir/metrics.png (needs matplotlib) at the end of training.")
    alert_patience: int = option(5, "Logged steps a condition must hold before its alert (negative margins, gradient "
                                 "collapse; four times as many for accuracy stuck at 0.5).")
    kl_ratio_threshold: float = option(0.3, "Alert when kl_ratio (|logratio/mean| per token / rewards/margins, the margin "
                                       "floored at 0.01) exceeds this: the policy drifts from the reference faster "
                                       "than the margin grows, whichever way the log-probs move.")
    max_nonfinite_steps: int = option(5, "Steps with a NaN/Inf loss or gradient skip their update; stop after this many "
                                      "in a row (0: never stop).")
    certificate: str = option("on", "The run's certificate, checked on its first micro-batch (the packed path against "
                              "the padded one, the reference against the starting policy, and apart from it after "
                              "the first update), in summary.json: on (a FAIL stops the run), warn (logged only), off.")

    def validate_monitoring(self) -> None:
        at_least(self, 1, "logging_steps")
        check_installed(report_targets(self.report_to))
        if self.plot:
            require_matplotlib("--plot")
        at_least(self, 1, "alert_patience")
        if self.kl_ratio_threshold <= 0:
            raise FastDPOError(f"--kl_ratio_threshold must be > 0, got {self.kl_ratio_threshold}.")
        at_least(self, 0, "max_nonfinite_steps", hint=" (0: never stop)")
        check_choice("certificate", self.certificate, ("on", "warn", "off"))
