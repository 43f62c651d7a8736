"""`fastdpo bench`: throughput, MFU and peak memory of the real training step (`Trainer.step`), with TRL's
DPOTrainer side by side (`--compare trl`, `--compare trl-liger`, ...) on the same rows, with the same reference
strategy (TRL precomputes its reference when fastdpo does), in the same invocation. `--job` times whole jobs
instead: each side from process start to saved model, in a fresh process with empty compile caches. With an unpaired
loss (`--loss_type kto`), TRL's side is its KTOTrainer, both sides taking the workload's pairs as two unpaired rows
each (TRL's unpairing) and a step of --per_device_train_batch_size rows.

Workloads (`--workload`, `fastdpo.data.anchor.WORKLOADS`): synthetic pairs with log-normal lengths, texts of words
`t<id>` that a word-level tokenizer maps one to one onto a 151,936-entry vocabulary (Qwen3's), so lengths are exact
and nothing is downloaded. `anchor` (prompt mean ~317 tokens, chosen ~380, rejected ~377), `long-prompt` (~1,680 /
~210 / ~215, pair <= 4096), `long-answer` (~77 / ~985 / ~940, pair <= 4096) and `grouped` (4 consecutive pairs per
prompt: prompt ~660 tokens, at least 500; one chosen ~345 against 4 rejected ~330).
"""

from __future__ import annotations

