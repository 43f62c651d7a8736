"""`fastdpo demo`: DPO on a tiny built-in model, on CPU, with a measured gain (no download).

The task (see scripts/build_demo_model.py): add two 3-digit numbers. The bundled base model was trained with SFT until
it is right often but not reliably; DPO on pairs (chosen = the correct sum, rejected = one of the base model's own
wrong answers) is trained through the ordinary `fastdpo.train.train` path, then held-out accuracy of greedy answers,
checked by the verifier, is compared before and after.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from fastdpo.errors import FastDPOError

ASSETS = Path(__file__).resolve().parent / "assets" / "demo"

# The DPO run: plain `fastdpo train` settings (printed as a command line by the demo).
TRAIN_SETTINGS = dict(learning_rate=1e-5, beta=0.1, max_steps=150, per_device_train_batch_size=32,
                      lr_scheduler_type="cosine", warmup_ratio=0.1, logging_steps=10, seed=0)
QUICK_SETTINGS = dict(max_steps=40, logging_steps=5)
HELDOUT = 500
QUICK_HELDOUT = 200

SPECIAL_TOKENS = ["<unk>", "<pad>", "<eos>", "<bos>", "<|user|>", "<|assistant|>"]
CHARS = list("0123456789+")
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}<|user|>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}<|assistant|>{{ m['content'] }}<eos>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def question(a: int, b: int) -> str:
    return f"{a}+{b}"


def prompt_text(q: str) -> str:
    """The chat-templated prompt (what the tokenizer's chat template renders with add_generation_prompt)."""
    return f"<|user|>{q}<|assistant|>"


def verify(q: str, answer: str) -> bool:
    """The task's verifier: is `answer` exactly the sum asked for in `q`?"""
    a, b = q.split("+")
    return answer.strip() == str(int(a) + int(b))


def char_tokenizer():
    """A character-level tokenizer over digits and '+', with chat specials, <bos> prepended and a chat template."""
    from tokenizers import Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS + CHARS)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))  # no merges: one token per character
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A $B",
                                                       special_tokens=[("<bos>", vocab["<bos>"])])
    out = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>",
                                  bos_token="<bos>", additional_special_tokens=SPECIAL_TOKENS[4:],
                                  padding_side="left")
    out.chat_template = CHAT_TEMPLATE
    return out


