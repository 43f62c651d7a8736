"""Vision-language DPO, fastdpo against TRL's DPOTrainer, on one GPU: the same random-init Qwen2.5-VL-shaped model
and the same rows with images on both sides.

    python benchmarks/vlm_bench.py make    --out /tmp/vb --shape qwen2.5-vl-3b --rows 64 --seed 0
    python benchmarks/vlm_bench.py fastdpo --dir /tmp/vb --out /tmp/vbo/fastdpo --steps 10 --warmup 3 --bs 4 \\
        [--lora] [--fastdpo_args "--kernels torch"]
    python benchmarks/vlm_bench.py trl     --dir /tmp/vb --out /tmp/vbo/trl --steps 10 --warmup 3 --bs 4 \\
        [--liger] [--lora]
    python benchmarks/vlm_bench.py all     --dir /tmp/vb --out /tmp/vbo --shape qwen2.5-vl-3b --rows 64 \\
        --steps 10 --warmup 3 --bs 4 [--lora] [--also-plain] [--limit 600]

CPU check of the harness (tiny shape, a minute or two):

    python benchmarks/vlm_bench.py all --dir /tmp/vb --out /tmp/vbo --shape tiny --rows 8 --steps 2 --warmup 1 --bs 2

make: DIR/model (a random-init Qwen2_5_VLForConditionalGeneration saved in bf16 for qwen2.5-vl-3b, float32 for tiny,
with its processor: the project's whitespace word tokenizer padded to the vocabulary, the image processor, the chat
template), DIR/rows.jsonl (ms-swift rows: one image per prompt, `<image>` first in the user turn, paths relative to
the file) and the images as PNG under DIR/img. Each image keeps its size (a multiple of patch x merge pixels, with
min/max pixels that never resize it), so its merged visual token count is known: 500..1300 per image for the 3B
shape, 16..64 for tiny. Prompts have 20..60 words (tiny: 5..15), chosen and rejected answers 250..350 words each
(tiny: 10..30); every word is one token of the vocabulary.

fastdpo: `python -m fastdpo train` on DIR/model and DIR/rows.jsonl (the dataset's order, no shuffle). trl: TRL's
DPOTrainer in a process of this script, on the same rows in TRL's vision preference format, in the same order; the
reference is a frozen copy of the policy (full fine-tuning) or the policy with its adapter off (--lora: LoRA r16 alpha
32 on the language model's linear layers, on both sides); --liger applies Liger's layer kernels. Both sides: bf16 on
CUDA (float32 on the CPU, where Liger's Triton kernels cannot run: --liger is then reported off), lr 1e-6, beta 0.1,
activation checkpointing on TRL's side (fastdpo picks its own), no truncation, W warm-up steps then K timed ones.
all: make when DIR/model is missing, then fastdpo, trl --liger (and with --also-plain trl without Liger), one after
the other, each under its own --limit seconds (a side past it is killed and reported with rc null), then a table.
TRL's sides may have a limit of their own: --trl_limit S, or --trl_limit 2.1x (2.1 times fastdpo's measured wall,
capped by --trl_max): a TRL side killed there while fastdpo finished bounds the time-to-result ratio (fastdpo took
under 1/2.1 of TRL's time), for TRL jobs longer than one can wait for. A TRL side killed before its last step also
gets a projected wall (its measured wall plus each step it did not run at the length of its fastest timed step,
without its save), printed as a projection next to the measured bound.

Every subcommand prints `RESULT {json}` lines on stdout; the sides' own logs go to OUT/<side>.log. The numbers:
  wall_s         time to result: from starting the side's process to its exit (imports, model load, data
                 preparation, every step, the final save)
  rc             the process's exit code (null: killed at --limit)
  saved          OUT/final holds the trained model (or adapter)
  pairs_per_s    steady state: pairs (prompt, chosen, rejected) per second over the K steps after the warm-up
  s_per_step     steady state: seconds per optimizer step over those steps (bs pairs each)
  peak_gib       peak allocated GPU memory (torch.cuda.max_memory_allocated over the run: fastdpo's summary.json; TRL's
                 counted from the trainer built, when the policy and reference are already in place; null on the CPU,
                 where fastdpo's peak_rss_gib is its process's peak RSS)
  step_s         every step's seconds, warm-up included (fastdpo: bs over the pairs/s of its per-step record; TRL: a
                 callback's clock, CUDA synchronised, from one step's end to the next, the batch's collation included)
  init_s         (TRL) seconds from the process start to the trainer built (imports, model, reference, dataset)
  backend        (fastdpo) the attention backend of its `Training:` log line; plan: its plan.json (attention,
                 kernels, activation checkpointing, token budget); certificate: its certificate's status
The table: fastdpo's pairs/s over TRL's (speed-up), TRL's wall over fastdpo's (time-to-result ratio), the peaks.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
SRC = HERE.parent.parent / "src"

# The model shapes. qwen2.5-vl-3b: Qwen2.5-VL-3B-Instruct's architecture (random weights, a word vocabulary padded
# to its size). tiny: fastdpo.model.tiny's config (4-pixel patches merged 2 x 2) for a CPU check of the harness.
SHAPES = {
    "qwen2.5-vl-3b": dict(vocab=151936, words=4000, patch=14, merge=2, tokens=(500, 1300), prompt=(20, 60),
                          answer=(250, 350), dtype="bfloat16"),
    "tiny": dict(vocab=512, words=400, patch=4, merge=2, tokens=(16, 64), prompt=(5, 15), answer=(10, 30),
                 dtype="float32"),
}
CHAT_WORDS = ["user", "assistant", "system"]  # the chat template's role names: words of the vocabulary too
LORA_TARGETS = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"


def result(record: dict) -> dict:
    print("RESULT " + json.dumps(record), flush=True)
    return record


def body_words(shape: dict) -> list[str]:
    return [f"w{i}" for i in range(shape["words"])]


# ---------------------------------------------------------------------------------------------------------- make

def model_config(name: str):
    """The Qwen2.5-VL config of shape `name`, built by fastdpo's tiny_vlm_config (the 3B shape replaces its keys)."""
    from fastdpo.model.tiny import tiny_vlm_config

    vocab = SHAPES[name]["vocab"]
    if name == "tiny":
        return tiny_vlm_config("qwen2_5_vl", vocab)
    text = dict(intermediate_size=11008, num_attention_heads=16, num_key_value_heads=2, max_position_embeddings=32768,
                rms_norm_eps=1e-6, hidden_act="silu", tie_word_embeddings=True,
                rope_parameters={"rope_type": "default", "mrope_section": [16, 24, 24], "rope_theta": 1000000.0})
    vision = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, window_size=112, fullatt_block_indexes=[7, 15, 23, 31],
                  hidden_act="silu", in_channels=3, tokens_per_second=2)
    return tiny_vlm_config("qwen2_5_vl", vocab, hidden=2048, layers=36, text=text, vision=vision,
                           tie_word_embeddings=True)


