#!/usr/bin/env bash
# Multi-GPU checks on one host with N GPUs (from the repo root; logs and tables in $OUT):
# 1. Qwen3-1.7B full fine-tuning on the anchor workload, 20 steps, the same global batch (8 pairs) on 1 GPU, with DDP
#    and with FSDP2 on N GPUs: loss curves compared step by step, pairs/s per GPU, peak memory per GPU.
# 2. Qwen3-8B full fine-tuning with FSDP2 (--deepspeed zero3) and the precomputed reference, checkpoint at step 5.
# 3. That sharded checkpoint resumed on one GPU.
set -u
N=${N:-2}; OUT=${OUT:-multi-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/fastdpo-inductor}
python3 benchmarks/make_shape.py qwen3-1.7b /tmp/q17 /tmp/anchor.jsonl --rows 512 > /dev/null
C="--model /tmp/q17 --dataset /tmp/anchor.jsonl --max_steps 20 --learning_rate 1e-6 --logging_steps 1 --seed 1
   --max_tokens_per_batch 4096 --gradient_checkpointing ffn --torch_compile --precompute_ref_log_probs
   --disable_progress true --save_steps 0"
run() { local name=$1; shift; echo "== $name"; timeout ${T_RUN:-240} "$@" --output_dir "$OUT/$name" > "$OUT/$name.log" 2>&1; echo "rc=$?"; }
run 1gpu python3 -m fastdpo train $C --per_device_train_batch_size 8
run ddp torchrun --nproc_per_node "$N" -m fastdpo train $C --per_device_train_batch_size $((8 / N))
run fsdp torchrun --nproc_per_node "$N" -m fastdpo train $C --per_device_train_batch_size $((8 / N)) --fsdp full_shard
python3 benchmarks/compare_runs.py "$OUT/1gpu:1" "$OUT/ddp:$N" "$OUT/fsdp:$N" --tolerance 0.02 | tee "$OUT/compare_1.7b.md"

python3 benchmarks/make_shape.py qwen3-8b /tmp/q8 /tmp/anchor8.jsonl --rows 256 > /dev/null
C8="--model /tmp/q8 --dataset /tmp/anchor8.jsonl --max_steps 10 --learning_rate 1e-6 --logging_steps 1 --seed 1
    --max_tokens_per_batch 4096 --gradient_checkpointing ffn --precompute_ref_log_probs --disable_progress true
    --per_device_train_batch_size $((8 / N)) --save_steps 5"
run 8b_fsdp torchrun --nproc_per_node "$N" -m fastdpo train $C8 --deepspeed zero3
tail -n 3 "$OUT/8b_fsdp/metrics.jsonl"
run 8b_resume_1gpu python3 -m fastdpo train $C8 --per_device_train_batch_size 8 \
  --resume_from_checkpoint "$OUT/8b_fsdp/checkpoint-5"
python3 benchmarks/compare_runs.py "$OUT/8b_fsdp:$N" "$OUT/8b_resume_1gpu:1" --skip 6 --tolerance 0.02 --overlap \
  | tee "$OUT/compare_8b_resume.md"
