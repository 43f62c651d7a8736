"""The `fastdpo` command: subcommands map onto the config and the job functions; user errors become one message."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from fastdpo.config import TrainConfig, _Parser, add_config_flags, build_config
from fastdpo.errors import FastDPOError


def _console():
    from rich.console import Console

    return Console(stderr=False)


def _setup_logging(console) -> None:
    from rich.logging import RichHandler

    handler = RichHandler(console=console, show_path=False, show_time=False)
    logging.basicConfig(level=logging.INFO, format="%(message)s", handlers=[handler], force=True)
    for noisy in ("transformers", "torch", "peft", "httpx", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover
        pass


def cmd_train(args: argparse.Namespace, console) -> int:
    from fastdpo.train import train

    cfg = build_config(args, TrainConfig)
    result = train(cfg, console=console, progress=not cfg.disable_progress)
    console.print(f"[bold green]done[/]: final model in {result['final_dir']}")
    return 0


def cmd_check_data(args: argparse.Namespace, console) -> int:
    from fastdpo.data.check import run_check_data

    return run_check_data(build_config(args, TrainConfig), console)


def cmd_demo(args: argparse.Namespace, console) -> int:
    from fastdpo.demo import run_demo

    run_demo(args.output_dir, console=console, quick=args.quick)
    return 0


def cmd_bench(args: argparse.Namespace, console) -> int:
    from fastdpo.bench import run_bench

    cfg = build_config(args, TrainConfig)
    if args.shape:
        cfg.model = cfg.model or f"<random-init {args.shape}>"
    cfg.dataset = cfg.dataset or ["<anchor workload>"]
    cfg.validate()
    run_bench(cfg, args.shape, args.steps, args.warmup, args.compare, getattr(args, "dataset", None) or [], args.json, console)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="fastdpo", description="Fast, memory-lean DPO training on a packed, prefix-shared layout.",
                allow_abbrev=False)
    p.add_argument("--version", action="store_true", help="Print the version and exit.")
    sub = p.add_subparsers(dest="command", parser_class=_Parser)
    t = sub.add_parser("train", help="Train with DPO.", allow_abbrev=False)
    add_config_flags(t, TrainConfig)
    t.set_defaults(func=cmd_train)
    c = sub.add_parser("check-data", help="Check every dataset row; with --model, token lengths and what "
                       "--max_length would drop. Takes the train flags (and --config).", allow_abbrev=False)
    add_config_flags(c, TrainConfig)
    c.set_defaults(func=cmd_check_data)
    b = sub.add_parser("bench", help="Measure pairs/s, MFU and peak memory (optionally next to TRL).",
                       allow_abbrev=False)
    add_config_flags(b, TrainConfig)
    b.add_argument("--shape", help="Random-init shape: qwen3-0.6b, qwen3-1.7b, qwen3-8b, llama3-8b.")
    b.add_argument("--steps", type=int, default=20, help="Measured optimizer steps.")
    b.add_argument("--warmup", type=int, default=5, help="Warm-up steps (compilation, allocator).")
    b.add_argument("--compare", nargs="*", default=[], help="trl, trl-liger, trl-lora, trl-lora-liger.")
    b.add_argument("--json", help="Write the results and environment to this JSON file.")
    b.set_defaults(func=cmd_bench)
    d = sub.add_parser("demo", help="Train a built-in tiny model on CPU and show the result (no download).")
    d.add_argument("--output_dir", default="fastdpo-demo", help="Where the demo writes its model and plot.")
    d.add_argument("--quick", action="store_true", help="A shorter run (for tests).")
    d.set_defaults(func=cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    console = _console()
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        if args.version:
            from fastdpo import __version__

            console.print(f"fastdpo {__version__}")
            return 0
        if not getattr(args, "command", None):
            parser.print_help()
            return 2
        _setup_logging(console)
        return args.func(args, console)
    except FastDPOError as e:
        console.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
        return 1
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]")
        return 130


if __name__ == "__main__":
    sys.exit(main())