def make_model(out: Path, name: str, seed: int) -> None:
    """DIR/model: the random-init model (built on the GPU when there is one: the 3B init is slow on a CPU) and its
    processor, whose image processor keeps every image of the shape's token range at its size."""
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    from fastdpo.model.tiny import save_vlm_dir, tiny_vlm_processor

    shape = SHAPES[name]
    unit = shape["patch"] * shape["merge"]
    lo, hi = shape["tokens"]
    processor = tiny_vlm_processor(CHAT_WORDS + body_words(shape), vocab_size=shape["vocab"],
                                   min_pixels=unit * unit * lo, max_pixels=unit * unit * hi,
                                   patch_size=shape["patch"], merge_size=shape["merge"])
    dtype = getattr(torch, shape["dtype"])
    torch.manual_seed(seed)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen2_5_VLForConditionalGeneration._from_config(model_config(name), dtype=dtype)
    model.eval()
    n = sum(p.numel() for p in model.parameters())
    save_vlm_dir(out, model.to("cpu"), processor)
    print(f"model: {n / 1e6:.1f} M parameters ({shape['dtype']}) in {out}", file=sys.stderr)


def image_grid(rng: random.Random, lo: int, hi: int) -> tuple[int, int]:
    """(columns, rows) of merged tokens with columns x rows in lo..hi and an aspect ratio within about 1:2."""
    while True:
        t = rng.randint(lo, hi)
        gw = rng.randint(max(1, round(math.sqrt(t / 2))), max(1, round(math.sqrt(2 * t))))
        gh = max(1, round(t / gw))
        if lo <= gw * gh <= hi:
            return gw, gh


