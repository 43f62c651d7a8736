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
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from fastdpo.config import TrainConfig
from fastdpo.data.load import Row
from fastdpo.data.prepare import DataOptions, tokenize_pairs
from fastdpo.errors import FastDPOError
from fastdpo.profile import report, start_profiler, synchronize

VOCAB = 151936

SHAPES = {
    # a few-layer model to try the commands and scripts on a CPU in seconds
    "tiny": dict(family="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, tie_word_embeddings=True),
    "qwen3-0.6b": dict(family="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3-1.7b": dict(family="qwen3", hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3-8b": dict(family="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
    "llama3-8b": dict(family="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
                      vocab_size=128256, rope_theta=500000.0),
}


def anchor_pairs(n: int, vocab: int = VOCAB, seed: int = 1, prompt_mean: int = 256, resp_mean: int = 320,
                 max_total: int = 2048) -> list[dict]:
    """The anchor rule: log-normal lengths, words t<id> drawn from one seeded stream (same rule and seed as the
    reference benchmark, so the rows are identical)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p = max(16, min(int(rng.lognormvariate(0, 0.6) * prompt_mean), 1024))
        c = max(8, min(int(rng.lognormvariate(0, 0.6) * resp_mean), (max_total - p) - 1))
        r = max(8, min(int(rng.lognormvariate(0, 0.6) * resp_mean), (max_total - p) - 1))

        def words(k: int) -> str:
            return " ".join(f"t{rng.randrange(10, vocab)}" for _ in range(k))

        out.append({"prompt": words(p) + " ", "chosen": words(c), "rejected": words(r)})
    return out


def anchor_tokenizer(vocab: int = VOCAB):
    """Word-level tokenizer: `t<i>` -> i, specials <unk> <pad> <eos> <bos> -> 0..3."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<pad>", "<eos>", "<bos>"]
    v = {s: i for i, s in enumerate(specials)}
    v.update({f"t{i}": i for i in range(len(specials), vocab)})
    tok = Tokenizer(models.WordLevel(vocab=v, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>",
                                   bos_token="<bos>")


def shape_config(name: str):
    import transformers

    if name not in SHAPES:
        raise FastDPOError(f"--shape {name!r} is unknown. Choose from: {', '.join(SHAPES)}.")
    spec = dict(SHAPES[name])
    family = spec.pop("family")
    cls = transformers.Qwen3Config if family == "qwen3" else transformers.LlamaConfig
    spec.setdefault("vocab_size", VOCAB)
    return cls(max_position_embeddings=32768, **spec)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_model(cfg: TrainConfig, shape: str | None, device: torch.device, dtype: torch.dtype):
    """(tokenizer, model): a random-init shape with the anchor tokenizer, or --model. A QLoRA base is quantised while
    loading, from weights on disk: a random-init shape is saved to a temporary dir first and loaded like a user's."""
    from transformers import AutoModelForCausalLM

    from fastdpo.model import load_model, load_tokenizer

    bits = cfg.quant_bits if cfg.train_type == "qlora" else 0
    if not shape:
        return load_tokenizer(cfg.model), load_model(cfg.model, dtype, device, quant_bits=bits)
    tokenizer = anchor_tokenizer(shape_config(shape).vocab_size)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(shape_config(shape), dtype=dtype, attn_implementation="sdpa")
    if not bits:
        return tokenizer, model
    with tempfile.TemporaryDirectory(prefix="fastdpo-shape-") as tmp:
        model.save_pretrained(tmp)
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return tokenizer, load_model(tmp, dtype, device, quant_bits=bits)


def long_pair_rows(total: int, vocab: int = VOCAB, seed: int = 1) -> dict:
    """One pair of about `total` tokens: prompt half, chosen and rejected a quarter each."""
    rng = random.Random(seed + total)

    def words(k: int) -> str:
        return " ".join(f"t{rng.randrange(10, vocab)}" for _ in range(k))

    return {"prompt": words(total // 2) + " ", "chosen": words(total // 4), "rejected": words(total // 4)}


def run_longest(cfg: TrainConfig, shape: str | None, lengths: list[int], out_json: str | None, console) -> list[dict]:
    """One full optimizer step on one pair of each length, shortest first, until one does not fit in GPU memory:
    the longest pair this model and these settings train."""
    from fastdpo.model import resolve_device, resolve_dtype
    from fastdpo.optim import build_optimizer
    from fastdpo.train import StepMetrics, assemble, run_step, seed_all

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
    s = assemble(cfg, device, model, tokenizer, pairs)
    optimizer = build_optimizer(s.model, cfg, device)
    results = []
    for pair in pairs:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        try:
            run_step(s, [pair], StepMetrics(device))
            optimizer.step()
            _sync(device)
        except torch.OutOfMemoryError:
            results.append({"pair_tokens": pair.num_tokens, "fits": False})
            break
        finally:
            optimizer.zero_grad(set_to_none=True)
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
                          str(r.get("step_s", "")), str(r.get("peak_gib", "")))
        console.print(table)
    return results


def run_fastdpo(cfg: TrainConfig, shape: str | None, rows: list[dict], steps: int, warmup: int,
                verbose: bool = True, profile_dir: str | None = None) -> dict:
    """Time `steps` optimizer steps of the real training step after `warmup` steps; with `profile_dir`, profile
    two more steps afterwards (outside the timing)."""
    from fastdpo.gcpause import GcPauses
    from fastdpo.metrics import device_peak_flops, model_flops_per_token, padding, step_flops
    from fastdpo.model import base_causal_lm, resolve_device, resolve_dtype
    from fastdpo.optim import build_optimizer, build_scheduler
    from fastdpo.train import StepMetrics, assemble, attended_pairs, run_step, seed_all, warm_up_lengths

    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.torch_dtype, device)
    seed_all(cfg.seed)
    tokenizer, model = bench_model(cfg, shape, device, dtype)
    pairs, _ = tokenize_pairs([Row(r["prompt"], r["chosen"], r["rejected"], f"row {i}") for i, r in enumerate(rows)],
                              tokenizer, DataOptions.for_scoring(cfg))
    t_init = time.perf_counter()
    s = assemble(cfg, device, model, tokenizer, pairs)
    optimizer = build_optimizer(s.model, cfg, device)
    scheduler = build_scheduler(optimizer, cfg, steps + warmup)
    trainable = [p for p in s.model.parameters() if p.requires_grad]
    per_step = cfg.pairs_per_step
    lm_cfg = base_causal_lm(s.model).config
    times, flops, tokens, n_pairs, computed = [], 0.0, 0, 0, 0
    rates = []  # pairs/s of each timed step
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t_first = None
    if s.backend.name == "flex":  # compiled layers, and the compiled flex kernel on its own, build per length
        warm_up_lengths(s)
    def one_step(step_pairs) -> StepMetrics:
        metrics = StepMetrics(device)
        run_step(s, step_pairs, metrics)
        torch.nn.utils.clip_grad_norm_(trainable, cfg.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(device)
        return metrics

    pauses = GcPauses(cfg.gc_steps).start()  # as training schedules and counts Python's collections
    try:
        for step in range(warmup + steps):
            step_pairs = pairs[step * per_step:(step + 1) * per_step]
            ran = one_step(step_pairs)
            pauses.step_end(step + 1)
            times.append(time.perf_counter())
            prev = times[-2] if len(times) > 1 else t_init
            if verbose:
                print(f"bench step {step}: {times[-1] - prev:.3f}s", file=sys.stderr, flush=True)
            if step == 0:
                t_first = times[0] - t_init
            if step == warmup - 1:
                pauses.take()  # the timed steps' pauses only
            if step >= warmup:
                tokens += sum(p.num_tokens for p in step_pairs)
                computed += ran.computed_tokens
                n_pairs += len(step_pairs)
                rates.append(len(step_pairs) / (times[-1] - prev))
                flops += step_flops(lm_cfg, sum(p.num_tokens for p in step_pairs),
                                    sum(len(p.chosen) + len(p.rejected) for p in step_pairs),
                                    sum(attended_pairs(p) for p in step_pairs), s.reference.online)
        gc_pauses = pauses.take()
    finally:
        pauses.stop()
    dt = times[-1] - times[warmup - 1] if warmup else times[-1] - t_init
    peak = device_peak_flops(device)
    profile = profile_steps(one_step, [pairs[i * per_step:(i + 1) * per_step] for i in range(2)], device,
                            profile_dir) if profile_dir else None
    return {
        "impl": "fastdpo", "pairs_per_s": round(n_pairs / dt, 2), "tokens_per_s": round(tokens / dt),
        "pairs_per_s_median": round(statistics.median(rates), 2),  # of the timed steps: one slow step cannot sway it
        "s_per_step": round(dt / steps, 4), "padding": padding(computed, tokens),
        "mfu": round(flops / dt / peak, 4) if peak else None,
        "peak_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None,
        "first_step_s": round(t_first, 1), "gc_pause_ms": gc_pauses["gc/pause_ms"],
        "gc_collections": gc_pauses["gc/collections"], "backend": s.backend.name, "reference": s.reference.strategy,
        "params": sum(p.numel() for p in s.model.parameters()),
        "flops_per_token_fwd": model_flops_per_token(lm_cfg),
        **({"profile": profile} if profile else {}),
    }


def profile_steps(one_step, steps: list, device: torch.device, out_dir: str) -> dict:
    """Run `one_step` on each of `steps` under torch.profiler; write the Chrome trace, the operators and kernels
    that took the most time and the compute/communication/idle breakdown into `out_dir` (`fastdpo.profile`)."""
    prof = start_profiler(device)
    t0 = time.perf_counter()
    try:
        for step_pairs in steps:
            one_step(step_pairs)
        synchronize(device)
    finally:
        prof.__exit__(None, None, None)
    return report(prof, Path(out_dir), len(steps), time.perf_counter() - t0, device)


TRL_SCRIPT = r'''
import json, sys, time, dataclasses, copy, torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, TrainerCallback
from trl import DPOConfig, DPOTrainer
sys.path.insert(0, sys.argv[1])
from fastdpo.bench import anchor_tokenizer, shape_config, anchor_pairs
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
    src = str(Path(__file__).resolve().parent.parent)
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
    from fastdpo.envinfo import compile_vars

    settings = compile_vars()  # e.g. TORCHINDUCTOR_CPP_WRAPPER=1: a different speed, so the result says so
    if settings:
        env["compile_env"] = settings
    try:
        import trl

        env["trl"] = trl.__version__
    except ImportError:
        pass
    return env


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
                      f"{r['mfu']:.1%}" if r.get("mfu") else "", str(r.get("peak_gib", "")), ratio)
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