import dataclasses
import gc
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from fastdpo.config import TrainConfig
from fastdpo.data.anchor import long_pair_rows, workload_max_length, workload_pairs
from fastdpo.data.load import Row
from fastdpo.data.prepare import DataOptions, tokenize_pairs
from fastdpo.errors import FastDPOError
from fastdpo.model.load import resolve_device, resolve_dtype
from fastdpo.model.shapes import bench_model
from fastdpo.observe.profile import synchronize
from fastdpo.training.measure import brief_of, certificate_line, run_fastdpo
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
    trainer = Trainer(cfg, assemble(cfg, device, model, tokenizer, pairs, steps=[[p] for p in pairs]))
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
import json, sys, time, copy, torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, TrainerCallback
from trl import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer
sys.path.insert(0, sys.argv[1])
from fastdpo.model.shapes import shape_config
from fastdpo.data.anchor import anchor_tokenizer, workload_pairs
shape, variant = sys.argv[2:4]
bs, steps, warm, n_rows = map(int, sys.argv[4:8])
workload, max_length, precompute = sys.argv[8], int(sys.argv[9]), sys.argv[10] == "1"
adapter = json.loads(sys.argv[11])  # fastdpo's LoRA settings: rank, alpha, dropout, targets
kto = sys.argv[12] == "kto"  # KTOTrainer on the pairs unpaired (as it unpairs them): n_rows rows from n_rows/2 pairs
torch.manual_seed(0)
cfg = shape_config(shape)
with torch.device("cuda"):
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
rows = workload_pairs(workload, -(-n_rows // 2) if kto else n_rows)
if kto:
    DPOConfig, DPOTrainer = KTOConfig, KTOTrainer
from fastdpo.commands.bench import in_row_order, trl_steady_args
args = trl_steady_args(DPOConfig, bs, steps + warm, max_length, variant, precompute, bf16=True)
peft_config = None
if variant.startswith("lora"):
    from peft import LoraConfig
    peft_config = LoraConfig(**adapter, task_type="CAUSAL_LM")
times = []
class T(TrainerCallback):
    def on_step_end(self, a, s, c, **k):
        torch.cuda.synchronize(); times.append(time.perf_counter())
ref = None if peft_config else copy.deepcopy(model).eval()
train_rows = rows if kto else rows[:bs * (steps + warm)]
tr = DPOTrainer(model=model, ref_model=ref, args=args, train_dataset=Dataset.from_list(train_rows),
                processing_class=anchor_tokenizer(cfg.vocab_size), callbacks=[T()], peft_config=peft_config)
in_row_order(tr)
torch.cuda.reset_peak_memory_stats()
tr.train()
dt = times[-1] - times[warm - 1]
sel = rows[bs * warm: bs * (steps + warm)]
toks = sum(len(r["prompt"].split()) + len(r["chosen"].split()) + len(r["rejected"].split()) for r in sel)
if kto:  # tokens of the timed rows: prompt + completion each, KL sequences not counted
    data = list(tr.train_dataset)[bs * warm: bs * (steps + warm)]
    toks = sum(len(r["prompt_ids"]) + len(r["completion_ids"]) for r in data)
print("RESULT " + json.dumps(dict(impl=("trl-kto-" if kto else "trl-") + variant + ("-precompute" if precompute else ""),
      reference="precomputed" if precompute else ("adapter_off" if peft_config else "online"),
      pairs_per_s=round(bs * steps / dt, 2),
      tokens_per_s=round(toks / dt), peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2))), flush=True)
'''


def trl_steady_args(config_cls, bs: int, max_steps: int, max_length: int, variant: str, precompute: bool,
                    bf16: bool, output_dir: str = "/tmp/trl_out"):
    """TRL's DPOConfig for the steady-state comparison: its defaults where fastdpo's match them (beta 0.1, gradient
    checkpointing on), `bs` pairs per step, nothing saved or logged, and the rows in order (see `in_row_order`).
    Fields this TRL does not have are left out."""
    kw = dict(output_dir=output_dir, per_device_train_batch_size=bs, gradient_accumulation_steps=1,
              max_steps=max_steps, learning_rate=1e-6, logging_steps=1000, save_strategy="no", report_to=[], bf16=bf16,
              max_length=max_length, dataloader_num_workers=2 if bf16 else 0, beta=0.1, gradient_checkpointing=True,
              remove_unused_columns=False, seed=0, use_liger_kernel=variant.endswith("liger"),
              precompute_ref_log_probs=precompute, train_sampling_strategy="sequential")
    fields = {f.name for f in dataclasses.fields(config_cls)}
    return config_cls(**{k: v for k, v in kw.items() if k in fields})


def in_row_order(trainer) -> None:
    """TRL's steps take the rows in order, `bs` at a time: the same pairs in the same steps as fastdpo's timed steps,
    so each side pads (TRL) or packs (fastdpo) the same batches. A shuffled order made TRL's rate over a few steps
    depend on which rows fell together (4.8 to 7.8 pairs/s on the anchor rows). transformers without
    `train_sampling_strategy` gets a sequential sampler on the trainer instance."""
    if getattr(trainer.args, "train_sampling_strategy", None) == "sequential":
        return
    trainer._get_train_sampler = lambda *a, **k: torch.utils.data.SequentialSampler(trainer.train_dataset)


def trl_adapter(cfg: TrainConfig) -> str:
    """fastdpo's LoRA settings as PEFT's LoraConfig arguments (JSON), so TRL's side trains the same adapter: rank,
    alpha, dropout and target modules."""
    t = cfg.target_modules
    targets = None if t == "default" else t if t == "all-linear" else [m.strip() for m in t.split(",")]
    return json.dumps({"r": cfg.lora_rank, "lora_alpha": cfg.lora_alpha, "lora_dropout": cfg.lora_dropout,
                       "target_modules": targets})


def run_trl(shape: str, variant: str, bs: int, steps: int, warmup: int, workload: str = "anchor",
            max_length: int = 2048, precompute: bool = False, adapter: str = "{}", kto: bool = False) -> dict:
    """TRL's DPOTrainer in a fresh process (its own memory peak), on the same rows, with its reference precomputed
    (`precompute_ref_log_probs`, before the timed steps as fastdpo's is) when `precompute`; `adapter`: LoRA's
    settings (`trl_adapter`) for a LoRA variant. With `kto`, its KTOTrainer on the same pairs, which it unpairs
    as fastdpo does (a step of `bs` rows)."""
    src = str(Path(__file__).resolve().parents[2])
    n_rows = bs * (steps + warmup)
    proc = subprocess.run([sys.executable, "-c", TRL_SCRIPT, src, shape, variant, str(bs), str(steps), str(warmup),
                           str(n_rows), workload, str(max_length), "1" if precompute else "0", adapter,
                           "kto" if kto else "dpo"], capture_output=True, text=True)
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
    try:  # its version from the installed metadata: importing TRL takes seconds
        env["trl"] = importlib.metadata.version("trl")
    except importlib.metadata.PackageNotFoundError:
        pass
    return env


def gib(value: float | None) -> str:
    """A peak in GiB for the tables; n/a where none is measured (off CUDA)."""
    return "n/a" if value is None else str(value)


def print_table(console, results: list[dict], unit: str = "pairs") -> None:
    """The results side by side; `unit`: what a step's examples are (pairs, or an unpaired loss's rows)."""
    from rich.table import Table

    table = Table(title="fastdpo bench")
    for col in ("impl", f"{unit}/s", "tokens/s", "MFU", "peak GiB", "vs fastdpo"):
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


TRL_VARIANTS = {"trl": "default", "trl-liger": "liger", "trl-lora": "lora", "trl-lora-liger": "lora_liger"}


def trl_variant(name: str, cfg: TrainConfig) -> str:
    """The TRL harness's variant for a --compare name; LoRA on one side means LoRA on both."""
    variant = TRL_VARIANTS.get(name)
    if variant is None:
        raise FastDPOError(f"--compare {name!r}: choose {', '.join(TRL_VARIANTS)}.")
    if cfg.uses_lora != variant.startswith("lora"):
        raise FastDPOError(f"--compare {name}: fastdpo trains {'LoRA' if cfg.uses_lora else 'all weights'} here, so "
                           f"compare with {'trl-lora-liger' if cfg.uses_lora else 'trl-liger'} (like for like).")
    return variant


def run_bench(cfg: TrainConfig, shape: str | None, steps: int, warmup: int, compare: list[str], dataset: list[str],
              out_json: str | None, console, profile_dir: str | None = None, workload: str = "anchor") -> list[dict]:
    if shape is None and not cfg.model:
        raise FastDPOError("fastdpo bench needs --shape NAME (random-init) or --model PATH.")
    n = cfg.pairs_per_step * (steps + warmup)
    if dataset:
        from fastdpo.data.columns import RowOptions
        from fastdpo.data.load import load_rows

        read = load_rows(dataset, cfg.seed, read=RowOptions.from_config(cfg))
        if any(r.unpaired for r in read):
            raise FastDPOError("fastdpo bench --dataset takes pairs (an unpaired loss trains them unpaired, as TRL's "
                               "KTOTrainer does); these rows are unpaired.")
        rows = [{"prompt": r.prompt, "chosen": r.chosen, "rejected": r.rejected} for r in read]
        n = -(-n // 2) if cfg.trains_unpaired() else n
        if len(rows) < n:
            raise FastDPOError(f"--dataset has {len(rows)} rows; the bench needs {n} (pairs per step x steps).")
    else:  # an unpaired loss (KTO) takes each pair as two rows, as TRL's KTOTrainer unpairs it
        rows = workload_pairs(workload, -(-n // 2) if cfg.trains_unpaired() else n)
        cfg.max_length = max(cfg.max_length, workload_max_length(workload))
    variants = [trl_variant(v, cfg) for v in compare]
    if variants and (dataset or shape is None):
        raise FastDPOError("--compare runs on the built-in workloads with --shape only.")
    results = [{**run_fastdpo(cfg, shape, rows, steps, warmup, profile_dir=profile_dir), "config": cfg.to_dict()}]
    gc.collect()  # free our model before TRL's process starts on the same GPU
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    for variant in variants:
        results.append(run_trl(shape, variant, cfg.pairs_per_step, steps, warmup, workload, cfg.max_length,
                               cfg.precompute_ref_log_probs, trl_adapter(cfg), kto=cfg.trains_unpaired()))
    record = {"shape": shape, "model": cfg.model, "workload": None if dataset else workload, "steps": steps,
              "warmup": warmup, "env": environment(), "results": results}
    if out_json:
        Path(out_json).write_text(json.dumps(record, indent=1))
    if console is not None:
        print_table(console, results, "rows" if cfg.trains_unpaired() else "pairs")
        if (line := host_line(results[0])) is not None:
            console.print(line)
        if "certificate" in results[0]:
            console.print(certificate_line(results[0]["certificate"]), highlight=False)
        if "profile" in results[0]:
            console.print(f"Profile of two steps ({results[0]['profile']['dir']}): {results[0]['profile']['line']}.")
    return results


def host_line(result: dict) -> str | None:
    """fastdpo's step seen from the host: how long it took to queue, how long it then waited for the device, and
    which of the two set the pace."""
    queue, wait = result.get("host_queue_ms"), result.get("device_wait_ms")
    if queue is None or wait is None:
        return None
    pace = ("the CPU set the pace: the device finished as the host did" if wait < 0.05 * queue else
            "the device set the pace")
    return (f"fastdpo's step (median): the host queued it in {queue:.1f} ms, then waited {wait:.1f} ms for the "
            f"device; {pace}.")


# ---------------------------------------------------------------- whole jobs (time to result)


TRL_JOB = r'''
import time
t0 = time.perf_counter()
import copy, json, sys, torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import DPOConfig, DPOTrainer
model_dir, rows_path, out, variant = sys.argv[1:5]
bs, accum, max_length, precompute = int(sys.argv[5]), int(sys.argv[6]), int(sys.argv[7]), sys.argv[8] == "1"
lr, beta = float(sys.argv[9]), float(sys.argv[10])
adapter = json.loads(sys.argv[11])  # fastdpo's LoRA settings: rank, alpha, dropout, targets
cuda = torch.cuda.is_available()
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16 if cuda else torch.float32,
                                             attn_implementation="sdpa")
