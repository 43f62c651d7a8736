#!/usr/bin/env bash
# Multi-GPU checks on one host with N GPUs (from the repo root; logs packed into $OUT/logs.tgz, tables printed).
# First the GPU links (nvidia-smi topo) and the collectives' bandwidth (benchmarks/nccl_probe.py; PROBE=0 skips it).
# PARTS picks what runs (default: all), in this order:
#   bf16   Qwen3-1.7B full fine-tuning on the anchor workload, 20 steps of GLOBAL pairs (default 32: 8 per micro-step,
#          accumulated), compiled, on 1 GPU, with DDP, FSDP2 full_shard and FSDP2 shard_grad_op (no re-gather in
#          backward) on N GPUs: loss per step, pairs/s per GPU (steps 4-18), peak memory per GPU; steps 19-20 are
#          profiled (--profile_steps): where each rank's device time went (compute, exposed communication, idle).
#   sr     with bf16, on GPU 1 beside the 1-GPU run: the same run with --update_rounding nearest (torch's fused AdamW),
#          the cost of the stochastic-rounding AdamW (the default).
#   fp32   Qwen3-0.6B in float32, 6 steps of 8 pairs, on 1 GPU (beside the bf16 1-GPU run), with DDP and FSDP2: the loss
#          curves must agree to float32 rounding, which separates the distributed code's correctness from the bf16
#          rounding of different micro-batch layouts.
#   resume the bf16 FSDP2 run's sharded checkpoint (step 10) resumed on one GPU: steps 11-20 against the FSDP2 run's.
#   8b     Qwen3-8B full fine-tuning with FSDP2 (--deepspeed zero3) and the precomputed reference, STEPS8B steps
#          (default 10), at most CAP8B seconds (default 400).
#   trl8b  TRL + Liger on the same model and rows with FSDP2 through accelerate (benchmarks/trl_fsdp.py; TRL's wheels
#          on PYTHONPATH), STEPS8B measured steps after 2; TRL without Liger when that does not run.
# WARMUP=1 builds every micro-batch length's kernels before step 1 (--compile_warmup) in the 1.7B and 8B runs.
# MEMORY=1 also records the profiled steps' GPU allocations (--profile_memory; memory.txt per rank in the logs).
# Each run gets at most the time left before DEADLINE seconds (default 560), so that the logs are always packed.
set -u
N=${N:-2}; OUT=${OUT:-multi-out}; LOGS=$OUT/logs; mkdir -p "$LOGS"; PARTS=" ${PARTS:-bf16 sr fp32 resume 8b trl8b} "
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/fastdpo-inductor}
RUNS=/tmp/multi-runs; mkdir -p "$RUNS"
has() { [[ "$PARTS" == *" $1 "* ]]; }
run() {
  local name=$1 t=$2; shift 2
  local left=$(( ${DEADLINE:-560} - SECONDS - 20 )); [ "$left" -lt "$t" ] && t=$left
  [ "$t" -lt 30 ] && { echo "== $name: skipped, no time left"; return; }
  echo "== $name: $*" | tr -s ' \n' ' '; echo
  timeout -k 20 "$t" "$@" --output_dir "$RUNS/$name" > "$LOGS/$name.log" 2>&1; echo "rc=$?"
  grep -E "Error|error:" "$LOGS/$name.log" | tail -n 3
  cp "$RUNS/$name/metrics.jsonl" "$LOGS/$name.metrics.jsonl" 2>/dev/null
  for s in "$RUNS/$name"/profile/rank*/summary.json; do
    [ -f "$s" ] || continue; r=$(basename "$(dirname "$s")"); cp "$s" "$LOGS/$name.$r.profile.json"
    cp "$(dirname "$s")/top.txt" "$LOGS/$name.$r.top.txt"
    cp "$(dirname "$s")/trace.json.gz" "$OUT/$name.$r.trace.json.gz" 2>/dev/null
    cp "$(dirname "$s")/memory.txt" "$LOGS/$name.$r.memory.txt" 2>/dev/null
    python3 -c "import json,sys; print('   profile $r:', json.load(open(sys.argv[1]))['line'])" "$s"
  done
}
echo "== GPU links and collective bandwidth"
nvidia-smi topo -m 2>&1 | head -n $((N + 2))
if [ "${PROBE:-1}" = 1 ]; then
  timeout -k 10 60 torchrun --nproc_per_node "$N" benchmarks/nccl_probe.py 2>&1 | grep -E "GB/s|Error"
fi
GLOBAL=${GLOBAL:-32}; per=$((8 / N)); [ "$GLOBAL" -ge 16 ] && per=8
accum1=$((GLOBAL / 8)); accumN=$((GLOBAL / (per * N)))
[ -d /tmp/q17 ] || python3 benchmarks/make_shape.py qwen3-1.7b /tmp/q17 /tmp/anchor.jsonl --rows $((20 * GLOBAL)) > /dev/null
PM=""; [ "${MEMORY:-0}" = 1 ] && PM=--profile_memory
W8=""; [ "${WARMUP:-0}" = 1 ] && PM="$PM --compile_warmup" && W8=--compile_warmup
C="--model /tmp/q17 --dataset /tmp/anchor.jsonl --max_steps 20 --learning_rate 1e-6 --logging_steps 1 --seed 1
   --max_tokens_per_batch 4096 --gradient_checkpointing ffn --precompute_ref_log_probs --disable_progress true
   --torch_compile --torch_dtype bfloat16 --profile_steps 19-20 $PM --per_device_train_batch_size"
