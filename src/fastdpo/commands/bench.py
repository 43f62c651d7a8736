"""`fastdpo bench`: throughput, MFU and peak memory of the real training step on the anchor workload, with TRL's
DPOTrainer side by side (`--compare trl`, `--compare trl-liger`) on the same rows in the same invocation.

The anchor workload: synthetic pairs whose lengths follow a real-world spread (log-normal; prompt mean ~303 tokens,
chosen ~385, rejected ~373, pair <= 2048 tokens), texts of words `t<id>` that a word-level tokenizer maps one to one
onto a 151,936-entry vocabulary (Qwen3's), so lengths are exact and nothing is downloaded.
"""

from __future__ import annotations

import gc
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from fastdpo.config import TrainConfig
from fastdpo.data.anchor import anchor_pairs, long_pair_rows
from fastdpo.data.load import Row
from fastdpo.data.prepare import DataOptions, tokenize_pairs
from fastdpo.errors import FastDPOError
from fastdpo.model.load import resolve_device, resolve_dtype
from fastdpo.model.shapes import bench_model
from fastdpo.observe.profile import synchronize
from fastdpo.training.measure import run_fastdpo
from fastdpo.training.setup import assemble, seed_all
from fastdpo.training.trainer import Trainer


def run_longest(cfg: TrainConfig, shape: str | None, lengths: list[int], out_json: str | None, console) -> list[dict]:
    """One full optimizer step on one pair of each length, shortest first, until one does not fit in GPU memory:
    the longest pair this model and these settings train."""

    lengths = sorted(lengths)
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.torch_dtype, device)
    seed_all(cfg.seed)
    cfg.max_length = max(cfg.max_length, lengths[-1] + 16)
    cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps = 1, 1
    tokenizer, model = bench_model(cfg, shape, device, dtype)
    rows = [long_pair_rows(n, len(tokenizer)) for n in lengths]
    pairs, _ = tokenize_pairs([Row(r["prompt"], r["chosen"], r["rejected"], f"pair of {n} tokens")
                               for n, r in zip(lengths, rows)], tokenizer, DataOptions.for_scoring(cfg))
    cfg.max_steps = len(pairs)
    trainer = Trainer(cfg, assemble(cfg, device, model, tokenizer, pairs))
    results = []
    for pair in pairs:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        try:
            trainer.step([pair])
            synchronize(device)
        except torch.OutOfMemoryError:
            trainer.optimizer.zero_grad(set_to_none=True)
            results.append({"pair_tokens": pair.num_tokens, "fits": False})
            break
        results.append({"pair_tokens": pair.num_tokens, "fits": True, "step_s": round(time.perf_counter() - t0, 2),
                        "peak_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
                        if device.type == "cuda" else None})
        print(f"pair of {pair.num_tokens} tokens: trains, {results[-1]}", file=sys.stderr, flush=True)
        gc.collect()
    if out_json:
        Path(out_json).write_text(json.dumps({"shape": shape, "model": cfg.model, "config": cfg.to_dict(),
                                              "env": environment(), "longest": results}, indent=1))
    if console is not None:
        from rich.table import Table

        table = Table(title="fastdpo bench --pair_tokens (prompt 1/2, chosen 1/4, rejected 1/4)")
        for col in ("pair tokens", "trains", "step s", "peak GiB"):
            table.add_column(col)
        for r in results:
            table.add_row(str(r["pair_tokens"]), "yes" if r["fits"] else "no (out of memory)",
                          str(r.get("step_s", "")), gib(r.get("peak_gib")) if r["fits"] else "")
        console.print(table)
    return results


TRL_SCRIPT = r'''
import json, sys, time, dataclasses, copy, torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, TrainerCallback
from trl import DPOConfig, DPOTrainer
sys.path.insert(0, sys.argv[1])
from fastdpo.model.shapes import shape_config
from fastdpo.data.anchor import anchor_tokenizer, anchor_pairs
shape, variant = sys.argv[2:4]
bs, steps, warm, n_rows = map(int, sys.argv[4:8])
torch.manual_seed(0)
cfg = shape_config(shape)
with torch.device("cuda"):
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
rows = anchor_pairs(n_rows)
kw = dict(output_dir="/tmp/trl_out", per_device_train_batch_size=bs, gradient_accumulation_steps=1,
          max_steps=steps + warm, learning_rate=1e-6, logging_steps=1000, save_strategy="no", report_to=[], bf16=True,
          max_length=2048, dataloader_num_workers=2, beta=0.1, gradient_checkpointing=True, remove_unused_columns=False,
          seed=0, use_liger_kernel=variant.endswith("liger"))
peft_config = None
if variant.startswith("lora"):
    from peft import LoraConfig
    peft_config = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
fields = {f.name for f in dataclasses.fields(DPOConfig)}
args = DPOConfig(**{k: v for k, v in kw.items() if k in fields})
times = []
class T(TrainerCallback):
    def on_step_end(self, a, s, c, **k):
        torch.cuda.synchronize(); times.append(time.perf_counter())
ref = None if peft_config else copy.deepcopy(model).eval()
tr = DPOTrainer(model=model, ref_model=ref, args=args, train_dataset=Dataset.from_list(rows[:bs * (steps + warm)]),
                processing_class=anchor_tokenizer(cfg.vocab_size), callbacks=[T()], peft_config=peft_config)
torch.cuda.reset_peak_memory_stats()
tr.train()
dt = times[-1] - times[warm - 1]
sel = rows[bs * warm: bs * (steps + warm)]
toks = sum(len(r["prompt"].split()) + len(r["chosen"].split()) + len(r["rejected"].split()) for r in sel)
print("RESULT " + json.dumps(dict(impl="trl-" + variant, pairs_per_s=round(bs * steps / dt, 2),
      tokens_per_s=round(toks / dt), peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2))), flush=True)
'''


