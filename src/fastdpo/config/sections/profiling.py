"""The profiling section: profiled steps, kernels built ahead, static lengths, and garbage collection."""

from __future__ import annotations

from dataclasses import dataclass

from fastdpo.config.fields import Section, at_least, option
from fastdpo.errors import FastDPOError


def parse_steps(spec: str) -> tuple[int, int] | None:
    """'6-8' -> (6, 8); '7' -> (7, 7); '' -> None. Steps count from 1, like the logged step numbers."""
    if not spec:
        return None
    lo, _, hi = spec.partition("-")
    try:
        first, last = int(lo), int(hi or lo)
    except ValueError:
        first = last = 0
    if first < 1 or last < first:
        raise FastDPOError(f"--profile_steps {spec!r}: give one step or a range of optimizer steps, e.g. 6-8 (from 1).")
    return first, last


@dataclass
class ProfilingSection(Section):
    """What is measured of the run's steps, and what is built or collected ahead of them."""

    name = "profiling"
    title = "Profiling and compilation"

    profile_steps: str = option("", "Profile these optimizer steps, e.g. 6-8: a torch.profiler trace per rank in "
                                "output_dir/profile/ and a summary of the device's time (compute, exposed communication, "
                                "idle).")
    compile_warmup: bool = option(False, "Before the first step, build the kernels of every micro-batch length (one "
                                  "filler forward and backward per length of the --max_tokens_per_batch budget; gradients "
                                  "discarded): steps run at full speed from the first, and on several GPUs no rank waits "
                                  "for another's compilation.")
    length_buckets: int = option(16, "Static lengths a packed micro-batch is padded to under a --max_tokens_per_batch "
                                 "budget (FlexAttention; varlen needs no padding): the next multiple of budget / N (and "
                                 "of 128 tokens). More pad less (batch/padding in the metrics) and build kernels for "
                                 "more lengths (each once; up front with --compile_warmup).")
    gc_steps: int = option(0, "Python's garbage collection in training: what exists when training starts is frozen "
                           "(never walked again) either way; 0 leaves the schedule to Python; N turns automatic "
                           "collection off and collects the young generations at every N-th step on every rank at once "
                           "(pauses logged as gc/pause_ms).")
    profile_memory: bool = option(False, "With --profile_steps: also record the GPU allocations of those steps; "
                                  "output_dir/profile/rank{R}/memory.txt names the peak and what was alive at it, by "
                                  "source line (memory_snapshot.pickle: the timeline, for pytorch.org/memory_viz).")

    def validate_profiling(self) -> None:
        parse_steps(self.profile_steps)  # raises on a bad value
        if self.profile_memory and not self.profile_steps:
            raise FastDPOError("--profile_memory records the steps of --profile_steps: add e.g. --profile_steps 6-7.")
        at_least(self, 0, "gc_steps", hint=" (0: Python's own collection)")
        if not 1 <= self.length_buckets <= 64:
            raise FastDPOError(f"--length_buckets must be between 1 and 64, got {self.length_buckets}.")
