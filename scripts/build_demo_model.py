"""Build the embedded demo shipped in src/fastdpo/assets/demo/ (deterministic, CPU only, no download).

    PYTHONPATH=src python scripts/build_demo_model.py            # writes src/fastdpo/assets/demo/
    PYTHONPATH=src python scripts/build_demo_model.py --out DIR  # anywhere else

Takes about 17 minutes on a 2-core CPU (it runs on one thread). From nothing but a seed it makes:

1. model/: a character-level tokenizer (digits, '+', <bos>/<eos>/<pad>, <|user|>/<|assistant|>) with a chat template,
   and a tiny Qwen3-style model (4 layers, hidden 128, 0.6M parameters) trained from random init with supervised
   fine-tuning on 3-digit addition: "<bos><|user|>347+589<|assistant|>" -> "936<eos>", loss on the answer only.
   The demonstrations come from a sloppy teacher who, when the tens column carries into the hundreds, forgets that
   carry 60% of the time (writes the sum minus 100). Trained to convergence, the model has learned both habits and
   answers greedily with the more frequent one: right on every problem without that carry, wrong on nearly every
   problem with it (about half of all problems). Right often, not reliably.
2. pairs.jsonl: 4096 preference pairs on prompts the SFT never saw. chosen = the correct sum (the verifier's
   answer). rejected = the base model's own wrong answer: its greedy answer when that is wrong, else a wrong one
   among 8 samples at temperature 1, else (the model is sure and right) a typical slip made by hand: the sum with
   its carries dropped, or one digit off by one. The hand-made slips keep DPO honest on problems the model already
   gets right.
3. heldout.jsonl: 500 prompts disjoint from the SFT, validation and preference prompts, with their answers.
4. manifest.json: the settings, base accuracies (overall and split by the tens carry), where the rejected answers
   came from, and the sha256 of every file.

Determinism: fixed seeds, one thread and torch's deterministic algorithms, so the same torch version gives the same
bytes (compare the sha256 in manifest.json).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import time
from pathlib import Path

import torch

from fastdpo.commands.demo import char_tokenizer, generate_answers, prompt_text, question, tens_carry, verify
from fastdpo.model.tiny import tiny_config

ROOT = Path(__file__).resolve().parents[1]


def problems(rng: random.Random, n: int, exclude: set[str]) -> list[str]:
    """`n` distinct random 3-digit addition questions ("347+589") not in `exclude`."""
    out: list[str] = []
    seen = set(exclude)
    while len(out) < n:
        q = question(rng.randint(100, 999), rng.randint(100, 999))
        if q not in seen:
            seen.add(q)
            out.append(q)
    return out


def answer(q: str) -> str:
    a, b = q.split("+")
    return str(int(a) + int(b))


def typical_mistake(q: str, rng: random.Random) -> str:
    """A plausible wrong sum: one carry dropped, or one digit off by one."""
    a, b = (int(x) for x in q.split("+"))
    right = a + b
    no_carry = int("".join(str((int(x) + int(y)) % 10) for x, y in zip(str(a), str(b))))
    if no_carry != right and rng.random() < 0.5:
        return str(no_carry)
    digits = list(str(right))
    i = rng.randrange(len(digits))
    d = int(digits[i])
    digits[i] = str(d + 1 if d < 9 and (rng.random() < 0.5 or d == 0) else d - 1)
    return "".join(digits).lstrip("0") or "0"


def sft_batch(tok, qs: list[str], answers: list[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids, attention mask and labels (-100 outside the answer and its <eos>)."""
    p_ids = tok([prompt_text(q) for q in qs])["input_ids"]
    full = tok([prompt_text(q) + a + tok.eos_token for q, a in zip(qs, answers)])["input_ids"]
    width = max(len(f) for f in full)
    ids = torch.full((len(qs), width), tok.pad_token_id)
    labels = torch.full((len(qs), width), -100)
    mask = torch.zeros((len(qs), width), dtype=torch.long)
    for i, (p, f) in enumerate(zip(p_ids, full)):
        ids[i, : len(f)] = torch.tensor(f)
        mask[i, : len(f)] = 1
        labels[i, len(p) : len(f)] = torch.tensor(f[len(p) :])
    return ids, mask, labels


def teacher_answer(q: str, rng: random.Random, sloppy: float) -> str:
    """The demonstration: the correct sum, except that with probability `sloppy` the teacher forgets the carry from
    the tens into the hundreds (a common human slip), writing the sum minus 100."""
    right = int(answer(q))
    return str(right - 100) if tens_carry(q) and rng.random() < sloppy else str(right)


def train_sft(model, tok, rng: random.Random, exclude: set[str], val: list[str], args) -> dict:
    """SFT on the teacher's demonstrations for a fixed number of steps (warm-up then cosine decay)."""
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    warmup = 100
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.sft_steps))))
    stats: dict = {}
    for step in range(1, args.sft_steps + 1):
        model.train()
        qs = problems(rng, args.batch_size, exclude)
        ids, mask, labels = sft_batch(tok, qs, [teacher_answer(q, rng, args.sloppy) for q in qs])
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % args.eval_every == 0 or step == args.sft_steps:
            stats = split_accuracy(model, tok, val)
            print(f"sft step {step}: loss {loss.item():.4f}  val accuracy {stats}", flush=True)
    return stats


