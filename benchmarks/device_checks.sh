#!/usr/bin/env bash
# The device checks that need a CUDA machine, in one command (from the repo root; TRL's wheels on PYTHONPATH for the
# comparisons): GPU parity tests, `fastdpo verify` on the flex and compiled paths, a real CUDA out-of-memory message,
# `fastdpo tune` on Qwen3-0.6B, and the Qwen3-0.6B / Qwen3-1.7B ratios against TRL + Liger. Logs land in $OUT.
set -u
OUT=${OUT:-device-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/fastdpo-inductor}
step() { echo "== $1"; }

step "GPU parity tests"
timeout ${T_TESTS:-300} python3 -m pytest -q -m gpu tests/test_gpu.py > "$OUT/gpu_tests.log" 2>&1; tail -n 5 "$OUT/gpu_tests.log"

step "model dirs"
python3 benchmarks/make_shape.py qwen3-0.6b /tmp/q06 /tmp/anchor.jsonl --rows 512 > /dev/null
python3 benchmarks/make_shape.py qwen3-1.7b /tmp/q17 /tmp/anchor17.jsonl --rows 64 > /dev/null

step "verify (flex, compiled, every policy), Qwen3-1.7B shape, bf16"
timeout ${T_VERIFY:-240} python3 -m fastdpo verify --model /tmp/q17 --dataset /tmp/anchor17.jsonl --pairs 8 \
  --max_length 2048 --torch_dtype bfloat16 --json "$OUT/verify.json" > "$OUT/verify.log" 2>&1; echo "rc=$?"; tail -n 25 "$OUT/verify.log"

step "a real CUDA out-of-memory error: Qwen3-1.7B, 64 pairs in one micro-batch, no checkpointing"
timeout ${T_OOM:-180} python3 -m fastdpo train --model /tmp/q17 --dataset /tmp/anchor17.jsonl --output_dir /tmp/oom \
  --per_device_train_batch_size 64 --max_tokens_per_batch 0 --gradient_checkpointing none --max_steps 1 \
  > "$OUT/oom.log" 2>&1; echo "rc=$?"; tail -n 20 "$OUT/oom.log"

step "tune, Qwen3-0.6B on the anchor rows"
timeout ${T_TUNE:-300} python3 -m fastdpo tune --model /tmp/q06 --dataset /tmp/anchor.jsonl --torch_compile \
  --precompute_ref_log_probs --policies none ffn full --budgets 4096 8192 --steps 5 --warmup 2 \
  --json "$OUT/tune.json" > "$OUT/tune.log" 2>&1; echo "rc=$?"; tail -n 15 "$OUT/tune.log"

step "Qwen3-0.6B and Qwen3-1.7B vs TRL + Liger"
C06="--torch_compile --precompute_ref_log_probs"
OUT=$OUT PER_RUN=${T_06:-240} STEPS=20 WARMUP=3 benchmarks/device.sh qwen3-0.6b \
  "--max_tokens_per_batch 4096 --gradient_checkpointing ffn $C06;--max_tokens_per_batch 8192 --gradient_checkpointing ffn $C06;--max_tokens_per_batch 8192 --gradient_checkpointing full $C06" \
  "trl-liger"
OUT=$OUT PER_RUN=${T_17:-300} STEPS=30 WARMUP=3 benchmarks/device.sh qwen3-1.7b \
  "--max_tokens_per_batch 4096 --gradient_checkpointing ffn --torch_compile --precompute_ref_log_probs" "trl-liger"
