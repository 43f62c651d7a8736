"""The `fastdpo` command: subcommands map onto the config and the job functions; user errors become one message."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings

from fastdpo.config import TrainConfig, add_config_flags, build_config
from fastdpo.config.fields import parse_bool
from fastdpo.config.flags import Parser, typed_flags
from fastdpo.config.launch import WORLD_FIELDS, check_world, wants_launch, world_size
from fastdpo.data.anchor import WORKLOADS
from fastdpo.errors import FastDPOError
from fastdpo.observe.streams import guard_std_streams
from fastdpo.parallel.launch import launch


def _console():
    """The rich console on stdout. Off a terminal (nohup, CI, `> train.log`) rich would hard-wrap every line at 80
    columns: there, printed text is never wrapped (soft_wrap), so a log keeps one line per step at any width."""
    from rich.console import Console

    console = Console(stderr=False)
    if not console.is_terminal:
        console.soft_wrap = True
    return console


class _PlainHandler(logging.Handler):
    """Log records as `LEVEL    message` lines through the console, unwrapped: RichHandler's layout off a terminal
    is a table as wide as the console, wrapped and padded to it."""

    def __init__(self, console):
        super().__init__()
        self.console = console

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.console.print(f"{record.levelname:<8} {self.format(record)}", markup=False, highlight=False,
                               soft_wrap=True)
        except Exception:  # a log line must never stop the run
            self.handleError(record)


def _setup_logging(console) -> None:
    from rich.logging import RichHandler

    if console.is_terminal:
        handler = RichHandler(console=console, show_path=False, show_time=False)
    else:
        handler = _PlainHandler(console)
    logging.basicConfig(level=logging.INFO, format="%(message)s", handlers=[handler], force=True)
    for noisy in ("transformers", "torch", "peft", "httpx", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover
        pass


def cmd_train(args: argparse.Namespace, console) -> int:
    import torch

    from fastdpo.observe.diagnostics import oom_error
    from fastdpo.training.loop import train

    cfg = build_config(args, TrainConfig)
    check_world(cfg, world_size(), typed_flags(args, WORLD_FIELDS))  # under torchrun: the flags as typed
    try:
        result = train(cfg, console=console, progress=not cfg.disable_progress, keep_model=False)
    except torch.OutOfMemoryError as e:  # while loading (the loop explains its own)
        raise oom_error(e, cfg, torch.device("cuda") if torch.cuda.is_available() else None) from None
    if result.stopped:
        if _rank() == 0:
            console.print(f"[yellow]stopped[/] by {result.stopped}: checkpoint in {result.checkpoint}; "
                          "continue with --resume_from_checkpoint latest", highlight=False)
        return result.exit_code
    if _rank() == 0:
        console.print(f"[bold green]done[/]: final model in {result.final_dir}")
    return 0


def cmd_check_data(args: argparse.Namespace, console) -> int:
    from fastdpo.commands.check_data import run_check_data

    return run_check_data(build_config(args, TrainConfig), console)


def cmd_precompute_ref(args: argparse.Namespace, console) -> int:
    from fastdpo.commands.precompute import precompute_ref

    result = precompute_ref(build_config(args, TrainConfig))
    how = "reused" if result["reused"] else "computed"
    console.print(f"[bold green]done[/]: reference log-probs of {result['pairs']} pairs {how}: {result['path']}")
    return 0


def cmd_infer(args: argparse.Namespace, console) -> int:
    from fastdpo.commands.infer import InferConfig, run_infer

    run_infer(build_config(args, InferConfig), console=console)
    return 0


def cmd_eval(args: argparse.Namespace, console) -> int:
    from fastdpo.commands.evaluate import EvalConfig, run_eval

    run_eval(build_config(args, EvalConfig), console=console)
    return 0


def cmd_export(args: argparse.Namespace, console) -> int:
    from fastdpo.commands.export import ExportConfig, merge_lora

    merge_lora(build_config(args, ExportConfig), console=console)
    return 0


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def cmd_demo(args: argparse.Namespace, console) -> int:
    from fastdpo.commands.demo import run_demo

    run_demo(args.output_dir, console=console, quick=args.quick)
    return 0


def cmd_plot(args: argparse.Namespace, console) -> int:
    from fastdpo.observe.plot import write_dashboard

    console.print(f"dashboard: {write_dashboard(args.output_dir, args.out)}", highlight=False)
    return 0


def cmd_verify(args: argparse.Namespace, console) -> int:
    import json

    if args.run:
        from fastdpo.commands.verify_run import print_saved, verify_saved_run

        cert = verify_saved_run(args.run, "" if args.device == "auto" else args.device, args.torch_dtype or "")
        print_saved(cert, console, args.run)
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(cert.to_dict(), f, indent=1)
        return 0 if cert.status != "FAIL" else 1
    if not args.model or not args.dataset:
        raise FastDPOError("fastdpo verify needs --model and --dataset (a model and data to check the fast paths on), "
                           "or --run DIR (a finished run's certificate checked again on its saved model).")
    from fastdpo.commands.verify import print_results, results_json, run_verify

    policies = tuple(p.strip() for p in args.policies.split(",") if p.strip())
    results = run_verify(args.model, args.dataset, args.pairs, args.max_length, args.device, args.torch_dtype or "float32",
                         args.tolerance, policies, args.compile, args.seed, args.trust_remote_code, args.template,
                         args.system)
    print_results(results, console, cuda=results[0].peak_mib is not None)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results_json(results), f, indent=1)
    return 0 if all(r.passed for r in results) else 1


def cmd_env(args: argparse.Namespace, console) -> int:
    import json

    from fastdpo.observe.envinfo import collect, print_env

    info = collect()
    if args.json:
        console.print_json(json.dumps(info))
    else:
        print_env(info, console)
    return 0


def cmd_bench(args: argparse.Namespace, console) -> int:
    from fastdpo.commands.bench import run_bench

    cfg = build_config(args, TrainConfig)
    if args.shape:
        cfg.model = cfg.model or f"<random-init {args.shape}>"
    cfg.dataset = cfg.dataset or ["<anchor workload>"]
    cfg.validate()
    if args.pair_tokens:
        from fastdpo.commands.bench import run_longest

        if args.compare:
            raise FastDPOError("--pair_tokens probes the longest pair on fastdpo alone; drop --compare.")
        run_longest(cfg, args.shape, args.pair_tokens, args.json, console)
        return 0
    if args.job:
        from fastdpo.commands.bench import run_jobs

        if getattr(args, "dataset", None) or args.profile:
            raise FastDPOError("--job writes its own model dir and rows (--shape, --workload, --rows); drop "
                               "--dataset and --profile.")
        results = run_jobs(cfg, args.shape, args.rows, args.compare, args.workload, args.json, console, args.job_dir)
        return 0 if all(r.get("rc") == 0 for r in results) else 1
    run_bench(cfg, args.shape, args.steps, args.warmup, args.compare, getattr(args, "dataset", None) or [], args.json,
              console, args.profile, args.workload)
    return 0


def cmd_tune(args: argparse.Namespace, console) -> int:
    from fastdpo.commands.tune import run_tune
    from fastdpo.data.anchor import anchor_pairs
    from fastdpo.data.columns import RowOptions
    from fastdpo.data.load import load_rows

    cfg = build_config(args, TrainConfig)
    if args.shape:
        cfg.model = cfg.model or f"<random-init {args.shape}>"
    if not cfg.dataset and not args.shape:
        raise FastDPOError("fastdpo tune needs --dataset (your data) or --shape (the anchor workload).")
    n = cfg.pairs_per_step * (args.steps + args.warmup)
    if cfg.dataset:
        rows = [{"prompt": r.prompt, "chosen": r.chosen, "rejected": r.rejected}
                for r in load_rows(cfg.dataset, cfg.seed, read=RowOptions.from_config(cfg))]
        rows = (rows * (n // len(rows) + 1))[:n]
    else:
        rows = anchor_pairs(n)
        cfg.dataset = ["<anchor workload>"]
    cfg.gradient_checkpointing = "none"
    cfg.validate()
    run_tune(cfg, rows, args.policies, args.budgets, args.steps, args.warmup, cfg.max_memory_gib, args.json, console,
             args.shape)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="fastdpo", description="Fast, memory-lean DPO training on a packed, prefix-shared layout.",
                allow_abbrev=False)
    p.add_argument("--version", action="store_true", help="Print the version and exit.")
    sub = p.add_subparsers(dest="command", parser_class=Parser)
    t = sub.add_parser("train", help="Train with DPO.", allow_abbrev=False)
    add_config_flags(t, TrainConfig)
    t.set_defaults(func=cmd_train)
    c = sub.add_parser("check-data", help="Check every dataset row; with --model, token lengths and what "
                       "--max_length would drop. Takes the train flags (and --config).", allow_abbrev=False)
    add_config_flags(c, TrainConfig)
    c.set_defaults(func=cmd_check_data)
    r = sub.add_parser("precompute-ref", help="Cache reference log-probs ahead of training (same flags as train).",
                       allow_abbrev=False)
    add_config_flags(r, TrainConfig)
    r.set_defaults(func=cmd_precompute_ref)
    b = sub.add_parser("bench", help="Measure pairs/s, MFU and peak memory (optionally next to TRL).",
                       allow_abbrev=False)
    add_config_flags(b, TrainConfig)
    b.add_argument("--shape", help="Random-init shape: qwen3-0.6b, qwen3-1.7b, qwen3-8b, llama3-8b.")
    b.add_argument("--steps", type=int, default=20, help="Measured optimizer steps.")
    b.add_argument("--warmup", type=int, default=5, help="Warm-up steps (compilation, allocator).")
    b.add_argument("--compare", nargs="*", default=[], help="trl, trl-liger, trl-lora, trl-lora-liger: TRL's DPOTrainer "
                   "on the same rows, with the same reference strategy (precomputed when --precompute_ref_log_probs).")
    b.add_argument("--workload", default="anchor", choices=sorted(WORKLOADS),
                   help="Built-in rows (no --dataset): anchor (prompt ~317 tokens, completions ~380), long-prompt "
                        "(~1,680 / ~210, pairs <= 4096), long-answer (~77 / ~960, pairs <= 4096), grouped (4 pairs "
                        "per prompt: prompt ~660, one chosen and 4 rejected ~340).")
    b.add_argument("--job", action="store_true", help="Time to result: time whole jobs, from process start to saved "
                   "model, each in a fresh process with empty compile caches (fastdpo train with these flags, then "
                   "each --compare side), on a model dir of --shape and --rows rows of --workload.")
    b.add_argument("--rows", type=int, default=600, help="--job: rows the jobs train on (one epoch).")
    b.add_argument("--job_dir", help="--job: an empty directory for the model dir, rows and logs (kept); default: a "
                   "temporary one whose logs are kept.")
    b.add_argument("--json", help="Write the results and environment to this JSON file.")
    b.add_argument("--profile", metavar="DIR", help="After the measured steps, profile two more steps: a Chrome trace "
                   "(DIR/trace.json), the operators and kernels that took the most time (DIR/top.txt) and how the "
                   "device's time split into compute, exposed communication and idle (DIR/summary.json).")
    b.add_argument("--pair_tokens", nargs="*", type=int, default=[],
                   help="Longest-pair probe: one optimizer step on one pair of each of these lengths (prompt half, "
                        "completions a quarter each), until one runs out of GPU memory.")
    b.set_defaults(func=cmd_bench)
    _after_training_commands(sub)
    tn = sub.add_parser("tune", help="Measure checkpointing policies x token budgets; pick the fastest that fits.",
                        allow_abbrev=False)
    add_config_flags(tn, TrainConfig)
    tn.add_argument("--shape", help="Random-init shape instead of --model (anchor workload).")
    tn.add_argument("--policies", nargs="+", default=["none", "ffn", "attn", "full"],
                    help="Checkpointing policies to try: none, full, ffn, attn, every:K, keep:N (true = full, false = none).")
    tn.add_argument("--budgets", nargs="+", type=int, default=[2048, 4096, 8192], help="Token budgets to try.")
    tn.add_argument("--steps", type=int, default=3, help="Measured steps per candidate.")
    tn.add_argument("--warmup", type=int, default=1, help="Warm-up steps per candidate.")
    tn.add_argument("--json", help="Write the table and the choice to this JSON file.")
    tn.set_defaults(func=cmd_tune)
    d = sub.add_parser("demo", help="Train a built-in tiny model on CPU and show the result (no download).")
    d.add_argument("--output_dir", default="fastdpo-demo", help="Where the demo writes its model and plot.")
    d.add_argument("--quick", action="store_true", help="A shorter run (for tests).")
    d.set_defaults(func=cmd_demo)
    pl = sub.add_parser("plot", help="Draw a run's dashboard (loss, rewards, KL, grad norm, lr, speed, memory) as PNG.")
    pl.add_argument("output_dir", help="The --output_dir of a training run (holds metrics.jsonl).")
    pl.add_argument("--out", default=None, help="PNG path (default: OUTPUT_DIR/metrics.png).")
    pl.set_defaults(func=cmd_plot)
    v = sub.add_parser("verify", help="Check that every fast path and checkpointing policy gives the plain gradients; "
                       "or, with --run, a finished run's certificate on its saved model.", allow_abbrev=False)
    v.add_argument("--run", default="", metavar="DIR",
                   help="The --output_dir of a finished training run: check its certificate again on the saved model "
                        "(its recorded pairs' log-probs, fast path, float32 head, reference); --device and "
                        "--torch_dtype (default: the run's) apply, the other flags do not.")
    v.add_argument("--model", default="", help="Local HF model dir or hub id.")
    v.add_argument("--dataset", default=None, nargs="+", help="JSONL/JSON files with prompt/chosen/rejected.")
    v.add_argument("--pairs", type=int, default=8, help="Pairs in the verified batch (the first N rows).")
    v.add_argument("--max_length", type=int, default=512, help="Max tokens per sequence.")
    v.add_argument("--device", default="auto", help="auto|cpu|cuda|cuda:N.")
    v.add_argument("--torch_dtype", default=None,
                   help="float32 (default; with --run: the run's)|bfloat16|float16: the paths run in it; the reference "
                        "runs in float32.")
    v.add_argument("--tolerance", type=float, default=None,
                   help="Max relative gradient difference to the float32 plain path (default: 2 x the plain path's "
                        "own error in --torch_dtype, at least 1e-4 / 3e-2 / 1e-2 for float32 / bfloat16 / float16).")
    v.add_argument("--policies", default="full,ffn,attn,every:2",
                   help="Checkpointing policies to verify, comma-separated: none, full, ffn, attn, every:K "
                        "(true = full, false = none).")
    v.add_argument("--compile", type=parse_bool, nargs="?", const=True, default=None, metavar="BOOL",
                   help="Also verify compiled decoder layers, as --torch_compile trains (default: on CUDA only).")
    v.add_argument("--seed", type=int, default=42, help="Seed for `path#N` sampling.")
    v.add_argument("--trust_remote_code", action="store_true", help="Allow model code from the model dir / hub.")
    v.add_argument("--template", default="", help="Chat template for conversational rows, as in training.")
    v.add_argument("--system", default="", help="System prompt for conversational rows that have none.")
    v.add_argument("--json", default=None, help="Also write the results to this JSON file.")
    v.set_defaults(func=cmd_verify)
    e = sub.add_parser("env", help="Versions, GPUs and the NCCL variables that matter, with advice.")
    e.add_argument("--json", action="store_true", help="Print JSON.")
    e.set_defaults(func=cmd_env)
    return p


def _after_training_commands(sub) -> None:
    from fastdpo.commands.evaluate import EvalConfig
    from fastdpo.commands.export import ExportConfig
    from fastdpo.commands.infer import InferConfig

    for name, cls, func, text in (
        ("infer", InferConfig, cmd_infer, "Generate with a trained model (streamed; --compare: base vs tuned)."),
        ("eval", EvalConfig, cmd_eval, "Evaluate on held-out pairs, with a reward function, and lm-eval tasks."),
        ("export", ExportConfig, cmd_export, "Merge a LoRA adapter into its base model (--merge_lora)."),
    ):
        p = sub.add_parser(name, help=text, allow_abbrev=False)
        add_config_flags(p, cls)
        p.set_defaults(func=func)


# warnings from inside the libraries that no flag of ours can act on (peft reads a property transformers deprecated)
LIBRARY_NOISE = (r"`is_gradient_checkpointing` is deprecated",)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    for text in LIBRARY_NOISE:
        warnings.filterwarnings("ignore", message=text, category=FutureWarning)
    guard_std_streams()  # a reader that goes away (`| tee` ended by the same Ctrl-C) never ends the run
    console = _console()
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        if args.version:
            from fastdpo.version import __version__

            console.print(f"fastdpo {__version__}")
            return 0
        if not getattr(args, "command", None):
            parser.print_help()
            return 2
        _setup_logging(console)
        if args.command == "train" and wants_launch():  # NPROC_PER_NODE=N fastdpo train ...: start N workers
            # bad flags fail here once, before any worker starts, not once per worker
            return launch(sys.argv[1:] if argv is None else list(argv), build_config(args, TrainConfig),
                          typed_flags(args, WORLD_FIELDS))
        return args.func(args, console)
    except FastDPOError as e:
        where = f"[rank {_rank()}] " if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
        console.print(f"[bold red]error:[/] {where}{e}", highlight=False, soft_wrap=True)
        return 1
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]")
        return 130


if __name__ == "__main__":
    sys.exit(main())
