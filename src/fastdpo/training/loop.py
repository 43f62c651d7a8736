"""The training loop, readable top to bottom: set up, resume, then for each optimizer step `Trainer.step()` (the
one step there is), the NaN/Inf guard's count, logging, evaluation and checkpoints; at the end the final model.
Under torchrun every rank runs this loop on its share of each step's pairs."""

from __future__ import annotations

import logging
import signal
import time
from pathlib import Path

import torch

from fastdpo import checkpoint as ckpt
from fastdpo.checkpoint import restore
from fastdpo.checkpoint.identity import RunIdentity, check_resume_identity
from fastdpo.checkpoint.ownership import decide_on_main, own_output_dir, save_run_config
from fastdpo.config import TrainConfig
from fastdpo.errors import FastDPOError
from fastdpo.model.load import (
    base_causal_lm,
    model_summary,
)
from fastdpo.model.upload import hub_repo, push_folder
from fastdpo.observe.diagnostics import oom_error
from fastdpo.observe.gcpause import GcPauses
from fastdpo.observe.memtrace import peak_rss_gib, rss_gib
from fastdpo.observe.metrics import Throughput, device_peak_flops, held_memory_gib, padding, peak_memory_gib
from fastdpo.observe.profile import StepProfiler
from fastdpo.observe.progress import KernelBuilds, RunProgress, Timeline, run_summary, save_summary, summary_line
from fastdpo.observe.streams import run_log
from fastdpo.optim.optimizer import (
    follow_schedule,
    schedule_changes,
)
from fastdpo.parallel.collectives import any_rank, max_over_ranks
from fastdpo.parallel.distributed import Dist, barrier, heartbeat, init_distributed, shutdown
from fastdpo.parallel.wrap import full_state_dict
from fastdpo.training.callbacks import Callbacks
from fastdpo.training.certificate import Certificate, next_step_record
from fastdpo.training.evaluate import TrainingEval
from fastdpo.training.measure import auto_policy, mfu, pairs_flops
from fastdpo.training.monitor import Monitor
from fastdpo.training.result import TrainResult
from fastdpo.training.setup import build_setup, speed_hint
from fastdpo.training.signals import GracefulStop
from fastdpo.training.trainer import StepResult, Trainer, step_groups

log = logging.getLogger("fastdpo")


def train(cfg: TrainConfig, console=None, progress: bool = True, callbacks: list | None = None,
          keep_model: bool = True, preloaded: dict | None = None) -> TrainResult:
    """Train per `cfg`; returns a TrainResult (the model and tokenizer in memory unless `keep_model` is false, final
    dir, last metrics). `callbacks`: see `fastdpo.training.callbacks`. `preloaded`: objects already in memory that
    set-up uses instead of loading (`model`, `ref_model`, `tokenizer`). Under torchrun every rank calls this; only
    rank 0 logs and writes files other than checkpoint shards."""
    cfg.validate_training()
    hooks = Callbacks(callbacks)
    d = init_distributed(cfg, timeout_s=cfg.ddp_timeout)
    try:
        # one run per --output_dir, released on any exit; its story in output_dir/train.log
        with own_output_dir(cfg, d), run_log(Path(cfg.output_dir), bool(cfg.resume_from_checkpoint), d.is_main):
            trainer, info = run_training(cfg, d, console if d.is_main else None, progress and d.is_main, hooks,
                                         preloaded)
    finally:
        shutdown(d)
    result = train_result(trainer, info, keep_model)
    hooks.train_end(result)
    return result


