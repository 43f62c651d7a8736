"""FP8 training's quality against bf16 on a task with a verifier: the demo's (add two 3-digit numbers; the base model
forgets the carry from the tens, DPO on its own mistakes fixes it), on a CUDA GPU with FP8 tensor cores.

    python benchmarks/fp8_quality.py --out /tmp/fp8q [--seeds 0 1 2] [--modes bf16 rowwise tensorwise]

For each mode and seed: `fastdpo.training.loop.train` on the demo's pairs with the demo's settings (bf16 weights on
the GPU; `rowwise` / `tensorwise`: `--fp8 --fp8_recipe ...`), then greedy held-out accuracy of the saved model (the
demo's verifier, 500 questions no training saw). Reported per mode: the held-out gain in points (mean and spread
over seeds), the reward-accuracy curve (`rewards/accuracies` of each logged step, mean over seeds), and at step 0
the per-token log-prob error of the FP8 forward against the bf16 one (mean and max |difference| over the held-out
chosen answers' tokens, nats). Writes OUT/fp8_quality.json and OUT/fp8_quality.png; prints one `RESULT {json}`.
`--device cpu --modes bf16` checks the harness on the CPU (FP8 needs the GPU)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

SRC = Path(__file__).resolve().parent.parent / "src"
if str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))

from fastdpo.commands import demo  # noqa: E402


def train_one(mode: str, seed: int, out: Path, device: str, steps: int | None) -> dict:
    from fastdpo.config import TrainConfig
    from fastdpo.training.loop import train

    run = out / f"{mode}-seed{seed}"
    fp8 = {} if mode == "bf16" else {"fp8": True, "fp8_recipe": mode}
    settings = {**demo.TRAIN_SETTINGS, "seed": seed, "plot": False, **({"max_steps": steps} if steps else {})}
    cfg = TrainConfig(model=str(demo.ASSETS / "model"), dataset=[str(demo.ASSETS / "pairs.jsonl")],
                      output_dir=str(run), disable_progress=True, overwrite_output_dir=True, device=device,
                      torch_dtype="bfloat16" if device == "cuda" else "float32", **fp8, **settings)
    t0 = time.perf_counter()
    result = train(cfg, progress=False)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    curve = [(r["step"], r["rewards/accuracies"]) for r in rows if "rewards/accuracies" in r and "step" in r]
    return {"final_dir": result["final_dir"], "curve": curve, "train_s": round(time.perf_counter() - t0, 2)}


def step0_logprob_error(mode: str, device: str, heldout: list[dict]) -> dict:
    """Per-token log-probs of the held-out chosen answers under the base model with FP8 products (`mode`) against
    the same model in bf16: mean and max |difference| in nats."""
    from transformers import AutoModelForCausalLM

    from fastdpo.model.fp8 import convert_to_fp8_training

    tok = demo.char_tokenizer()
    texts = [demo.prompt_text(r["question"]) + r["answer"] + "<eos>" for r in heldout]
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    width = max(map(len, ids))
    batch = torch.tensor([x + [tok.pad_token_id] * (width - len(x)) for x in ids], device=device)
    valid = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in ids], device=device)

    def logps(model):
        with torch.no_grad():
            out = model(input_ids=batch, attention_mask=valid).logits.float().log_softmax(-1)
        return out[:, :-1].gather(-1, batch[:, 1:, None]).squeeze(-1)

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    base = AutoModelForCausalLM.from_pretrained(str(demo.ASSETS / "model"), dtype=dtype).to(device).eval()
    want = logps(base)
    convert_to_fp8_training(base, mode)
    diff = (logps(base) - want).abs()[valid[:, 1:].bool()]
    return {"mean_abs_nats": diff.mean().item(), "max_abs_nats": diff.max().item(), "tokens": diff.numel()}


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for mode, s in summary["modes"].items():
        steps = [p[0] for p in s["curve_mean"]]
        b.plot(steps, [p[1] for p in s["curve_mean"]], label=mode)
        a.errorbar([mode], [s["gain_mean"]], yerr=[s["gain_spread"] / 2], fmt="o", capsize=6)
    a.set_ylabel("held-out gain (points)")
    a.set_title(f"DPO's held-out gain, {summary['heldout']} questions, {len(summary['seeds'])} seeds")
    b.set_xlabel("step")
    b.set_ylabel("rewards/accuracies")
    b.set_title("reward accuracy (mean over seeds)")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--modes", nargs="+", default=["bf16", "rowwise", "tensorwise"],
                   choices=["bf16", "rowwise", "tensorwise"])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--heldout", type=int, default=demo.HELDOUT)
    p.add_argument("--steps", type=int, default=None, help="max_steps instead of the demo's (harness checks)")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    heldout = demo.load_heldout(a.heldout)
    base = demo.accuracy(heldout, demo.greedy_eval(demo.ASSETS / "model", heldout))
    summary = {"heldout": len(heldout), "seeds": a.seeds, "base_accuracy": base, "modes": {}}
    for mode in a.modes:
        runs = []
        for seed in a.seeds:
            r = train_one(mode, seed, out, a.device, a.steps)
            r["accuracy"] = demo.accuracy(heldout, demo.greedy_eval(r["final_dir"], heldout))
            r["gain"] = 100 * (r["accuracy"] - base)
            runs.append(r)
            print(f"{mode} seed {seed}: held-out {100 * r['accuracy']:.1f}% (gain {r['gain']:+.1f} points), "
                  f"train {r['train_s']} s", flush=True)
        gains = [r["gain"] for r in runs]
        steps = [s for s, _ in runs[0]["curve"]]
        curve = [(s, statistics.mean(dict(r["curve"]).get(s, float("nan")) for r in runs)) for s in steps]
        entry = {"gains": gains, "gain_mean": statistics.mean(gains), "gain_spread": max(gains) - min(gains),
                 "curve_mean": curve, "runs": [{k: v for k, v in r.items() if k != "final_dir"} for r in runs]}
        if mode != "bf16":
            entry["step0_logprob_error"] = step0_logprob_error(mode, a.device, heldout)
        summary["modes"][mode] = entry
    (out / "fp8_quality.json").write_text(json.dumps(summary, indent=1) + "\n")
    plot(summary, out / "fp8_quality.png")
    print("RESULT " + json.dumps({m: {"gain_mean": round(s["gain_mean"], 2), "gain_spread": round(s["gain_spread"], 2),
                                      **({"step0": s["step0_logprob_error"]} if "step0_logprob_error" in s else {})}
                                  for m, s in summary["modes"].items()}), flush=True)


if __name__ == "__main__":
    main()