def write_png(path: Path, width: int, height: int, rng: random.Random, noise: bool) -> None:
    import numpy as np
    from PIL import Image

    if noise:
        pixels = np.random.default_rng(rng.getrandbits(32)).integers(0, 256, (height, width, 3), dtype=np.uint8)
        Image.fromarray(pixels, "RGB").save(path)
    else:
        Image.new("RGB", (width, height), tuple(rng.randrange(256) for _ in range(3))).save(path)


def make_rows(out: Path, name: str, n: int, seed: int) -> dict:
    """DIR/rows.jsonl and DIR/img/k.png: one image per prompt (solid colour for even k, noise for odd k)."""
    shape = SHAPES[name]
    rng = random.Random(seed)
    words = body_words(shape)
    unit = shape["patch"] * shape["merge"]
    (out / "img").mkdir(parents=True, exist_ok=True)

    def text(span: tuple[int, int]) -> str:
        return " ".join(rng.choice(words) for _ in range(rng.randint(*span)))

    visual, lengths = 0, []
    with open(out / "rows.jsonl", "w", encoding="utf-8") as f:
        for k in range(n):
            gw, gh = image_grid(rng, *shape["tokens"])
            write_png(out / "img" / f"{k}.png", gw * unit, gh * unit, rng, noise=k % 2 == 1)
            prompt, chosen, rejected = text(shape["prompt"]), text(shape["answer"]), text(shape["answer"])
            row = {"messages": [{"role": "user", "content": "<image>" + prompt},
                                {"role": "assistant", "content": chosen}],
                   "rejected_response": rejected, "images": [f"img/{k}.png"]}
            f.write(json.dumps(row) + "\n")
            visual += gw * gh
            lengths.append(gw * gh + len(prompt.split()) + max(len(chosen.split()), len(rejected.split())))
    return {"rows": n, "visual_tokens_mean": round(visual / max(n, 1), 1), "longest_sequence_approx": max(lengths)}


def cmd_make(a) -> dict:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    make_model(out / "model", a.shape, a.seed)
    stats = make_rows(out, a.shape, a.rows, a.seed)
    return result({"impl": "make", "dir": str(out), "shape": a.shape, "seed": a.seed, **stats,
                   "make_s": round(time.perf_counter() - t0, 1)})


# ------------------------------------------------------------------------------------------------ processes

def run_timed(cmd: list[str], log: Path, limit: float | None, env: dict | None = None) -> tuple[int | None, float]:
    """Run `cmd` in a session of its own, output to `log`; (exit code or None past `limit` seconds, wall seconds).
    A process past the limit is killed with its whole group (data workers too)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w", encoding="utf-8") as f:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        try:
            rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
        wall = time.perf_counter() - t0
    if rc != 0:
        tail = log.read_text(encoding="utf-8", errors="replace").splitlines()[-25:]
        why = "killed at --limit" if rc is None else f"exit code {rc}"
        print(f"{cmd[1:3]}: {why}; the end of {log}:\n" + "\n".join(tail), file=sys.stderr)
    return rc, wall


def child_env() -> dict:
    """The environment of a side's process: fastdpo importable from this checkout."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SRC)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def clear(out: Path, names: list[str]) -> None:
    """Remove an earlier run's outputs from `out`, so that a side killed early reports none of them."""
    for name in names:
        path = out / name
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


def check_rows(a) -> None:
    """Both sides run the steps over the rows in order; fewer rows than the steps take make them cycle (a warning)."""
    rows = Path(a.dir) / "rows.jsonl"
    n = sum(1 for _ in open(rows, encoding="utf-8")) if rows.is_file() else 0
    if n < a.bs * (a.warmup + a.steps):
        print(f"warning: {rows} has {n} rows; {a.bs * (a.warmup + a.steps)} pairs are trained (a second epoch).",
              file=sys.stderr)


def steady(step_s: list[float], warmup: int, bs: int) -> dict:
    """pairs/s and s/step over the steps after the first `warmup` ones."""
    timed = step_s[warmup:]
    if not timed or sum(timed) <= 0:
        return {"pairs_per_s": None, "s_per_step": None, "timed_steps": len(timed)}
    dt = sum(timed)
    return {"pairs_per_s": round(len(timed) * bs / dt, 4), "s_per_step": round(dt / len(timed), 4),
            "timed_steps": len(timed)}


# ----------------------------------------------------------------------------------------------------- fastdpo

