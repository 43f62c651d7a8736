#!/usr/bin/env bash
# The device checks that need a CUDA machine, in one command (from the repo root; TRL's wheels on PYTHONPATH for the
# comparisons). Two streams: `checks` (GPU parity tests, a real CUDA out-of-memory message, `fastdpo verify` on the flex
# and compiled paths) and `speed` (Qwen3-0.6B against TRL + Liger in one invocation, then `fastdpo tune` on Qwen3-0.6B).
# With two GPUs visible the streams run side by side, one GPU each; otherwise one after the other.
# Logs land in $OUT/logs and are packed into $OUT/logs.tgz at the end; summaries are printed.
set -u
OUT=${OUT:-device-out}; LOGS=$OUT/logs; mkdir -p "$LOGS"
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/fastdpo-inductor}

checks() {
  echo "== GPU parity tests"
  timeout -k 20 ${T_TESTS:-200} python3 -m pytest -q -m gpu tests/model/test_gpu.py > "$LOGS/gpu_tests.log" 2>&1
  echo "rc=$?"; tail -n 8 "$LOGS/gpu_tests.log"
  python3 benchmarks/make_shape.py qwen3-1.7b /tmp/q17 /tmp/anchor17.jsonl --rows 64 > /dev/null
  echo "== a real CUDA out-of-memory error: Qwen3-1.7B, 64 pairs in one micro-batch, no checkpointing"
  timeout -k 20 ${T_OOM:-90} python3 -m fastdpo train --model /tmp/q17 --dataset /tmp/anchor17.jsonl --output_dir /tmp/oom \
    --per_device_train_batch_size 64 --max_tokens_per_batch 0 --gradient_checkpointing none --max_steps 1 \
    > "$LOGS/oom.log" 2>&1; echo "rc=$?"; tail -n 20 "$LOGS/oom.log"
  echo "== verify (flex, compiled, every policy), Qwen3-1.7B shape, bf16"
  timeout -k 20 ${T_VERIFY:-200} python3 -m fastdpo verify --model /tmp/q17 --dataset /tmp/anchor17.jsonl --pairs 4 \
    --max_length 2048 --torch_dtype bfloat16 --json "$LOGS/verify.json" > "$LOGS/verify.log" 2>&1
  echo "rc=$?"; tail -n 25 "$LOGS/verify.log"
}

speed() {
  echo "== Qwen3-0.6B vs TRL + Liger"
  C06="--torch_compile --precompute_ref_log_probs"
  OUT=$LOGS PER_RUN=${T_06:-150} STEPS=20 WARMUP=3 benchmarks/device.sh qwen3-0.6b \
    "--max_tokens_per_batch 16384 --gradient_checkpointing none $C06;--max_tokens_per_batch 8192 --gradient_checkpointing none $C06;--max_tokens_per_batch 4096 --gradient_checkpointing ffn $C06" \
    "trl-liger"
  python3 benchmarks/make_shape.py qwen3-0.6b /tmp/q06 /tmp/anchor.jsonl --rows 256 > /dev/null
  echo "== tune, Qwen3-0.6B on the anchor rows"
  timeout -k 20 ${T_TUNE:-150} python3 -m fastdpo tune --model /tmp/q06 --dataset /tmp/anchor.jsonl $C06 \
    --policies none ffn --budgets 8192 16384 --steps 4 --warmup 1 \
    --json "$LOGS/tune.json" > "$LOGS/tune.log" 2>&1; echo "rc=$?"; tail -n 15 "$LOGS/tune.log"
}

if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  CUDA_VISIBLE_DEVICES=0 checks > "$LOGS/checks.txt" 2>&1 &
  CUDA_VISIBLE_DEVICES=1 speed > "$LOGS/speed.txt" 2>&1
  wait
  cat "$LOGS/checks.txt" "$LOGS/speed.txt"
else
  checks; speed
fi
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$LOGS"