if cuda:
    model = model.cuda()
peft_config = None
if variant.startswith("lora"):
    from peft import LoraConfig
    peft_config = LoraConfig(**adapter, task_type="CAUSAL_LM")
ref = None if peft_config else copy.deepcopy(model).eval()
rows = [json.loads(line) for line in open(rows_path)]
args = DPOConfig(output_dir=out, per_device_train_batch_size=bs, gradient_accumulation_steps=accum, num_train_epochs=1,
                 learning_rate=lr, beta=beta, logging_steps=10, save_strategy="no", report_to=[], bf16=cuda,
                 max_length=max_length, dataloader_num_workers=2 if cuda else 0, gradient_checkpointing=True, seed=0,
                 use_liger_kernel=variant.endswith("liger"), precompute_ref_log_probs=precompute,
                 use_cpu=not cuda)
trainer = DPOTrainer(model=model, ref_model=ref, args=args, train_dataset=Dataset.from_list(rows),
                     processing_class=AutoTokenizer.from_pretrained(model_dir), peft_config=peft_config)
if cuda:
    torch.cuda.reset_peak_memory_stats()
result = trainer.train()
trainer.save_model(out + "/final")
print("RESULT " + json.dumps(dict(impl="trl-" + variant + ("-precompute" if precompute else ""), pairs=len(rows),
      in_process_s=round(time.perf_counter() - t0, 1), train_runtime=round(result.metrics["train_runtime"], 2),
      peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None)), flush=True)