def cmd_fastdpo(a) -> dict:
    """`python -m fastdpo train` timed from its start to its exit; steady state from its metrics.jsonl, where each
    logged step (--logging_steps 1) has the pairs/s since the previous record: that step's time is bs over it."""
    d, out = Path(a.dir), Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    check_rows(a)
    clear(out, ["final", "metrics.jsonl", "summary.json", "plan.json", "train.log"])
    cuda = cuda_available()
    cmd = [sys.executable, "-m", "fastdpo", "train", "--model", str(d / "model"), "--dataset", str(d / "rows.jsonl"),
           "--output_dir", str(out), "--overwrite_output_dir", "true", "--per_device_train_batch_size", str(a.bs),
           "--gradient_accumulation_steps", "1", "--max_steps", str(a.warmup + a.steps), "--learning_rate", "1e-6",
           "--beta", "0.1", "--save_steps", "0", "--logging_steps", "1", "--shuffle", "false",
           "--max_length", str(a.max_length), "--disable_progress", "true"]
    cmd += ["--torch_dtype", "bfloat16"] if cuda else ["--device", "cpu", "--torch_dtype", "float32"]
    if a.lora:  # adapters on the language model only, as TRL's side targets them
        cmd += ["--train_type", "lora", "--lora_rank", "16", "--lora_alpha", "32"]
    else:  # every part trained, as TRL's full fine-tuning trains them (fastdpo's default freezes the vision tower)
        cmd += ["--freeze_vit", "false", "--freeze_aligner", "false"]
    cmd += shlex.split(a.fastdpo_args)
    rc, wall = run_timed(cmd, out.parent / f"{out.name}.log", a.limit, child_env())
    records = []
    if (out / "metrics.jsonl").is_file():
        for line in (out / "metrics.jsonl").read_text(encoding="utf-8").splitlines():
            r = json.loads(line)
            if "pairs_per_second" in r and "step" in r:
                records.append(r)
    records.sort(key=lambda r: r["step"])
    step_s = [a.bs / r["pairs_per_second"] if r["pairs_per_second"] else 0.0 for r in records]
    summary, plan = read_json(out / "summary.json"), read_json(out / "plan.json")
    cert = summary.get("certificate")
    return result({"impl": "fastdpo", "lora": a.lora, "wall_s": round(wall, 2), "rc": rc,
                   "saved": (out / "final").is_dir() and any((out / "final").iterdir()),
                   **steady(step_s, a.warmup, a.bs), "peak_gib": summary.get("peak_memory_gib"),
                   "peak_rss_gib": summary.get("peak_rss_gib"), "steps": len(records), "bs": a.bs,
                   "backend": summary.get("backend") or logged_backend(out / "train.log") or plan.get("attention"),
                   "plan": plan, "memory_plan": logged_line(out / "train.log", "Memory: "),
                   "train_runtime_s": summary.get("train_runtime"),
                   "certificate": cert.get("status") if isinstance(cert, dict) else cert,
                   "step_s": [round(x, 4) for x in step_s]})


def read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def logged_line(log: Path, start: str) -> str | None:
    """The run log's first message that begins with `start` (the memory plan, which says what it estimated), from
    there on."""
    if not log.is_file():
        return None
    for line in log.read_text(encoding="utf-8", errors="replace").splitlines():
        if start in line:
            return line[line.index(start):]
    return None


def logged_backend(log: Path) -> str | None:
    """The attention backend of the run's `Training: {...}` log line (summary.json does not keep it)."""
    import re

    if not log.is_file():
        return None
    m = re.search(r"Training: \{.*'backend': '([\w-]+)'", log.read_text(encoding="utf-8", errors="replace"))
    return m.group(1) if m else None


# --------------------------------------------------------------------------------------------------------- TRL

