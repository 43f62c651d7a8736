"""`fastdpo plot OUTPUT_DIR`: a PNG dashboard of a run from its metrics.jsonl (and alerts.jsonl), with matplotlib."""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

from fastdpo.config import require_matplotlib
from fastdpo.errors import FastDPOError

log = logging.getLogger("fastdpo")

# (title, metric names, log scale)
PANELS = [
    ("loss", ["loss", "eval_loss"], False),
    ("rewards", ["rewards/chosen", "rewards/rejected"], False),
    ("reward margin", ["rewards/margins", "eval_rewards/margins"], False),
    ("reward accuracy", ["rewards/accuracies", "eval_rewards/accuracies"], False),
    ("log-ratio per token (policy vs reference)", ["logratio/chosen", "logratio/rejected", "logratio/mean"], False),
    ("grad norm", ["grad_norm"], True),
    ("learning rate", ["learning_rate"], False),
    ("pairs / s", ["pairs_per_second"], False),
    ("peak memory (GiB)", ["memory/peak_gib"], False),
]


# metrics.jsonl of earlier versions logged the signed mean log-ratios under `kl` names
OLD_NAMES = {"kl/chosen": "logratio/chosen", "kl/rejected": "logratio/rejected", "kl": "logratio/mean"}


def _number(v) -> float | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str) and v in ("nan", "inf", "-inf"):
        return float(v)
    return None


def read_jsonl(path: Path) -> list[tuple[int, object]]:
    """(line number, value) of each non-empty line of a JSONL file; a line that is not UTF-8 or not JSON raises."""
    out = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise FastDPOError(f"{path}:{lineno}: not valid UTF-8 (byte 0x{raw[e.start]:02x}); the file is damaged."
                                   " Remove that line.") from None
            if not line.strip():
                continue
            try:
                out.append((lineno, json.loads(line)))
            except (ValueError, RecursionError):
                raise FastDPOError(f"{path}:{lineno}: not valid JSON. Was the file cut off? Remove that line.") from None
    return out


def read_records(path: Path) -> list[dict]:
    """Records of a JSONL file in step order. Lines of the same step merge (a training record and its evaluation);
    when a resumed run logged a step again, its values win."""
    by_step: dict[int, dict] = {}
    for _, rec in read_jsonl(path):
        if isinstance(rec, dict) and "step" in rec:
            rec = {OLD_NAMES.get(k, k): v for k, v in rec.items()}
            by_step[int(rec["step"])] = {**by_step.get(int(rec["step"]), {}), **rec}
    return [by_step[k] for k in sorted(by_step)]


def write_dashboard(out_dir: str | Path, path: str | Path | None = None) -> Path:
    """Draw the dashboard of the run in `out_dir` to `path` (default out_dir/metrics.png); returns the path."""
    out = Path(out_dir)
    metrics = out / "metrics.jsonl"
    if not metrics.is_file():
        raise FastDPOError(f"{metrics} not found: OUTPUT_DIR must be the --output_dir of a fastdpo train run.")
    records = read_records(metrics)
    if not records:
        raise FastDPOError(f"{metrics} holds no logged steps yet.")
    require_matplotlib("fastdpo plot")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    alerts_file = out / "alerts.jsonl"
    alerts = []
    if alerts_file.is_file():
        alerts = [a for _, a in read_jsonl(alerts_file) if isinstance(a, dict) and "name" in a and "step" in a]
    steps = [r["step"] for r in records]
    skipped = [r["step"] for r, prev in zip(records, [{}] + records)
               if r.get("skipped_steps", 0) > prev.get("skipped_steps", 0)]

    fig = Figure(figsize=(15, 11), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(3, 3).ravel()
    for ax, (title, names, log_scale) in zip(axes, PANELS):
        drawn = False
        for name in names:
            xs, ys = [], []
            for s, r in zip(steps, records):
                v = _number(r.get(name))
                if v is not None and math.isfinite(v) and (v > 0 or not log_scale):
                    xs.append(s)
                    ys.append(v)
            if name == "memory/peak_gib" and not any(ys):
                xs = []  # 0 everywhere: not measured (CPU)
            if xs:
                ax.plot(xs, ys, marker="." if len(xs) < 40 else None, linewidth=1.4, label=name)
                drawn = True
        if log_scale and drawn:
            ax.set_yscale("log")
        if title == "reward accuracy":
            ax.axhline(0.5, color="grey", linestyle=":", linewidth=1)
            ax.set_ylim(-0.05, 1.05)
        if title in ("reward margin", "log-ratio per token (policy vs reference)"):
            ax.axhline(0.0, color="grey", linestyle=":", linewidth=1)
        for s in skipped:
            ax.axvline(s, color="red", alpha=0.35, linewidth=1)
        if not drawn:
            empty = "not measured" if title.startswith("peak memory") else "not logged"
            ax.text(0.5, 0.5, empty, ha="center", va="center", transform=ax.transAxes, color="grey")
        if len(names) > 1 and drawn:
            ax.legend(fontsize=8)
        ax.set_title(title, fontsize=11)
        ax.set_xlabel("step", fontsize=9)
        ax.grid(alpha=0.3)
    last = records[-1]
    subtitle = f"{out.resolve().name}: {len(records)} logged steps, last step {last['step']}"
    if skipped:
        subtitle += f", {last.get('skipped_steps', len(skipped))} skipped (NaN/Inf, red lines)"
    if alerts:
        names = sorted({a["name"] for a in alerts})
        subtitle += f"; alerts: {', '.join(names)}"
        for a in alerts:  # mark where each alert was raised on the panels it concerns
            for ax, (_title, names_, _) in zip(axes, PANELS):
                if any(n.split("/")[0] in _ALERT_PANELS.get(a["name"], ()) for n in names_):
                    ax.axvline(a["step"], color="orange", linestyle="--", linewidth=1)
    fig.suptitle(subtitle, fontsize=12)
    target = Path(path) if path else out / "metrics.png"
    save_figure(fig, target, f"The run's metrics are in {metrics}: rerun `fastdpo plot {out}` once the disk has room.")
    return target


def save_figure(fig, target: Path, advice: str) -> None:
    """Write `fig` to `target` through a temporary file beside it, renamed into place: a full disk leaves the old
    file (or none), never a cut-off image. A failed write is a FastDPOError naming the file, the cause, `advice`."""
    tmp = target.with_name(f".{target.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            fig.savefig(f, format=target.suffix[1:].lower() or "png")
        os.replace(tmp, target)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise FastDPOError(f"Writing the dashboard {target} failed ({e.strerror or e}); no partial file was left. "
                           f"{advice}") from None


def dashboard_after_training(out_dir: str | Path) -> Path | None:
    """The dashboard of a run whose final model is saved: one that cannot be drawn or written is a warning, not a
    failed run."""
    try:
        path = write_dashboard(out_dir)
    except FastDPOError as e:
        log.warning("--plot: %s The final model is saved.", e)
        return None
    log.info("Dashboard: %s", path)
    return path


# which metric families an alert concerns (for its marker on the dashboard)
_ALERT_PANELS = {
    "swapped_labels": ("rewards",),
    "accuracy_stuck": ("rewards",),
    "kl_ratio": ("logratio",),
    "grad_spike": ("grad_norm",),
    "grad_collapse": ("grad_norm",),
    "nonfinite": ("loss",),
    "update_gap": (),
}