def run_training(cfg: TrainConfig, d: Dist, console, progress: bool, hooks: Callbacks | None = None,
                 preloaded: dict | None = None) -> tuple[Trainer, dict]:
    hooks = hooks or Callbacks()
    timeline = Timeline()  # seconds since the process started: model ready, first and last step, model saved
    timeline.mark("started")
    trainer = Trainer(cfg, build_setup(cfg, d, choose_policy=auto_policy, mark=timeline.mark, **(preloaded or {})), d)
    timeline.mark("ready")
    s, out = trainer.s, Path(cfg.output_dir)
    identity = RunIdentity(cfg, s.pairs)  # recorded in every checkpoint, compared on resume
    start, resume = resume_training(trainer, out, identity)
    if cfg.certificate != "off":  # checked by this process's first step
        trainer.certificate, trainer.resumed = Certificate(cfg.certificate), start > 0
    ckpt.warn_later_checkpoints(out, start)
    ckpt.check_disk_space(out, s.model, cfg, s.total_steps - start, [s.reference.model] if cfg.sync_ref_model else [])
    evaluator = TrainingEval(cfg, s.val_pairs, ckpt.load_progress(resume) if resume is not None else None,
                             s.val_reference)
    if d.is_main:
        save_run_config(cfg, out, s.plan)  # training begins: from here a failed run keeps its output dir
    summary = {**model_summary(s.model), "backend": s.backend.name, "reference": s.reference.strategy,
               "pairs": len(s.pairs), "total_steps": s.total_steps}
    log.info("Training: %s", summary)
    hint = speed_hint(cfg, s.plan, s.device, s.backend.name, "fsdp_zero2" if d.keeps_gathered else d.mode)
    if hint and d.is_main:
        log.info(hint)
    if cfg.compile_warmup:
        warm_up_logged(trainer)

    monitor = Monitor(cfg, out, console, trainer.optimizer, start, write=d.is_main, world_size=d.dp_size)
    logger = StepLog(trainer)
    bar = _progress_bar(console if progress else None, s.total_steps, start)
    monitor.sinks.follow(bar)  # step lines end with the time left
    last: dict = {}
    stop = GracefulStop().install()  # SIGTERM/SIGINT from here on: finish the step, checkpoint, exit
    stopped_at: Path | None = None
    hb = heartbeat(cfg, d).start()  # names a rank that stops progressing, long before --ddp_timeout
    profiler = StepProfiler(cfg.profile_steps, out, d.rank, s.device, memory=cfg.profile_memory)
    if profiler.window and (profiler.window[0] <= start or profiler.window[1] > s.total_steps):
        log.warning("--profile_steps %s: this run trains steps %d-%d, so the profile needs a window inside them.",
                    cfg.profile_steps, start + 1, s.total_steps)
    pauses = GcPauses(cfg.gc_steps).start()
    builds = KernelBuilds()
    compiles = cfg.torch_compile or s.backend.name == "flex"
    if compiles:
        log.info("Building kernels: the first step compiles %s, so it takes longer than the rest; later steps "
                 "reuse them.", "the decoder layers (--torch_compile)" if cfg.torch_compile else
                 "FlexAttention for each static micro-batch length")
        bar.building()
    hooks.train_begin(trainer)
    try:
        for step in range(start, s.total_steps):
            hb.beat(step + 1, "forward")
            profiler.begin(step + 1)
            t_step = time.perf_counter()
            result = trainer.step()
            done = trainer.global_step
            built = builds.new()
            if built and d.is_main:  # said once per step that paid for compilation, with its time
                log.info("Step %d built kernels (%d compiled graph%s) in %.1f s%s.", done, built, "s" * (built > 1),
                         time.perf_counter() - t_step, "" if done == start + 1 else ": a new micro-batch shape")
            if done == start + 1:
                timeline.mark("first_step")
            monitor.finite_update(result.finite, done, [p.index for p in result.pairs], result.stepped)
            pauses.step_end(done)  # --gc_steps: every rank collects at the same step
            profiler.end(done)
            logger.add(result)
            if done % cfg.logging_steps == 0 or done == s.total_steps:
                last = logger.record(result, step, pauses.take())
                monitor.log(last)  # adds the vital signs, raises alerts, writes every sink
                hooks.step(done, last)
            if evaluator.due(done, s.total_steps):  # every rank evaluates (the forwards are collective)
                hb.beat(done, "eval")
                scores = evaluator.run(s, done, round(done / s.steps_per_epoch, 4))
                monitor.write(scores)
                hooks.evaluate(done, scores)
            bar.advance(done, len(result.pairs), result.tokens)
            periodic = cfg.save_steps > 0 and done % cfg.save_steps == 0
            stopping = any_rank(stop.requested or hooks.should_stop, d, s.device)  # all ranks stop after one step
            stopping = stopping and done < s.total_steps  # a stop at the last step just finishes the run
            if periodic or stopping:  # the last step too, so a finished run can be extended exactly
                hb.beat(done, "save")
                saved = save_checkpoint(trainer, evaluator, out, done, step // s.steps_per_epoch, identity)
                hooks.save(done, saved)
                if stopping:
                    stopped_at = saved
                    break
    except torch.OutOfMemoryError as e:
        raise oom_error(e, cfg, s.device, trainer.current_pairs, s.plan) from None
    finally:
        pauses.stop()
        hb.stop()
        profiler.close()
        stop.restore()
        bar.stop()
        monitor.close()
        if s.stream is not None:
            s.stream.close()
            if d.is_main:
                s.stream.summary().save(out / "data_summary.json")
            s.stream.summary().log()

    if stopped_at is not None:
        by = stop.name or ("callback" if hooks.should_stop else "")
        log.warning("Stopped by %s after step %d: saved %s. Continue with --resume_from_checkpoint latest.",
                    by or "a signal or callback on another rank", trainer.global_step, stopped_at)
        run = report_run(bar, last, s, out, stopped=by or "SIGTERM", **evaluator.summary(), **certified(trainer))
        code = stop.exit_code() if stop.requested else 0 if hooks.should_stop else 128 + signal.SIGTERM
        return trainer, {"final_dir": None, "stopped": by or "SIGTERM", "checkpoint": str(stopped_at),
                         "exit_code": code, "last": last, "run_summary": run, **summary, **evaluator.summary()}
    timeline.mark("last_step")
    weights = full_state_dict(s.model, d)  # FSDP2: every rank sends its shards to rank 0
    final = out / "final"
    if d.is_main:
        with stop:  # a signal now lets the final write finish
            final = ckpt.save_final(out, s.model, s.tokenizer, weights)
    barrier(d)
    timeline.mark("saved")
    evaluator.best.saved(s.total_steps, final)
    hooks.save(s.total_steps, final)
    if cfg.plot and d.is_main:
        from fastdpo.observe.plot import dashboard_after_training  # matplotlib loads only when asked for

        dashboard_after_training(out)
    run = report_run(bar, last, s, out, final_dir=str(final), timeline_s=timeline.marks, **evaluator.summary(),
                     **certified(trainer))
    if cfg.push_to_hub and d.is_main:
        what = "LoRA adapter" if cfg.uses_lora else "model"
        url = push_folder(final, hub_repo(cfg.hub_model_id, cfg.output_dir), cfg.hub_private_repo, what)
        log.info("--push_to_hub: uploaded the %s in %s to %s.", what, final, url)
    return trainer, {"final_dir": str(final), "last": last, "run_summary": run, **summary, **evaluator.summary()}


def certified(trainer: Trainer) -> dict:
    """The run's certificate for its summary (nothing with --certificate off)."""
    if trainer.certificate is None:
        return {}
    trainer.certificate.finish(trainer.s)
    return {"certificate": trainer.certificate.to_dict()}


def train_result(trainer: Trainer, info: dict, keep_model: bool) -> TrainResult:
    """The run's result; with `keep_model`, the trained policy (unwrapped, eval mode) and tokenizer in memory."""
    s = trainer.s
    model = s.model.eval() if keep_model else None
    return TrainResult(output_dir=str(trainer.cfg.output_dir), final_dir=info["final_dir"], metrics=info["last"],
                       summary=info["run_summary"], model=model, tokenizer=s.tokenizer if keep_model else None,
                       stopped=info.get("stopped"), checkpoint=info.get("checkpoint"),
                       exit_code=info.get("exit_code", 0), info=info)


def report_run(progress: RunProgress, last: dict, s, out: Path, **extra) -> dict:
    """The end-of-run summary (runtime, the run's pairs/s and tokens/s, peak memory over ranks, the last metrics):
    logged in one line and saved as output_dir/summary.json by rank 0."""
    d = s.dist
    peak, rss = max_over_ranks([peak_memory_gib(s.device), peak_rss_gib() or 0.0], d, s.device)
    cpu = s.device.type != "cuda"  # a CPU run's memory figure is the process's peak RSS
    run = run_summary(progress, last, None if cpu else peak, rss if cpu else None, world_size=d.world_size, **extra)
    if d.is_main:
        save_summary(run, out / "summary.json")
        log.info("%s (%s)", summary_line(run), out / "summary.json")
    return run


def warm_up_logged(trainer: Trainer) -> None:
    t0 = time.perf_counter()
    n = trainer.warm_up()
    if n:
        log.info("--compile_warmup: kernels for %d micro-batch lengths built in %.1f s.", n, time.perf_counter() - t0)
    else:  # dense or padded attention (CPU), or a stream: no budget, so no static lengths
        log.info("--compile_warmup: nothing to build without a token budget (--max_tokens_per_batch; FlexAttention "
                 "runs on CUDA pick one).")


class StepLog:
    """The logged record of every --logging_steps-th step: the step's metrics, rates since the last record, MFU,
    peak memory and padding (the largest over ranks), Python's collection pauses."""

    def __init__(self, trainer: Trainer):
        self.t, s = trainer, trainer.s
        self.lm_config = base_causal_lm(s.model).config.get_text_config()  # a vision-language model: its language model
        self.peak = device_peak_flops(s.device)
        self.rate = Throughput()
        self.flops = 0.0
        self.largest = 0  # the largest micro-batch since the last record, in token positions

    def add(self, r: StepResult) -> None:
        self.rate.add(len(r.pairs), r.tokens)
        self.largest = max(self.largest, r.metrics.largest_tokens)
        if self.peak:
            s = self.t.s
            self.flops += pairs_flops(self.lm_config, r.pairs, s.reference.online, s.backend.group, s.backend.dedupe)

    def record(self, r: StepResult, step: int, gcs: dict) -> dict:
        s, d = self.t.s, self.t.s.dist
        t0 = self.rate.t0
        record = {"step": step + 1, "epoch": round(step / s.steps_per_epoch + 1 / s.steps_per_epoch, 4),
                  **r.metrics.finish(), "grad_norm": float(r.grad_norm), "learning_rate": r.learning_rate,
                  "beta": r.beta}
        if self.peak:
            record["mfu"] = mfu(self.flops, max(time.perf_counter() - t0, 1e-9), self.peak, d.world_size)
            self.flops = 0.0
        record.update(self.rate.read())
        mem, held, gc_ms, gc_n, busiest, largest, rss, rss_now = max_over_ranks(
            [peak_memory_gib(s.device), held_memory_gib(s.device), gcs["gc/pause_ms"], gcs["gc/collections"],
             r.metrics.computed_tokens, self.largest, peak_rss_gib() or 0.0, rss_gib() or 0.0], d, s.device)
        self.largest = 0
        if s.device.type != "cuda":
            record.update({"memory/peak_rss_gib": round(rss, 3), "memory/rss_gib": round(rss_now, 3)})
        else:
            record["memory/allocated_gib"] = round(held, 3)
        record.update({"memory/peak_gib": round(mem, 3), "gc/pause_ms": round(gc_ms, 3),
                       "gc/collections": int(gc_n), "batch/micro_batches": r.metrics.micro_batches,
                       "batch/largest_tokens": int(largest), "batch/padding": padding(int(busiest), r.tokens, d.dp_size)})
        return record


def save_checkpoint(trainer: Trainer, evaluator: TrainingEval, out: Path, done: int, epoch: int,
                    identity: RunIdentity) -> Path:
    """checkpoint-N/ of this step (every rank writes its shards under FSDP2); rank 0 rotates the old ones."""
    s, cfg, d = trainer.s, trainer.cfg, trainer.s.dist
    extra = {"reference": s.reference.model} if cfg.sync_ref_model else None
    evaluator.best.saved(done, out / f"checkpoint-{done}")
    state = {"epoch": epoch, "beta": s.beta.state_dict(), **evaluator.progress(),
             "pairs_per_step": trainer.pairs_per_step, "world_size": d.world_size, "drop_last": cfg.dataloader_drop_last}
    if trainer.certificate is not None and s.stream is None and done < s.total_steps:
        # what a resume must find when it runs the next step first (rank 0's first pairs; every rank computes its own
        # so the forwards stay alike, rank 0's is written)
        first = step_groups(s, trainer.next_pairs())[0]
        state["certificate_next"] = next_step_record(s, first)
    if d.is_main:  # rank 0 writes trainer_state.json
        state["run"] = identity.record()
    if d.sharded:
        saved = ckpt.save_sharded_checkpoint(out, done, s.model, s.tokenizer, trainer.optimizer, trainer.scheduler,
                                             state, cfg, d, extra, plan=s.plan)
    else:
        saved = ckpt.save_checkpoint(out, done, s.model, s.tokenizer, trainer.optimizer, trainer.scheduler, state, cfg,
                                     extra, plan=s.plan)
    if d.is_main:
        ckpt.rotate(out, cfg.save_total_limit, evaluator.best.best_model_checkpoint, keep=saved)
    return saved


def resume_training(trainer: Trainer, out: Path, identity: RunIdentity) -> tuple[int, Path | None]:
    """Clean what a kill left behind, then load --resume_from_checkpoint (weights, optimizer, schedules, beta, the
    data position) into the trainer; returns the step it continues from and the checkpoint (0, None: a fresh run).
    Rank 0 picks the checkpoint (its content verified) and checks it was trained on this model, data and objective;
    every rank then loads it, and no run starts from NaN/Inf weights."""
    s, cfg, d = trainer.s, trainer.cfg, trainer.s.dist

    def choose() -> Path | None:
        ckpt.clean_partial(out)  # leftovers of a write or delete a kill interrupted
        chosen = ckpt.resolve_resume(cfg.resume_from_checkpoint, out, cfg.start_over_if_unusable,
                                     cfg.trust_unverified_checkpoint)
        if chosen is not None:
            ckpt.check_resume_step(chosen, s.total_steps)
            check_resume_identity(chosen, ckpt.load_progress(chosen).get("run"), ckpt.saved_config(chosen), identity)
        return chosen

    resume = decide_on_main(choose, d)
    if resume is None:
        check_finite(trainer, f"--model {cfg.model}", "before any training step. Check or re-download the model: "
                     "this is not a learning-rate problem")
        return 0, None
    model, optimizer, scheduler = s.model, trainer.optimizer, trainer.scheduler
    extra = {"reference": s.reference.model} if cfg.sync_ref_model else None
    check_resume_step_size(resume, cfg, d)
    if ckpt.is_sharded(resume):
        restore.load_sharded_checkpoint(resume, model, optimizer, scheduler, d.rank, extra)
    elif d.sharded:
        restore.load_unsharded_into_ranks(resume, model, optimizer, scheduler, extra)
    else:
        restore.load_weights(model, resume)
        restore.load_training_state(resume, optimizer, scheduler)
        if cfg.sync_ref_model:
            restore.load_extra_module(resume, "reference", s.reference.model)
    check_finite(trainer, str(resume), "as loaded (written that way, or edited since). Resume from an earlier "
                 "checkpoint by its path")
    follow_changed_schedule(resume, cfg, scheduler, s.total_steps, d)
    state = ckpt.load_progress(resume)
    start = state["step"]
    trainer.resume_record = state.get("certificate_next")
    s.beta.load_state_dict(state.get("beta", {}))
    if d.is_main:
        ckpt.truncate_metrics(out / "metrics.jsonl", start)
    log.info("Resumed from %s at step %d.", resume, start)
    if s.stream is not None:  # replay the stream's deterministic order up to the resume point
        s.stream.skip(start * trainer.pairs_per_step)
    trainer.global_step = start
    return start, resume


def check_finite(trainer: Trainer, source: str, advice: str) -> None:
    """Stop before training when the policy, its reference or the optimizer state hold NaN/Inf (on any rank)."""
    s = trainer.s
    modules = {"": s.model}
    if s.reference.model is not None and s.reference.model is not s.model:
        modules["reference "] = s.reference.model
    bad = restore.nonfinite_tensors(modules, trainer.optimizer)
    if any_rank(bool(bad), s.dist, s.device):
        shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "") if bad else "on another rank"
        raise FastDPOError(f"{source}: NaN/Inf values in {shown}, {advice}.")