def cmd_trl(a) -> dict:
    """TRL's side in a process of its own (this script's trl-worker), timed from its start to its exit."""
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    check_rows(a)
    liger = a.liger and cuda_available()  # Liger's kernels are Triton GPU kernels: none on the CPU
    report = out / "trl_result.json"
    clear(out, ["final", report.name])
    cmd = [sys.executable, str(HERE), "trl-worker", "--dir", a.dir, "--out", str(out), "--steps", str(a.steps),
           "--warmup", str(a.warmup), "--bs", str(a.bs), "--report", str(report)]
    cmd += ["--liger"] * liger + ["--lora"] * a.lora
    rc, wall = run_timed(cmd, out.parent / f"{out.name}.log", a.limit, child_env())
    w = json.loads(report.read_text(encoding="utf-8")) if report.is_file() else {}
    step_s = w.get("step_s", [])
    impl = "trl+liger" if liger else "trl+liger(off)" if a.liger else "trl"  # off: asked for, no CUDA
    return result({"impl": impl, "liger": liger, "lora": a.lora, "wall_s": round(wall, 2),
                   "rc": rc, "saved": (out / "final").is_dir() and any((out / "final").iterdir()),
                   **steady(step_s, a.warmup, a.bs), "peak_gib": w.get("peak_gib"), "steps": len(step_s), "bs": a.bs,
                   "planned_steps": a.warmup + a.steps, "init_s": w.get("init_s"), "train_s": w.get("train_s"),
                   "save_s": w.get("save_s"),
                   "versions": w.get("versions"), "step_s": [round(x, 4) for x in step_s]})


def trl_rows(path: Path) -> list[dict]:
    """rows.jsonl in TRL's vision preference format, in the file's order (the `<image>` leads each prompt)."""
    from PIL import Image

    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        r = json.loads(line)
        user, answer = r["messages"][0]["content"], r["messages"][1]["content"]
        images = []
        for p in r["images"]:
            with Image.open(path.parent / p) as im:
                images.append(im.convert("RGB"))
        rows.append({"images": images,
                     "prompt": [{"role": "user", "content": [{"type": "image"},
                                                             {"type": "text", "text": user.replace("<image>", "")}]}],
                     "chosen": [{"role": "assistant", "content": [{"type": "text", "text": answer}]}],
                     "rejected": [{"role": "assistant", "content": [{"type": "text",
                                                                      "text": r["rejected_response"]}]}]})
    return rows


def trl_worker(a) -> None:
    """TRL's DPOTrainer on DIR/model and DIR/rows.jsonl; step times, peak memory and phases to --report."""
    t_start = time.perf_counter()
    import copy
    import dataclasses

    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForImageTextToText, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    from fastdpo.model.processor import load_processor

    d, out = Path(a.dir), Path(a.out)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    model = AutoModelForImageTextToText.from_pretrained(d / "model", dtype=torch.bfloat16 if cuda else torch.float32,
                                                        attn_implementation="sdpa").to(device)
    processor = load_processor(d / "model")
    data = Dataset.from_list(trl_rows(d / "rows.jsonl"))

    peft_config, ref_model = None, None
    if a.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_TARGETS,
                                 task_type="CAUSAL_LM")
    else:  # full fine-tuning: a frozen copy of the starting policy
        ref_model = copy.deepcopy(model).eval().requires_grad_(False)

    kw = dict(output_dir=str(out), per_device_train_batch_size=a.bs, gradient_accumulation_steps=1,
              max_steps=a.warmup + a.steps, learning_rate=1e-6, beta=0.1, bf16=cuda, gradient_checkpointing=True,
              max_length=None, save_strategy="no", report_to=[], logging_steps=1000, remove_unused_columns=False,
              dataloader_num_workers=0, seed=0, use_liger_kernel=a.liger, use_cpu=not cuda,
              train_sampling_strategy="sequential",  # the file's order, as fastdpo's side (--shuffle false)
              precompute_ref_log_probs=False)
    fields = {f.name for f in dataclasses.fields(DPOConfig)}
    dropped = sorted(k for k in kw if k not in fields)
    if dropped:
        print(f"DPOConfig of this TRL has no {dropped}: left at their defaults", file=sys.stderr)
    config = DPOConfig(**{k: v for k, v in kw.items() if k in fields})

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.t = None
            self.steps: list[float] = []

        def on_step_begin(self, args, state, control, **kw):
            if self.t is None:  # the first step's clock starts at its beginning; later ones at the previous end
                self.t = now()

        def on_step_end(self, args, state, control, **kw):
            t = now()
            self.steps.append(t - self.t)
            self.t = t
            write_report()  # after every step: a side killed at --limit still reports the steps it ran

    def now() -> float:
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def write_report(**more) -> dict:
        peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
        report = {"step_s": times.steps, "peak_gib": None if peak is None else round(peak, 3),
                  "init_s": round(t_init - t_start, 2), "versions": {"trl": trl.__version__,
                                                                     "transformers": transformers.__version__,
                                                                     "torch": torch.__version__}, **more}
        Path(a.report).write_text(json.dumps(report) + "\n", encoding="utf-8")
        return report

    times = StepTimes()
    trainer = DPOTrainer(model=model, ref_model=ref_model, args=config, train_dataset=data, processing_class=processor,
                         peft_config=peft_config, callbacks=[times])
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t_init = time.perf_counter()
    trainer.train()
    t_train = time.perf_counter()
    report = write_report(train_s=round(t_train - t_init, 2))  # the steps, even if the save fails
    final = out / "final"
    if getattr(processor, "video_processor", None) is None:
        # an image-only processor (no torchvision) cannot save itself whole, which the Trainer's save_model tries:
        # the model (or adapter) through it, then the processor's parts as `make` wrote them
        from fastdpo.model.tiny import save_processor_parts

        trainer.processing_class = None
        trainer.save_model(str(final))
        save_processor_parts(final, processor)
    else:
        trainer.save_model(str(final))
    report["save_s"] = round(time.perf_counter() - t_train, 2)
    Path(a.report).write_text(json.dumps(report) + "\n", encoding="utf-8")