def split_accuracy(model, tok, qs: list[str]) -> dict:
    """Greedy accuracy overall and on problems with / without a carry from the tens into the hundreds."""
    got = generate_answers(model, tok, qs)
    ok = [verify(q, a) for q, a in zip(qs, got)]
    carry = [tens_carry(q) for q in qs]

    def mean(xs: list) -> float:
        return round(sum(xs) / max(1, len(xs)), 4)

    return {"all": mean(ok), "tens_carry": mean([o for o, c in zip(ok, carry) if c]),
            "no_tens_carry": mean([o for o, c in zip(ok, carry) if not c])}


def preference_rows(model, tok, qs: list[str], rng: random.Random, samples: int) -> tuple[list[dict], dict]:
    """chosen = the correct sum; rejected = the model's own wrong answer (greedy, else sampled, else a slip by hand)."""
    wrong: list[str | None] = [a if not verify(q, a) else None for q, a in zip(qs, generate_answers(model, tok, qs))]
    counts = {"greedy": sum(w is not None for w in wrong), "sampled": 0, "by_hand": 0}
    for round_ in range(samples):
        todo = [i for i, w in enumerate(wrong) if w is None]
        got = generate_answers(model, tok, [qs[i] for i in todo], temperature=1.0, seed=round_)
        for i, a in zip(todo, got):
            if a.isdigit() and not verify(qs[i], a):
                wrong[i] = a
                counts["sampled"] += 1
    rows = []
    for q, w in zip(qs, wrong):  # deterministic order: the hand-made slips draw from `rng` in prompt order
        if w is None:
            w = typical_mistake(q, rng)
            counts["by_hand"] += 1
        rows.append({"prompt": prompt_text(q), "chosen": answer(q), "rejected": w})
    return rows, counts


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def save_portable_tokenizer(tok, path: Path) -> None:
    """save_pretrained, then name the tokenizer the way transformers 4.x and 5.x both load it."""
    tok.save_pretrained(path)
    f = path / "tokenizer_config.json"
    conf = json.loads(f.read_text())
    for key in ("backend", "is_local", "local_files_only"):  # v5-only or load-time keys
        conf.pop(key, None)
    extra = conf.pop("extra_special_tokens", None)
    if isinstance(extra, list) and extra:
        conf["additional_special_tokens"] = extra
    conf["tokenizer_class"] = "PreTrainedTokenizerFast"
    f.write_text(json.dumps(conf, indent=2, sort_keys=True) + "\n")


def refresh_manifest(out: Path) -> None:
    """Recompute the file digests and size of an existing build (after rewriting one of its files)."""
    m = out / "manifest.json"
    manifest = json.loads(m.read_text())
    files = sorted(p for p in out.rglob("*") if p.is_file() and p.name != "manifest.json")
    manifest["files"] = {str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}
    manifest["bytes"] = sum(p.stat().st_size for p in files)
    m.write_text(json.dumps(manifest, indent=1) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "src/fastdpo/assets/demo"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch_size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--sft_steps", type=int, default=3000)
    ap.add_argument("--sloppy", type=float, default=0.6, help="How often the SFT teacher forgets the tens carry.")
    ap.add_argument("--eval_every", type=int, default=250)
    ap.add_argument("--pairs", type=int, default=4096)
    ap.add_argument("--heldout", type=int, default=500)
    ap.add_argument("--samples", type=int, default=8, help="Sampling rounds to find a wrong answer of the model's own.")
    args = ap.parse_args()

    torch.set_num_threads(1)  # one thread: the same floating-point sums on every machine
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    t0 = time.time()

    tok = char_tokenizer()
    heldout = problems(rng, args.heldout, set())
    val = problems(rng, 500, set(heldout))
    dpo_qs = problems(rng, args.pairs, set(heldout) | set(val))
    never_sft = set(heldout) | set(val) | set(dpo_qs)

    from transformers import AutoModelForCausalLM

    cfg = tiny_config("qwen3", len(tok), hidden=args.hidden, layers=args.layers, max_position_embeddings=64,
                      pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    val_acc = train_sft(model, tok, rng, never_sft, val, args)

    pairs, counts = preference_rows(model, tok, dpo_qs, rng, args.samples)
    heldout_acc = split_accuracy(model, tok, heldout)

    out = Path(args.out)
    (out / "model").mkdir(parents=True, exist_ok=True)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out / "model", safe_serialization=True)
    save_portable_tokenizer(tok, out / "model")
    write_jsonl(out / "pairs.jsonl", pairs)
    write_jsonl(out / "heldout.jsonl", [{"prompt": prompt_text(q), "question": q, "answer": answer(q)} for q in heldout])
    files = sorted(p for p in out.rglob("*") if p.is_file() and p.name != "manifest.json")
    manifest = {
        "task": "3-digit addition, character-level, greedy answer checked by fastdpo.commands.demo.verify",
        "settings": vars(args) | {"out": None},
        "val_accuracy": val_acc,
        "heldout_accuracy": heldout_acc,
        "rejected_source": counts,
        "params": sum(p.numel() for p in model.parameters()),
        "torch": torch.__version__,
        "files": {str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files},
        "bytes": sum(p.stat().st_size for p in files),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(json.dumps({k: manifest[k] for k in ("val_accuracy", "heldout_accuracy", "rejected_source",
                                                "params", "bytes")}))
    print(f"built {out} in {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
