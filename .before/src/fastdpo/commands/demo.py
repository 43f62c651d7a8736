"""`fastdpo demo`: DPO gives a tiny built-in model a large, measured gain, on CPU, in about a minute (no download).

The bundled files (src/fastdpo/assets/demo/, made by scripts/build_demo_model.py) are a 0.6M-parameter Qwen3-style
model that adds 3-digit numbers, a preference set and held-out prompts. The model learned from a sloppy teacher who
often forgets the carry from the tens into the hundreds, so it answers greedily right only about half the time. The demo
measures held-out accuracy (greedy answers through the chat template, checked by `verify`), trains with DPO through the
ordinary `fastdpo.training.loop.train` path on pairs whose rejected answers are the model's own mistakes, and measures again.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from fastdpo.errors import FastDPOError

ASSETS = Path(__file__).resolve().parent.parent / "assets" / "demo"

# The DPO run: ordinary `fastdpo train` settings; the demo prints them as a command line.
TRAIN_SETTINGS = dict(learning_rate=1e-4, beta=0.1, max_steps=60, per_device_train_batch_size=32,
                      lr_scheduler_type="cosine", warmup_ratio=0.1, logging_steps=5, seed=0, plot=True)
QUICK_SETTINGS = dict(max_steps=30)  # for tests
HELDOUT = 500
QUICK_HELDOUT = 200

SPECIAL_TOKENS = ["<unk>", "<pad>", "<eos>", "<bos>", "<|user|>", "<|assistant|>"]
CHARS = list("0123456789+")
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'user' %}<|user|>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}<|assistant|>{{ m['content'] }}<eos>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def question(a: int, b: int) -> str:
    return f"{a}+{b}"


def prompt_text(q: str) -> str:
    """The chat-templated prompt (what the tokenizer's chat template renders with add_generation_prompt)."""
    return f"<bos><|user|>{q}<|assistant|>"


def question_of(prompt: str) -> str:
    """The question inside a chat-templated prompt."""
    assert prompt.startswith("<bos><|user|>") and prompt.endswith("<|assistant|>"), prompt
    return prompt[len("<bos><|user|>") : -len("<|assistant|>")]


def tens_carry(q: str) -> bool:
    """Does the sum carry from the tens column into the hundreds (the sloppy teacher's blind spot)?"""
    a, b = (int(x) for x in q.split("+"))
    return (a % 100) + (b % 100) >= 100


def verify(q: str, answer: str) -> bool:
    """The task's verifier: is `answer` exactly the sum asked for in `q`?"""
    a, b = q.split("+")
    return answer.strip() == str(int(a) + int(b))


def char_tokenizer():
    """A character-level tokenizer over digits and '+' with chat specials and a chat template. Like Llama 3, <bos>
    comes from the chat template (rendered prompts start with it), not from tokenizing."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS + CHARS)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))  # no merges: one token per character
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.decoder = decoders.Fuse()
    out = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>",
                                  bos_token="<bos>", additional_special_tokens=SPECIAL_TOKENS[4:],
                                  padding_side="left")
    out.chat_template = CHAT_TEMPLATE
    return out


def generate_answers(model, tokenizer, questions: list[str], temperature: float = 0.0, seed: int = 0) -> list[str]:
    """Answers to `questions` through the chat template: greedy at temperature 0, else sampled (seeded)."""
    from fastdpo.model.generate import GenerationArgs, generate_texts

    gen = GenerationArgs(max_new_tokens=6, temperature=temperature, max_batch_size=256, seed=seed)
    return generate_texts(model, tokenizer, questions, gen)


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


def greedy_eval(model_dir: str | Path, heldout: list[dict]) -> list[str]:
    """Greedy answers of the model in `model_dir` to the held-out questions."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return generate_answers(model, tok, [r["question"] for r in heldout])


def accuracy(heldout: list[dict], answers: list[str], carry: bool | None = None) -> float:
    """Share of verified answers, over all questions or those with (`carry`=True) / without a tens carry."""
    marks = [verify(r["question"], a) for r, a in zip(heldout, answers)
             if carry is None or tens_carry(r["question"]) == carry]
    return sum(marks) / max(1, len(marks))


def command_line(cfg) -> str:
    flags = " ".join(f"--{k} {getattr(cfg, k)}" for k in TRAIN_SETTINGS)
    return f"fastdpo train --model {cfg.model} --dataset {cfg.dataset[0]} --output_dir {cfg.output_dir} {flags}"


def _demo_dir(out: Path) -> bool:
    """Whether `out` holds only what an earlier demo wrote (or nothing): the demo may then replace it."""
    import yaml

    if (out / "demo_result.json").is_file():
        return True
    try:
        saved = yaml.safe_load((out / "config.yaml").read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return not (out / "metrics.jsonl").exists()
    return isinstance(saved, dict) and Path(str(saved.get("model", ""))).parts[-3:] == ("assets", "demo", "model")


def run_demo(output_dir: str, console=None, quick: bool = False, assets: Path = ASSETS, **overrides) -> dict:
    """Measure the bundled base model, train it with DPO through `fastdpo.training.loop.train`, measure again, report.
    `overrides` replace TRAIN_SETTINGS entries (e.g. max_steps). Returns the numbers and every held-out answer."""
    # One thread: the matrices are tiny, and a second torch thread that must wait for a core held by any other busy
    # process stalls every op (measured on a shared 2-core machine: 175 s with 2 threads, 8.5 s with 1).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run(output_dir, console, quick, assets, overrides)
    finally:
        torch.set_num_threads(threads)


def _run(output_dir: str, console, quick: bool, assets: Path, overrides: dict) -> dict:
    from fastdpo.config import TrainConfig
    from fastdpo.training.loop import train

    def say(text: str, **kw) -> None:
        if console is not None:
            console.print(text, highlight=False, **kw)

    t0 = time.perf_counter()
    check_assets(assets)
    out = Path(output_dir)
    heldout = load_heldout(QUICK_HELDOUT if quick else HELDOUT, assets)
    settings = {**TRAIN_SETTINGS, **(QUICK_SETTINGS if quick else {}), **overrides}
    # a rerun replaces the demo's earlier outputs; a dir holding anything else is refused by training as usual
    cfg = TrainConfig(model=str(assets / "model"), dataset=[str(assets / "pairs.jsonl")], output_dir=str(out),
                      disable_progress=True, overwrite_output_dir=_demo_dir(out), **settings)
    n_pairs = sum(1 for line in (assets / "pairs.jsonl").open(encoding="utf-8") if line.strip())
    say("[bold]fastdpo demo[/]: DPO on a tiny built-in model, on this CPU, no download")
    say("  task      add two 3-digit numbers; a verifier checks every answer")
    say("  base      0.6M-parameter Qwen3-style model; its SFT teacher often forgot")
    say("            the carry from the tens into the hundreds")
    say(f"  pairs     {n_pairs}: chosen = the correct sum, rejected = the base model's")
    say("            own wrong answer (a typical slip where it has none)")
    say(f"  held-out  {len(heldout)} questions no training saw; greedy answers")
    say(f"  command   {command_line(cfg)}", markup=False, soft_wrap=True)  # one line, to paste as it is

    base_answers = greedy_eval(assets / "model", heldout)
    say(f"base model: {100 * accuracy(heldout, base_answers):.1f}% of held-out answers right; training with DPO")
    result = train(cfg, console=console, progress=False)
    if result.get("final_dir") is None:  # stopped by a signal: the checkpoint is saved, nothing to measure
        say(f"training stopped ({result.get('stopped')}); no final model to measure")
        return result
    tuned_answers = greedy_eval(result["final_dir"], heldout)

    def split(answers: list[str]) -> dict:
        return {"all": accuracy(heldout, answers), "tens_carry": accuracy(heldout, answers, True),
                "no_tens_carry": accuracy(heldout, answers, False)}

    base, tuned = split(base_answers), split(tuned_answers)
    summary = {"base_accuracy": base["all"], "tuned_accuracy": tuned["all"],
               "gain_points": 100 * (tuned["all"] - base["all"]), "base": base, "tuned": tuned,
               "heldout": len(heldout), "steps": cfg.max_steps, "seconds": time.perf_counter() - t0,
               "final_dir": result["final_dir"], "plot": str(out / "metrics.png"), "last": result["last"]}
    answers = [{"question": r["question"], "answer": r["answer"], "base": b, "dpo": t}
               for r, b, t in zip(heldout, base_answers, tuned_answers)]
    (out / "demo_result.json").write_text(json.dumps({**summary, "answers": answers}, indent=1) + "\n")
    if console is not None:
        report(console, summary, answers)
    return {**summary, "answers": answers}


def side_by_side(answers: list[dict], n: int = 6) -> list[dict]:
    """A few held-out answers: ones DPO fixed, then one it broke and one still wrong (if any), then ones right before."""
    fixed = [a for a in answers if a["base"] != a["answer"] and a["dpo"] == a["answer"]]
    broke = [a for a in answers if a["base"] == a["answer"] and a["dpo"] != a["answer"]]
    wrong = [a for a in answers if a["base"] != a["answer"] and a["dpo"] != a["answer"]]
    kept = [a for a in answers if a["base"] == a["answer"] and a["dpo"] == a["answer"]]
    return (fixed[: n - 3] + broke[:1] + wrong[:1] + kept[:1] + fixed[n - 3 :] + kept[1:])[:n]


def report(console, summary: dict, answers: list[dict]) -> None:
    from rich.table import Table

    def mark(a: str, right: str) -> str:
        return f"[green]{a} ✓[/]" if a == right else f"[red]{a or '(empty)'} ✗[/]"

    table = Table(title="held-out answers, side by side", title_justify="left")
    for col in ("question", "correct", "base", "DPO"):
        table.add_column(col, justify="right")
    for a in side_by_side(answers):
        table.add_row(a["question"], a["answer"], mark(a["base"], a["answer"]), mark(a["dpo"], a["answer"]))
    console.print(table)
    b, t = summary["base"], summary["tuned"]
    console.print(f"[bold]held-out accuracy: base {100 * b['all']:.1f}% -> DPO {100 * t['all']:.1f}% "
                  f"({summary['gain_points']:+.1f} points)[/]", highlight=False)
    console.print(f"  {summary['heldout']} questions, greedy answers checked by the verifier, "
                  f"{summary['steps']} DPO steps", highlight=False)
    console.print(f"  with a carry into the hundreds: base {100 * b['tens_carry']:5.1f}%  DPO "
                  f"{100 * t['tens_carry']:5.1f}%", highlight=False)
    console.print(f"  without one:                    base {100 * b['no_tens_carry']:5.1f}%  DPO "
                  f"{100 * t['no_tens_carry']:5.1f}%", highlight=False)
    console.print(f"training plot {summary['plot']}", highlight=False)
    console.print(f"all answers   {Path(summary['plot']).parent / 'demo_result.json'}", highlight=False)
    console.print(f"wall time     {summary['seconds']:.0f} s", highlight=False)
