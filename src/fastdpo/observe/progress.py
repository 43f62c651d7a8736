"""A run's progress as the console shows it: steps done of the total, the run's own rate (pairs and tokens per second
since this run's first step, not the last logging window's), the time left, and the end-of-run summary that is
printed and saved as `output_dir/summary.json` (HF's `train_runtime`, `train_samples_per_second`, ...).

On a terminal a rich bar is drawn; off one (nohup, CI, `> train.log`) nothing is drawn, since a bar there is printed
once, at the end: every logged step line carries the time left instead (`ConsoleSink`)."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

_IMPORTED = time.monotonic()


def process_age() -> float:
    """Seconds since this process started (Linux: from /proc; elsewhere: since this module was imported, which
    leaves out the interpreter's start and the first imports)."""
    try:
        import os

        ticks = os.sysconf("SC_CLK_TCK")
        with open("/proc/self/stat", encoding="ascii") as f:
            started = int(f.read().rsplit(")", 1)[1].split()[19]) / ticks  # field 22: start time since boot
        with open("/proc/uptime", encoding="ascii") as f:
            return max(float(f.read().split()[0]) - started, 0.0)
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED


class KernelBuilds:
    """Counts the graphs TorchDynamo compiled (each one a kernel build) since the last look."""

    def __init__(self):
        self.seen = self.count()

    @staticmethod
    def count() -> int:
        try:
            from torch._dynamo.utils import counters
        except ImportError:  # pragma: no cover - a torch without Dynamo
            return 0
        return int(counters["stats"]["unique_graphs"])

    def new(self) -> int:
        now = self.count()
        n, self.seen = now - self.seen, now
        return n


class Timeline:
    """When the run reached each milestone, in seconds since the process started: where the time to a saved model
    went (`summary.json`'s `timeline_s`)."""

    def __init__(self):
        self.marks: dict[str, float] = {}

    def mark(self, name: str) -> None:
        self.marks.setdefault(name, round(process_age(), 2))


# the final metrics the summary line names (all of the last logged step go to summary.json)
SHOWN = ("loss", "rewards/margins", "rewards/accuracies", "logratio/mean")


def clock(seconds: float | None) -> str:
    """1:02:03 (hours:minutes:seconds), or ? when unknown."""
    if seconds is None or not math.isfinite(seconds):
        return "?"
    s = int(round(max(seconds, 0.0)))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class RunProgress:
    """Counts one run's optimizer steps from `start` (a resumed run counts from its first new step) to `total`."""

    def __init__(self, total: int, start: int = 0, console=None):
        self.total, self.start = total, start
        self.done = start
        self.pairs = self.tokens = 0
        self.t0 = time.perf_counter()
        self.bar = None
        if console is not None and console.is_terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("{task.fields[rate]}"), TimeRemainingColumn(), console=console,
                                transient=False)
            self.task = self.bar.add_task("train", total=total, completed=start, rate="")
            self.bar.start()

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def rate(self) -> dict:
        """pairs and tokens per second of this run so far."""
        dt = max(self.elapsed, 1e-9)
        return {"pairs_per_second": self.pairs / dt, "tokens_per_second": self.tokens / dt}

    def eta(self, step: int | None = None) -> float | None:
        """Seconds left after optimizer step `step` (default: the last one counted), at this run's pace."""
        step = self.done if step is None else step
        if step <= self.start:
            return None
        return self.elapsed / (step - self.start) * (self.total - step)

    def advance(self, done: int, pairs: int, tokens: int) -> None:
        """Step `done` finished with `pairs` pairs and `tokens` tokens (all ranks)."""
        self.done, self.pairs, self.tokens = done, self.pairs + pairs, self.tokens + tokens
        if self.bar is not None:
            self.bar.update(self.task, completed=done, rate=f"{self.rate()['pairs_per_second']:.2f} pairs/s")

    def building(self) -> None:
        """Show that the next step builds kernels (its time is compilation, not the run's pace)."""
        if self.bar is not None:
            self.bar.update(self.task, rate="building kernels")

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


def run_summary(progress: RunProgress, last: dict, peak_gib: float | None, peak_rss_gib: float | None = None,
                **extra) -> dict:
    """The end-of-run summary: runtime, steps, the run's rates, peak memory (None off CUDA; a CPU run gives its peak
    RSS instead), the last logged metrics; HF's names for the ones it has."""
    runtime = progress.elapsed
    steps = progress.done - progress.start
    rate = progress.rate()
    return {"train_runtime": round(runtime, 3), "steps": steps, "total_steps": progress.total,
            "first_step": progress.start + 1, "pairs": progress.pairs, "tokens": progress.tokens,
            "train_samples_per_second": round(rate["pairs_per_second"], 3),
            "train_steps_per_second": round(steps / max(runtime, 1e-9), 4),
            "tokens_per_second": round(rate["tokens_per_second"], 1),
            "peak_memory_gib": None if peak_gib is None else round(peak_gib, 3),
            **({} if peak_rss_gib is None else {"peak_rss_gib": round(peak_rss_gib, 3)}),
            "final_metrics": {k: v for k, v in last.items() if isinstance(v, (int, float)) and k != "step"},
            **extra}


def summary_line(summary: dict) -> str:
    """One line for the log: time, steps, rates, peak memory and the final loss and rewards."""
    peak, rss = summary["peak_memory_gib"], summary.get("peak_rss_gib")
    memory = f"peak memory {peak:.2f} GiB" if peak is not None else \
        f"peak RSS {rss:.2f} GiB" if rss is not None else "peak memory n/a"
    metrics = summary["final_metrics"]
    shown = "  ".join(f"{k.removesuffix('/mean').split('/')[-1]}={metrics[k]:.4g}" for k in SHOWN if k in metrics)
    return (f"run summary: {summary['steps']} steps in {clock(summary['train_runtime'])} "
            f"({summary['train_runtime']:.1f} s)  {summary['train_samples_per_second']:.2f} pairs/s  "
            f"{summary['tokens_per_second']:.0f} tokens/s  {memory}" + (f"  final {shown}" if shown else ""))


def save_summary(summary: dict, path: Path) -> None:
    clean = {k: (v if not isinstance(v, float) or math.isfinite(v) else str(v)) for k, v in summary.items()}
    clean["final_metrics"] = {k: (v if math.isfinite(v) else str(v)) for k, v in summary["final_metrics"].items()}
    path.write_text(json.dumps(clean, indent=1) + "\n", encoding="utf-8")