# --------------------------------------------------------------------------------------------------------- all

def cmd_all(a) -> None:
    t0 = time.perf_counter()
    d, out = Path(a.dir), Path(a.out)
    if not (d / "model" / "config.json").is_file():
        cmd_make(argparse.Namespace(out=a.dir, shape=a.shape, rows=a.rows, seed=a.seed))
    suffix = "_lora" if a.lora else ""
    sides = [cmd_fastdpo(argparse.Namespace(**{**vars(a), "out": str(out / f"fastdpo{suffix}")}))]
    limit = a.limit
    if a.trl_limit.endswith("x"):  # a multiple of fastdpo's wall: long enough to bound its time to result
        if sides[0]["rc"] == 0:
            limit = float(a.trl_limit[:-1]) * sides[0]["wall_s"]
    elif float(a.trl_limit) > 0:
        limit = float(a.trl_limit)
    if a.trl_max > 0:
        limit = min(limit, a.trl_max)
    if a.budget > 0:  # what is left of the whole run's seconds, less the table's
        limit = max(1.0, min(limit, a.budget - (time.perf_counter() - t0) - 10))
    trl = {**vars(a), "limit": limit}
    sides.append(cmd_trl(argparse.Namespace(**{**trl, "out": str(out / f"trl_liger{suffix}"), "liger": True})))
    if a.also_plain:
        sides.append(cmd_trl(argparse.Namespace(**{**trl, "out": str(out / f"trl{suffix}"), "liger": False})))
    table(sides)


def table(sides: list[dict]) -> None:
    """One line per side, then fastdpo against each TRL side: pairs/s ratio, wall ratio, the peaks."""
    def fmt(x, spec=".3f"):
        return "-" if x is None else format(x, spec)

    print(f"\n{'impl':<16}{'rc':>5}{'saved':>7}{'wall s':>10}{'pairs/s':>10}{'s/step':>10}{'peak GiB':>10}")
    for s in sides:
        print(f"{s['impl']:<16}{fmt(s['rc'], 'd') if s['rc'] is not None else 'null':>5}{str(s['saved']):>7}"
              f"{fmt(s['wall_s'], '.1f'):>10}{fmt(s['pairs_per_s']):>10}{fmt(s['s_per_step']):>10}"
              f"{fmt(s['peak_gib']):>10}")
    ours = sides[0]
    for s in sides[1:]:
        speed = ours["pairs_per_s"] / s["pairs_per_s"] if ours["pairs_per_s"] and s["pairs_per_s"] else None
        wall = s["wall_s"] / ours["wall_s"] if s["rc"] == 0 and ours["rc"] == 0 else None
        # TRL killed at its limit while fastdpo finished: its time to result is longer than the limit, a bound
        bound = ours["wall_s"] / s["wall_s"] if s["rc"] is None and ours["rc"] == 0 else None
        job = (f"x{fmt(wall, '.2f')}" if bound is None else f"more than x{1 / bound:.2f} (TRL killed at "
               f"{s['wall_s']:.0f} s after {s['steps']} steps: fastdpo took under {bound:.2f} of its time)")
        # killed before its end: its wall projected, the steps it did not run each as long as its fastest timed
        # one and no save (a projection, not a measurement: reported apart, as such)
        projected = None
        if bound is not None and s["step_s"] and s.get("planned_steps", 0) > s["steps"]:
            timed = s["step_s"][1:] or s["step_s"]
            projected = s["wall_s"] + (s["planned_steps"] - s["steps"]) * min(timed)
            job += (f"; projected TRL wall {projected:.0f} s ({s['planned_steps'] - s['steps']} more steps at its "
                    f"fastest, {min(timed):.2f} s): fastdpo {ours['wall_s'] / projected:.2f} of it")
        print(f"fastdpo vs {s['impl']}: steady pairs/s x{fmt(speed, '.2f')}, time to result (TRL wall / fastdpo "
              f"wall) {job}, peak GiB {fmt(ours['peak_gib'])} vs {fmt(s['peak_gib'])}")
        result({"impl": "ratio", "vs": s["impl"], "speedup_pairs_per_s": None if speed is None else round(speed, 3),
                "wall_ratio": None if wall is None else round(wall, 3),
                "fastdpo_wall_share_below": None if bound is None else round(bound, 3),
                "trl_wall_projected_s": None if projected is None else round(projected, 1),
                "fastdpo_wall_share_projected": None if projected is None else round(ours["wall_s"] / projected, 3),
                "peak_gib_fastdpo": ours["peak_gib"], "peak_gib_trl": s["peak_gib"]})