def check_resume_step_size(resume: Path, cfg: TrainConfig, d: Dist) -> None:
    """The data order continues only if a step covers as many pairs, and an epoch as many steps, as when the
    checkpoint was written."""
    progress = ckpt.load_progress(resume)
    dropped = progress.get("drop_last")
    if dropped is not None and dropped != cfg.dataloader_drop_last and not cfg.streaming:
        raise FastDPOError(f"{resume} was written with --dataloader_drop_last {str(dropped).lower()}; the data order "
                           "continues only with the same setting (it decides the steps of an epoch). Set it back to "
                           "resume.")
    saved = progress.get("pairs_per_step")
    now = cfg.pairs_per_step * d.dp_size
    if saved is None or saved == now:
        return
    per_rank = cfg.per_device_train_batch_size * d.dp_size
    hint = (f" Use --gradient_accumulation_steps {saved // per_rank} with this world size." if saved % per_rank == 0
            else "")
    raise FastDPOError(
        f"{resume} was written with {saved} pairs per optimizer step; this run has {now} "
        f"(per_device_train_batch_size {cfg.per_device_train_batch_size} x gradient_accumulation_steps "
        f"{cfg.gradient_accumulation_steps} x {d.dp_size} {'data-parallel ' if d.sp_size > 1 else ''}ranks). Keep the "
        f"product equal to resume.{hint}"
    )


def follow_changed_schedule(resume: Path, cfg: TrainConfig, scheduler, total_steps: int, d: Dist) -> None:
    """A resume whose learning-rate flags differ from the checkpoint's follows the schedule they define from the
    resumed step on (optimizer state kept); the restored scheduler would otherwise go on with the saved one."""
    changes = schedule_changes(ckpt.saved_config(resume), cfg)
    if not changes:
        return
    follow_schedule(scheduler, cfg, total_steps)
    if d.is_main:
        named = ", ".join(f"--{name} {old} → {new}" for name, old, new in changes)
        log.warning("Resuming from %s with a changed learning-rate schedule (%s): after step %d, training follows "
                    "the schedule these flags define, with the saved optimizer state. Resume with the old values to "
                    "continue the saved schedule instead.", resume, named, scheduler.last_epoch)


def _progress_bar(console, total: int, start: int) -> RunProgress:
    """The run's progress: a bar on a terminal `console` (its rate is the run's, not the last window's); without
    one, only the counts behind the step lines' time left and the end-of-run summary."""
    return RunProgress(total, start, console)
