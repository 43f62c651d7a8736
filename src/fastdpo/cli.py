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
