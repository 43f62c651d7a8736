"""Scratch: where the job's start-up goes, with the kernel builds on a thread, in a child process, or after loading."""
import os, sys, time, json, subprocess
T0 = time.perf_counter()
mode, par, model_dir, rows = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
os.environ["TOKENIZERS_PARALLELISM"] = "false"
marks = {}
def mark(k): marks[k] = round(time.perf_counter() - T0, 2)
import torch
mark("torch")
from fastdpo.config import TrainConfig
import fastdpo.training.setup as S
from fastdpo.data.load import load_rows
from fastdpo.data.prepare import DataOptions, tokenize_pairs
from fastdpo.model import kernels as K
mark("fastdpo")
cfg = TrainConfig(model=model_dir, dataset=[rows], output_dir="/tmp/x")
dev = torch.device("cuda"); dt = torch.bfloat16
child = None
CHILD = ("import torch, fastdpo.training.setup as S;"
         f"S.build_kernels_ahead({model_dir!r}, torch.bfloat16, torch.device('cuda'), False, False, 0);"
         "import fastdpo.model.kernels as K; t=list(K._builds.values())[0]; t.join(); print('child failed', K._failed)")
if mode == "thread":
    S.build_kernels_ahead(cfg.model, dt, dev, False, False, 0)
elif mode == "proc":
    child = subprocess.Popen([sys.executable, "-c", CHILD])
mark("build_started")
tok = S.load_tokenizer(cfg.model, False); mark("tokenizer")
opts = DataOptions.from_config(cfg)
rs = load_rows(cfg.dataset, cfg.seed, cfg.split, opts.read); mark("rows")
if par == "1":
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
pairs, summary = tokenize_pairs(rs, tok, opts); mark("tokenized")
os.environ["TOKENIZERS_PARALLELISM"] = "false"
model = S.load_model(cfg.model, dt, dev, False, "", 0); torch.cuda.synchronize(); mark("model")
if child is not None:
    child.wait(); mark("child_done")
lm = S.base_causal_lm(model)
why = K.ready(K.norm_widths(lm.config), dt, dev, K.head_size(lm.config), False, 0); mark("kernels_ready")
print("RESULT", json.dumps({"mode": mode, "par": par, "why": why, **marks}), flush=True)
