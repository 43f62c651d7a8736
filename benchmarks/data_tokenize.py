"""Benchmark: peak RSS and rows/s of tokenising a large JSONL with `--streaming` (not a test).

    python benchmarks/data_tokenize.py --rows 1000000 --workers 2

Writes a synthetic preference JSONL (plain-text rows, plus a share of conversational rows rendered through the
ChatML template), trains a byte-level BPE tokenizer on a sample of it (a stand-in for a real model's; pass
--tokenizer DIR to use one), then reads one full epoch through `PairStream` exactly as training does: lazy reading,
worker processes, the seeded shuffle buffer. Peak memory sums this process and its workers (see PeakMemory).
`--mode memory` runs the in-memory path (`load_pairs`, no cache) for comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import threading
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "ta", "shi", "po", "den", "var", "qu", "el", "an", "or", "is", "th", "ber"]


def make_words(n: int, rng: random.Random) -> list[str]:
    return ["".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(n)]


def sentence(words: list[str], rng: random.Random, lo: int, hi: int) -> str:
    text = " ".join(rng.choice(words) for _ in range(rng.randint(lo, hi)))
    return text[0].upper() + text[1:] + "."


def write_data(path: Path, rows: int, conversational: float, seed: int = 0) -> None:
    rng = random.Random(seed)
    words = make_words(5000, rng)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(rows):
            p, c, r = sentence(words, rng, 20, 60), sentence(words, rng, 10, 40), sentence(words, rng, 10, 40)
            if rng.random() < conversational:
                row = {"prompt": [{"role": "user", "content": p}], "chosen": [{"role": "assistant", "content": c}],
                       "rejected": [{"role": "assistant", "content": r}]}
            else:
                row = {"prompt": p, "chosen": " " + c, "rejected": " " + r}
            f.write(json.dumps(row) + "\n")


def train_tokenizer(data: Path, out: Path, sample_rows: int = 20000):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from fastdpo.data.template import BUILTIN_TEMPLATES

    def texts():
        with open(data, encoding="utf-8") as f:
            for i, line in enumerate(f):
                if i == sample_rows:
                    return
                row = json.loads(line)
                yield " ".join(v if isinstance(v, str) else v[0]["content"] for v in row.values())

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator(texts(), trainers.BpeTrainer(vocab_size=16000, special_tokens=specials,
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=specials[1:])
    fast.chat_template = BUILTIN_TEMPLATES["chatml"]
    fast.save_pretrained(out)


class PeakMemory:
    """Peak memory of this process plus its workers, sampled in a thread: `rss` sums resident sets (pages the forked
    workers share with this process count once per process), `pss` sums proportional sets (shared pages split
    between the processes sharing them: the machine's real total)."""

    def __init__(self, every: float = 0.25):
        import psutil

        self.proc, self.every, self.rss, self.pss, self._stop = psutil.Process(), every, 0, 0, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import psutil

        while not self._stop.is_set():
            rss = pss = 0
            for p in [self.proc, *self.proc.children(recursive=True)]:
                try:
                    m = p.memory_full_info()
                except psutil.NoSuchProcess:
                    continue
                rss, pss = rss + m.rss, pss + m.pss
            self.rss, self.pss = max(self.rss, rss), max(self.pss, pss)
            time.sleep(self.every)

    def __enter__(self) -> PeakMemory:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self.thread.join()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--workers", type=int, default=2, help="--dataloader_num_workers (streaming) or --dataset_num_proc")
    ap.add_argument("--mode", choices=("stream", "memory"), default="stream")
    ap.add_argument("--conversational", type=float, default=0.25, help="Share of conversational rows.")
    ap.add_argument("--workdir", default="/tmp/fastdpo-bench")
    ap.add_argument("--tokenizer", default="", help="A model/tokenizer dir (default: a BPE trained here).")
    ap.add_argument("--max_length", type=int, default=2048)
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from fastdpo.data.prepare import DataOptions, load_pairs
    from fastdpo.data.stream import PairStream
    from fastdpo.data.tokenize import TokenizeOptions

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    data = work / f"prefs-{args.rows}-{args.conversational}.jsonl"
    if not data.exists():
        t = time.perf_counter()
        write_data(data, args.rows, args.conversational)
        print(f"wrote {data} ({data.stat().st_size / 2**20:.0f} MiB) in {time.perf_counter() - t:.0f} s")
    tok_dir = Path(args.tokenizer) if args.tokenizer else work / "bpe16k"
    if not (tok_dir / "tokenizer.json").exists() and not args.tokenizer:
        train_tokenizer(data, tok_dir)
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)

    opts = DataOptions(TokenizeOptions(max_length=args.max_length), streaming=args.mode == "stream",
                       num_workers=args.workers, num_proc=args.workers, use_cache=False)
    tokens = pairs = 0
    t0 = time.perf_counter()
    cpu0 = sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
               for f in ("ru_utime", "ru_stime"))
    with PeakMemory() as mem:
        if args.mode == "stream":
            stream = PairStream([str(data)], tokenizer, opts)
            left = args.rows
            while left:
                got = stream.take(min(4096, left))
                left -= len(got)
                pairs += len(got)
                tokens += sum(p.num_tokens for p in got)
            stream.close()
        else:
            got, _ = load_pairs([str(data)], tokenizer, opts)
            pairs, tokens = len(got), sum(p.num_tokens for p in got)
    secs = time.perf_counter() - t0
    cpu = sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
              for f in ("ru_utime", "ru_stime")) - cpu0
    result = {
        "mode": args.mode, "rows": args.rows, "workers": args.workers, "pairs": pairs, "tokens": tokens,
        "seconds": round(secs, 1), "rows_per_s": round(args.rows / secs), "tokens_per_s": round(tokens / secs),
        "cpu_seconds": round(cpu, 1), "rows_per_cpu_s": round(args.rows / cpu),
        "peak_rss_mib": round(mem.rss / 2**20), "peak_pss_mib": round(mem.pss / 2**20),
        "file_mib": round(data.stat().st_size / 2**20),
        "cpus": os.cpu_count(), "cpu": platform.processor() or platform.machine(),
        "load_avg_1m": round(os.getloadavg()[0], 1),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