# --------------------------------------------------------------------------------------------------------- CLI

def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True, metavar="{make,fastdpo,trl,all}")

    def make_args(q):
        q.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-vl-3b")
        q.add_argument("--rows", type=int, default=64, help="rows to write")
        q.add_argument("--seed", type=int, default=0, help="seed of the weights, the images and the words")

    def run_args(q, liger: bool):
        q.add_argument("--dir", required=True, help="the benchmark dir `make` wrote")
        q.add_argument("--out", required=True, help="the run's output dir")
        q.add_argument("--steps", type=int, default=10, help="timed steps after the warm-up")
        q.add_argument("--warmup", type=int, default=3, help="steps run before the timed ones")
        q.add_argument("--bs", type=int, default=4, help="pairs per step (one GPU, no accumulation)")
        q.add_argument("--lora", action="store_true", help="LoRA r16 alpha 32 on the language model's linear layers")
        q.add_argument("--limit", type=float, default=240, help="seconds a side may run before it is killed")
        q.add_argument("--max_length", type=int, default=4096, help="fastdpo's --max_length (no row reaches it)")
        q.add_argument("--fastdpo_args", default="", help="more flags for `fastdpo train`, one string")
        if liger:
            q.add_argument("--liger", action="store_true", help="Liger's layer kernels (CUDA only)")

    q = sub.add_parser("make", help="write the model dir and the rows")
    q.add_argument("--out", required=True, help="the benchmark dir (model/, rows.jsonl, img/)")
    make_args(q)
    run_args(sub.add_parser("fastdpo", help="fastdpo's side"), liger=False)
    run_args(sub.add_parser("trl", help="TRL's side"), liger=True)
    w = sub.add_parser("trl-worker")  # the process of TRL's side (not for direct use)
    run_args(w, liger=True)
    w.add_argument("--report", required=True)
    q = sub.add_parser("all", help="make if needed, then fastdpo, trl --liger (and trl with --also-plain), a table")
    run_args(q, liger=False)
    make_args(q)
    q.add_argument("--also-plain", dest="also_plain", action="store_true", help="also TRL without Liger")
    q.add_argument("--trl_limit", default="0", help="seconds TRL's sides may run (0: --limit), or a multiple of "
                   "fastdpo's wall such as 2.1x (a TRL side killed there bounds the time-to-result ratio)")
    q.add_argument("--trl_max", type=float, default=0, help="at most this many seconds for a TRL side (0: no cap)")
    q.add_argument("--budget", type=float, default=0, help="seconds the whole run may take: TRL's sides get at most "
                   "what fastdpo's left (0: no cap)")
    a = p.parse_args()
    if str(SRC) not in sys.path:
        sys.path.insert(0, str(SRC))
    {"make": cmd_make, "fastdpo": cmd_fastdpo, "trl": cmd_trl, "trl-worker": trl_worker, "all": cmd_all}[a.cmd](a)


if __name__ == "__main__":
    main()