ONE="env CUDA_VISIBLE_DEVICES=0 python3 -m fastdpo train"; MANY="torchrun --nproc_per_node $N -m fastdpo train"
ONE1="env CUDA_VISIBLE_DEVICES=1 python3 -m fastdpo train"; [ "$N" -lt 2 ] && ONE1=$ONE
if has fp32; then
  [ -d /tmp/q06 ] || python3 benchmarks/make_shape.py qwen3-0.6b /tmp/q06 /tmp/anchor06.jsonl --rows 48 > /dev/null
  F="--model /tmp/q06 --dataset /tmp/anchor06.jsonl --max_steps 6 --learning_rate 1e-5 --logging_steps 1 --seed 1
     --max_tokens_per_batch 4096 --precompute_ref_log_probs --disable_progress true --torch_compile
     --torch_dtype float32 --save_steps 0 --per_device_train_batch_size"
fi
(  # on GPU 1 beside the 1-GPU bf16 run on GPU 0 (one after the other with N=1)
  if has sr; then run 1gpu_nearest 180 $ONE1 $C 8 --gradient_accumulation_steps $accum1 --save_steps 0 \
    --update_rounding nearest; fi
  if has fp32; then run 1gpu_fp32 120 $ONE1 $F 8; fi
) &
[ "$N" -lt 2 ] && wait
if has bf16; then run 1gpu 180 $ONE $C 8 --gradient_accumulation_steps $accum1 --save_steps 0; fi
wait
if has sr; then
  python3 benchmarks/compare_runs.py "$RUNS/1gpu_nearest:1" "$RUNS/1gpu:1" --skip 3 --until 18 --tolerance 0.05 \
    | tee "$LOGS/compare_rounding.md"
fi
if has bf16; then
  B="$C $per --gradient_accumulation_steps $accumN"
  run ddp 180 $MANY $B --save_steps 0
  run fsdp_zero2 180 $MANY $B --fsdp shard_grad_op --save_steps 0
  save=0; has resume && save=10  # the checkpoint the resume part starts from
  run fsdp 180 $MANY $B --fsdp full_shard --save_steps $save
  python3 benchmarks/compare_runs.py "$RUNS/1gpu:1" "$RUNS/ddp:$N" "$RUNS/fsdp:$N" "$RUNS/fsdp_zero2:$N" --skip 3 \
    --until 18 --tolerance 0.05 | tee "$LOGS/compare_1.7b.md"
fi
if has fp32; then
  run ddp_fp32 100 $MANY $F $((8 / N))
  run fsdp_fp32 100 $MANY $F $((8 / N)) --fsdp full_shard
  python3 benchmarks/compare_runs.py "$RUNS/1gpu_fp32:1" "$RUNS/ddp_fp32:$N" "$RUNS/fsdp_fp32:$N" --skip 2 \
    --tolerance 1e-3 | tee "$LOGS/compare_0.6b_fp32.md"
fi
if has resume; then
  run resume_1gpu 150 $ONE $C 8 --gradient_accumulation_steps $accum1 --save_steps 0 \
    --resume_from_checkpoint "$RUNS/fsdp/checkpoint-10"
  python3 benchmarks/compare_runs.py "$RUNS/fsdp:$N" "$RUNS/resume_1gpu:1" --skip 12 --tolerance 0.05 --overlap \
    | tee "$LOGS/compare_resume.md"
fi
if has 8b; then
  python3 benchmarks/make_shape.py qwen3-8b /tmp/q8 /tmp/anchor8.jsonl --rows 96 > /dev/null
  run 8b_fsdp ${CAP8B:-400} $MANY --model /tmp/q8 --dataset /tmp/anchor8.jsonl --max_steps ${STEPS8B:-10} --learning_rate 1e-6 \
    --logging_steps 1 --seed 1 --max_tokens_per_batch 4096 --gradient_checkpointing ffn --precompute_ref_log_probs \
    --disable_progress true --save_steps 0 --per_device_train_batch_size $((8 / N)) --deepspeed zero3 $W8
  tail -n 2 "$LOGS/8b_fsdp.metrics.jsonl" 2>/dev/null
fi
if has trl8b; then
  [ -d /tmp/q8 ] || python3 benchmarks/make_shape.py qwen3-8b /tmp/q8 /tmp/anchor8.jsonl --rows 96 > /dev/null
  for liger in --liger --no-liger; do  # without Liger when TRL + Liger does not run under FSDP2
    left=$(( ${DEADLINE:-560} - SECONDS - 20 )); [ "$left" -lt 60 ] && { echo "== trl8b $liger: no time left"; break; }
    echo "== trl8b $liger: TRL, FSDP2 through accelerate, $N GPUs"
    timeout -k 20 $left torchrun --nproc_per_node "$N" benchmarks/trl_fsdp.py /tmp/q8 /tmp/anchor8.jsonl \
      --per_device $((8 / N)) --steps ${STEPS8B:-10} --warmup 2 $liger > "$LOGS/trl8b$liger.log" 2>&1
    rc=$?; echo "rc=$rc"; grep -E "STEP|RESULT|Error" "$LOGS/trl8b$liger.log" | tail -n 14; [ $rc = 0 ] && break
  done
fi
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$LOGS"