@torch.no_grad()
def generate_answers(model, tokenizer, prompts: list[str], batch_size: int = 256, max_new_tokens: int = 6,
                     sample: bool = False) -> list[str]:
    """Answers to chat-templated `prompts` by batched `model.generate`: greedy (temperature 0), or sampled at
    temperature 1 (seed torch's generator first for reproducible samples)."""
    model.eval()
    out: list[str] = []
    for i in range(0, len(prompts), batch_size):
        enc = tokenizer(prompts[i : i + batch_size], return_tensors="pt", padding=True)
        kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if sample else dict(do_sample=False)
        gen = model.generate(**enc, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id, **kw)
        out += tokenizer.batch_decode(gen[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    return out


def load_heldout(n: int, assets: Path = ASSETS) -> list[dict]:
    path = assets / "heldout.jsonl"
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return rows[:n]


def check_assets(assets: Path = ASSETS) -> None:
    need = ["model/config.json", "model/model.safetensors", "model/tokenizer.json", "pairs.jsonl", "heldout.jsonl"]
    missing = [n for n in need if not (assets / n).is_file()]
    if missing:
        raise FastDPOError(
            f"The demo files are missing from {assets} ({', '.join(missing)}). Reinstall fastdpo, or rebuild them with "
            "`python scripts/build_demo_model.py` from a source checkout."
        )


def greedy_eval(model_dir: str | Path, heldout: list[dict]) -> tuple[float, list[str]]:
    """Held-out accuracy of greedy answers checked by the verifier, and the answers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    answers = generate_answers(model, tok, [r["prompt"] for r in heldout])
    correct = sum(verify(r["question"], a) for r, a in zip(heldout, answers))
    return correct / len(heldout), answers


def write_plot(out_dir: Path, base_acc: float, tuned_acc: float) -> Path | None:
    """A PNG of the training curves from out_dir/metrics.jsonl (None when matplotlib is not installed)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    axes[0].plot(steps, [r["loss"] for r in rows], marker=".")
    axes[0].set_title("DPO loss")
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
        axes[1].plot(steps, [r[key] for r in rows], marker=".", label=key.split("/")[1])
    axes[1].set_title("implicit rewards")
    axes[1].legend()
    axes[2].bar(["base", "DPO"], [100 * base_acc, 100 * tuned_acc], color=["#999999", "#2a7ab9"])
    axes[2].set_ylim(0, 100)
    axes[2].set_title("held-out accuracy (%)")
    for ax in axes[:2]:
        ax.set_xlabel("step")
    fig.tight_layout()
    path = out_dir / "training.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def command_line(cfg) -> str:
    flags = " ".join(f"--{k} {getattr(cfg, k)}" for k in TRAIN_SETTINGS)
    return f"fastdpo train --model {cfg.model} --dataset {cfg.dataset[0]} --output_dir {cfg.output_dir} {flags}"


def run_demo(output_dir: str, console=None, quick: bool = False, assets: Path = ASSETS, **overrides) -> dict:
    """Evaluate the bundled base model, train it with DPO through `fastdpo.train.train`, evaluate again, and report.
    `overrides` replace TRAIN_SETTINGS entries (e.g. max_steps). Returns the numbers and answers."""
    from fastdpo.config import TrainConfig
    from fastdpo.train import train

    def say(*args) -> None:
        if console is not None:
            console.print(*args, highlight=False)

    t0 = time.perf_counter()
    check_assets(assets)
    out = Path(output_dir)
    heldout = load_heldout(QUICK_HELDOUT if quick else HELDOUT, assets)
    settings = {**TRAIN_SETTINGS, **(QUICK_SETTINGS if quick else {}), **overrides}
    cfg = TrainConfig(model=str(assets / "model"), dataset=[str(assets / "pairs.jsonl")], output_dir=str(out),
                      disable_progress=True, **settings)
    n_pairs = sum(1 for line in (assets / "pairs.jsonl").open() if line.strip())
    say("[bold]fastdpo demo[/]: DPO on a tiny built-in model, on this machine's CPU, no download.")
    say("  task       3-digit addition; an answer counts when the verifier says it is the exact sum")
    say(f"  base model {assets / 'model'} (SFT on demonstrations that often forget a carry)")
    say(f"  pairs      {n_pairs} (chosen = correct sum, rejected = a wrong answer of the base model's own)")
    say(f"  held-out   {len(heldout)} prompts seen by neither training run; greedy answers")
    say(f"  training   {command_line(cfg)}")

    base_acc, base_answers = greedy_eval(assets / "model", heldout)
    say(f"base model held-out accuracy: {100 * base_acc:.1f}%")
    result = train(cfg, console=console, progress=False)
    tuned_acc, tuned_answers = greedy_eval(result["final_dir"], heldout)
    gain = 100 * (tuned_acc - base_acc)
    plot = write_plot(out, base_acc, tuned_acc)
    seconds = time.perf_counter() - t0

    summary = {"base_accuracy": base_acc, "tuned_accuracy": tuned_acc, "gain_points": gain,
               "heldout": len(heldout), "steps": cfg.max_steps, "seconds": seconds, "final_dir": result["final_dir"],
               "plot": str(plot) if plot else None, "last": result["last"]}
    answers = [{"question": r["question"], "answer": r["answer"], "base": b, "dpo": t}
               for r, b, t in zip(heldout, base_answers, tuned_answers)]
    (out / "demo_result.json").write_text(json.dumps({**summary, "answers": answers}, indent=1) + "\n")
    if console is not None:
        report(console, summary, answers)
    return {**summary, "answers": answers}


def side_by_side(answers: list[dict], n: int = 6) -> list[dict]:
    """A few held-out answers: mostly ones DPO fixed, then any it broke or left wrong."""
    fixed = [a for a in answers if a["base"] != a["answer"] and a["dpo"] == a["answer"]]
    broke = [a for a in answers if a["base"] == a["answer"] and a["dpo"] != a["answer"]]
    wrong = [a for a in answers if a["base"] != a["answer"] and a["dpo"] != a["answer"]]
    return (fixed[: n - 2] + broke[:1] + wrong[:1] + fixed[n - 2 :])[:n]


def report(console, summary: dict, answers: list[dict]) -> None:
    from rich.table import Table

    table = Table(title="held-out answers (greedy)", title_justify="left")
    for col in ("question", "correct", "base", "DPO"):
        table.add_column(col, justify="right")

    def mark(a: str, right: str) -> str:
        return f"[green]{a} ✓[/]" if a == right else f"[red]{a or '(empty)'} ✗[/]"

    for a in side_by_side(answers):
        table.add_row(a["question"], a["answer"], mark(a["base"], a["answer"]), mark(a["dpo"], a["answer"]))
    console.print(table)
    console.print(
        f"[bold]held-out accuracy[/] ({summary['heldout']} prompts, greedy, verified): base "
        f"{100 * summary['base_accuracy']:.1f}% -> DPO {100 * summary['tuned_accuracy']:.1f}% "
        f"([bold]{summary['gain_points']:+.1f} points[/]) after {summary['steps']} steps",
        highlight=False,
    )
    if summary["plot"]:
        console.print(f"training plot: {summary['plot']}", highlight=False)
    else:
        console.print("training plot: skipped (matplotlib is not installed: `pip install matplotlib`); "
                      f"the curves are in {Path(summary['final_dir']).parent / 'metrics.jsonl'}", highlight=False)
    console.print(f"wall time {summary['seconds']:.0f} s", highlight=False)