def run_trl(shape: str, variant: str, bs: int, steps: int, warmup: int) -> dict:
    """TRL's DPOTrainer in a fresh process (its own memory peak), on the same rows."""
    src = str(Path(__file__).resolve().parents[2])
    n_rows = bs * (steps + warmup)
    proc = subprocess.run([sys.executable, "-c", TRL_SCRIPT, src, shape, variant, str(bs), str(steps), str(warmup),
                           str(n_rows)], capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = (proc.stdout + proc.stderr)[-2000:]
    return {"impl": "trl-" + variant, "error": tail}


def environment() -> dict:
    import transformers

    env = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
           "date": time.strftime("%Y-%m-%d")}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
    from fastdpo.observe.envinfo import compile_vars

    settings = compile_vars()  # e.g. TORCHINDUCTOR_CPP_WRAPPER=1: a different speed, so the result says so
    if settings:
        env["compile_env"] = settings
    try:
        import trl

        env["trl"] = trl.__version__
    except ImportError:
        pass
    return env


def gib(value: float | None) -> str:
    """A peak in GiB for the tables; n/a where none is measured (off CUDA)."""
    return "n/a" if value is None else str(value)


def print_table(console, results: list[dict]) -> None:
    from rich.table import Table

    table = Table(title="fastdpo bench")
    for col in ("impl", "pairs/s", "tokens/s", "MFU", "peak GiB", "vs fastdpo"):
        table.add_column(col)
    ours = next((r for r in results if r.get("impl") == "fastdpo" and "pairs_per_s" in r), None)
    for r in results:
        if "error" in r:
            table.add_row(r["impl"], "failed", "", "", "", "")
            continue
        ratio = f"{ours['pairs_per_s'] / r['pairs_per_s']:.2f}x" if ours and r is not ours else ""
        table.add_row(r["impl"], f"{r['pairs_per_s']:.2f}", str(r.get("tokens_per_s", "")),
                      f"{r['mfu']:.1%}" if r.get("mfu") else "", gib(r.get("peak_gib")), ratio)
    console.print(table)


def run_bench(cfg: TrainConfig, shape: str | None, steps: int, warmup: int, compare: list[str], dataset: list[str],
              out_json: str | None, console, profile_dir: str | None = None) -> list[dict]:
    if shape is None and not cfg.model:
        raise FastDPOError("fastdpo bench needs --shape NAME (random-init) or --model PATH.")
    n = cfg.pairs_per_step * (steps + warmup)
    if dataset:
        from fastdpo.data.columns import RowOptions
        from fastdpo.data.load import load_rows

        rows = [{"prompt": r.prompt, "chosen": r.chosen, "rejected": r.rejected}
                for r in load_rows(dataset, cfg.seed, read=RowOptions.from_config(cfg))]
        if len(rows) < n:
            raise FastDPOError(f"--dataset has {len(rows)} rows; the bench needs {n} (pairs per step x steps).")
    else:
        rows = anchor_pairs(n)
    results = [{**run_fastdpo(cfg, shape, rows, steps, warmup, profile_dir=profile_dir), "config": cfg.to_dict()}]
    gc.collect()  # free our model before TRL's process starts on the same GPU
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    for variant in compare:
        if dataset or shape is None:
            raise FastDPOError("--compare runs on the anchor workload with --shape only.")
        name = {"trl": "default", "trl-liger": "liger", "trl-lora": "lora", "trl-lora-liger": "lora_liger"}.get(variant)
        if name is None:
            raise FastDPOError(f"--compare {variant!r}: choose trl, trl-liger, trl-lora or trl-lora-liger.")
        results.append(run_trl(shape, name, cfg.pairs_per_step, steps, warmup))
    record = {"shape": shape, "model": cfg.model, "steps": steps, "warmup": warmup, "env": environment(),
              "results": results}
    if out_json:
        Path(out_json).write_text(json.dumps(record, indent=1))
    if console is not None:
        print_table(console, results)
        if "profile" in results[0]:
            console.print(f"Profile of two steps ({results[0]['profile']['dir']}): {results[0]['profile']['line']}.")
    return results