'''


def write_job_inputs(shape: str, workload: str, n_rows: int, work: Path, device: torch.device) -> tuple[Path, Path]:
    """A random-init model dir of `shape` (with the word tokenizer) and `n_rows` rows of `workload` as JSONL: what
    both jobs load, as a user's model and data."""
    from transformers import AutoModelForCausalLM

    from fastdpo.data.anchor import anchor_tokenizer
    from fastdpo.model.shapes import shape_config

    config = shape_config(shape)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model_dir, rows = work / "model", work / "rows.jsonl"
    model.save_pretrained(model_dir)
    anchor_tokenizer(config.vocab_size).save_pretrained(model_dir)
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    with open(rows, "w", encoding="utf-8") as f:
        for row in workload_pairs(workload, n_rows, config.vocab_size):
            f.write(json.dumps(row) + "\n")
    return model_dir, rows


def cold_env(work: Path, name: str) -> dict:
    """The environment of one job: empty compile caches of its own (a machine that never compiled this model)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    env["TORCHINDUCTOR_CACHE_DIR"] = str(work / f"inductor-{name}")
    env["TRITON_CACHE_DIR"] = str(work / f"triton-{name}")
    src = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([src, env["PYTHONPATH"]]) if env.get("PYTHONPATH") else src
    return env


def timed_job(argv: list[str], env: dict, log_path: Path, limit_s: float | None) -> dict:
    """Run one job to its end; wall time from process start to exit, and its exit status."""
    t0 = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as log_file:
        try:
            rc = subprocess.run(argv, env=env, stdout=log_file, stderr=subprocess.STDOUT, timeout=limit_s).returncode
        except subprocess.TimeoutExpired:
            rc = None
    return {"wall_s": round(time.perf_counter() - t0, 1), "rc": rc, "log": str(log_path)}


def fastdpo_job(cfg: TrainConfig, model_dir: Path, rows: Path, work: Path, limit_s: float | None) -> dict:
    """`fastdpo train` on the job's model and rows with the bench's training flags, one epoch."""
    from fastdpo.config import save_config

    out = work / "out-fastdpo"
    job_cfg = dataclasses.replace(cfg, model=str(model_dir), dataset=[str(rows)], output_dir=str(out),
                                  num_train_epochs=1.0, max_steps=-1 if cfg.max_steps < 0 else 0)
    config = work / "fastdpo-job.yaml"
    save_config(job_cfg, config)
    argv = [sys.executable, "-m", "fastdpo", "train", "--config", str(config)]
    rec = {"impl": "fastdpo", **timed_job(argv, cold_env(work, "fastdpo"), work / "fastdpo.log", limit_s)}
    summary = out / "summary.json"
    if summary.exists():
        run = json.loads(summary.read_text())
        rec.update(saved=(out / "final").is_dir(), peak_gib=run.get("peak_memory_gib"),
                   pairs_per_s=run.get("train_samples_per_second"), timeline_s=run.get("timeline_s"))
        if run.get("certificate"):
            rec["certificate"] = brief_of(run["certificate"])
    config_yaml = out / "config.yaml"
    if config_yaml.exists():  # what the run chose for what the flags left open
        import yaml

        chosen = yaml.safe_load(config_yaml.read_text())
        rec["chosen"] = {k: chosen.get(k) for k in ("gradient_checkpointing", "max_tokens_per_batch", "attn_impl",
                                                     "torch_compile")}
    return rec


def trl_job(cfg: TrainConfig, variant: str, model_dir: Path, rows: Path, work: Path, limit_s: float | None) -> dict:
    """TRL's DPOTrainer job on the same model and rows: load, one epoch (checkpointing on, as TRL defaults), save."""
    name = "trl-" + variant
    argv = [sys.executable, "-c", TRL_JOB, str(model_dir), str(rows), str(work / f"out-{name}"), variant,
            str(cfg.per_device_train_batch_size), str(cfg.gradient_accumulation_steps), str(cfg.max_length),
            "1" if cfg.precompute_ref_log_probs else "0", str(cfg.learning_rate), str(cfg.beta), trl_adapter(cfg)]
    rec = {"impl": name + ("-precompute" if cfg.precompute_ref_log_probs else ""),
           **timed_job(argv, cold_env(work, name), work / f"{name}.log", limit_s)}
    for line in Path(rec["log"]).read_text(errors="replace").splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT "):])
            rec.update(saved=(work / f"out-{name}" / "final").is_dir(), peak_gib=result.get("peak_gib"),
                       pairs_per_s=round(result["pairs"] / result["train_runtime"], 2))
    return rec


def run_jobs(cfg: TrainConfig, shape: str, rows: int, compare: list[str], workload: str, out_json: str | None,
             console, work_dir: str | None = None, limit_s: float | None = None) -> list[dict]:
    """Time to result: each side's whole job on `rows` rows of `workload` (process start to saved model, empty compile
    caches), fastdpo first, then each --compare side, on the same model dir and rows, with the same reference
    strategy. The job's model dir, rows and logs stay in `work_dir` (a temporary dir when not given)."""
    if not shape:
        raise FastDPOError("fastdpo bench --job needs --shape NAME: the job's model is written from that shape.")
    variants = [trl_variant(v, cfg) for v in compare]
    cfg.max_length = max(cfg.max_length, workload_max_length(workload))
    device = resolve_device(cfg.device)
    keep = work_dir is not None
    work = Path(work_dir) if keep else Path(tempfile.mkdtemp(prefix="fastdpo-job-"))
    work.mkdir(parents=True, exist_ok=True)
    if any(work.iterdir()):
        raise FastDPOError(f"--job_dir {work} is not empty: each job needs fresh outputs and empty compile caches. "
                           "Name a new directory.")
    model_dir, rows_path = write_job_inputs(shape, workload, rows, work, device)
    results = [fastdpo_job(cfg, model_dir, rows_path, work, limit_s)]
    results += [trl_job(cfg, v, model_dir, rows_path, work, limit_s) for v in variants]
    ours = results[0]
    for r in results[1:]:
        if ours.get("rc") == 0 and r.get("rc") == 0:
            r["fastdpo_wall_ratio"] = round(ours["wall_s"] / r["wall_s"], 3)
    record = {"shape": shape, "workload": workload, "rows": rows, "env": environment(), "work_dir": str(work),
              "reference": "precomputed" if cfg.precompute_ref_log_probs else "online",
              "config": cfg.to_dict(), "jobs": results}
    if out_json:
        Path(out_json).write_text(json.dumps(record, indent=1))
    if console is not None:
        from rich.table import Table

        table = Table(title=f"fastdpo bench --job: {rows} {workload} rows, {shape}, process start to saved model")
        for col in ("impl", "wall s", "vs fastdpo", "pairs/s (run)", "peak GiB", "saved"):
            table.add_column(col)
        for r in results:
            failed = r.get("rc") != 0
            table.add_row(r["impl"], f"{r['wall_s']:.1f}" + (" (failed: see log)" if failed else ""),
                          f"{1 / r['fastdpo_wall_ratio']:.2f}x" if r.get("fastdpo_wall_ratio") else "",
                          str(r.get("pairs_per_s", "")), gib(r.get("peak_gib")), "yes" if r.get("saved") else "no")
        console.print(table)
        if ours.get("timeline_s"):
            console.print("fastdpo timeline (s since process start): " +
                          ", ".join(f"{k} {v}" for k, v in ours["timeline_s"].items()))
        if ours.get("certificate"):
            share = f", {ours['certificate']['seconds'] / ours['wall_s']:.1%} of the job" if ours.get("wall_s") else ""
            console.print(f"{certificate_line(ours['certificate'])}{share}", highlight=False)
    if not keep:
        import shutil

        for name in ("model", "out-fastdpo", *(f"out-trl-{v}" for v in variants)):
            shutil.rmtree(work / name, ignore_errors=True)  # the logs stay
    return results
