#!/usr/bin/env bash
# One GPU against N GPUs of one host, with a profile of each run's last step (from the repo root): Qwen3-1.7B full
# fine-tuning, global batch of GLOBAL pairs (default 32), STEPS steps (default 10).
#   BUDGETS  micro-batch token budgets (default "4096 8192"); the one-GPU runs (GPU 0 and GPU 1 side by side, one
#            budget each) come first.
#   MODES    how the N GPUs share the model (default "full_shard"): ddp, full_shard, shard_grad_op; each runs at
#            every budget. MODE/K (e.g. full_shard/4) adds --fsdp_layers_per_unit K (run named MODE_uK_BUDGET).
#   WARMUP   1: every micro-batch length's kernels are built before step 1 (--compile_warmup; a BEFORE tree must
#            know the flag too).
#   MEMORY   1: the profiled step also records GPU allocations (--profile_memory; memory.txt per rank copied).
#   BEFORE   optional: source trees of earlier versions (e.g. `git archive HEAD src | tar -x -C .before`, then
#            BEFORE=.before/src), each as DIR or DIR:mode,mode to run only some modes; each runs after the current
#            code's runs (named before_<mode>_<budget>, then before2_..., before3_...), so a change's before and after
#            share one invocation. With one budget, the first tree's one-GPU run goes beside the current one's.
#   TRACES   ranks whose traces are copied for the current code's runs (default "0", "" for none; the rank-0 trace
#            of the one-GPU runs always).
#   EXTRA    train flags added to the current code's runs only (e.g. EXTRA="--gc_steps 1" with BEFORE a copy of the
#            same src: the flag's effect within one call).
#   EXTRA_ENV  environment variables for the current code's runs only (e.g. EXTRA_ENV="TORCHINDUCTOR_CPP_WRAPPER=1"
#            with BEFORE a copy of the same src: the setting's effect within one call).
#   PROFILE  0: no profiled step (each run ends 5-20 s sooner; no traces or splits).
#   PROFILE_STEPS  the profiled steps (default the last, STEPS); e.g. 8-9 also records the boundary between two steps
#            (the logging, the next step's packing), but puts profiled steps into the table's window.
#   REPEAT   n: the N-GPU runs (current code, then each BEFORE tree) go n times in turn, A B A B..., repeats named
#            <run>_r2, _r3...: single runs of the same code spread by up to +-5 % within a call.
# Prints the per-step times and each profile's compute / exposed communication / idle split, then the call's table
# (benchmarks/scaling_table.py: steps 3..STEPS-1 summed, per GPU against one GPU; also $OUT/table.md); copies the traces
# (rank 0 of each run) and the logs into $OUT. Each run gets at most RUN_S seconds (default 360: a cold cache builds
# 16 lengths in 2-4 minutes) and the time left before DEADLINE seconds
# (default 560). On a CPU, try it with SHAPE=tiny COMPILE= (no compilation).
set -u
N=${N:-2}; OUT=${OUT:-scaling-out}; LOGS=$OUT/logs; mkdir -p "$LOGS"; GLOBAL=${GLOBAL:-32}; BUDGETS=(${BUDGETS:-4096 8192})
STEPS=${STEPS:-10}; MODES=(${MODES:-full_shard}); BEFORE=${BEFORE:-}; PER=8; [ $((GLOBAL / N)) -lt 8 ] && PER=$((GLOBAL / N))
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/fastdpo-inductor} TORCH_LOGS=${TORCH_LOGS-recompiles}
SRC=$PWD/src; BASE_PATH=${PYTHONPATH:-}
RUNS=/tmp/scaling-runs; mkdir -p "$RUNS"
SHAPE=${SHAPE:-qwen3-1.7b}; M=/tmp/shape-$SHAPE
[ -d "$M" ] || PYTHONPATH=$SRC python3 benchmarks/make_shape.py "$SHAPE" "$M" "$M.jsonl" --rows $((STEPS * GLOBAL)) > /dev/null
C="--model $M --dataset $M.jsonl --max_steps $STEPS --learning_rate 1e-6 --logging_steps 1 --seed 1
   --gradient_checkpointing ffn --precompute_ref_log_probs --disable_progress true ${COMPILE---torch_compile}
   --torch_dtype bfloat16 --save_steps 0"
[ "${PROFILE:-1}" = 1 ] && C="$C --profile_steps ${PROFILE_STEPS:-$STEPS}"
[ "${MEMORY:-0}" = 1 ] && C="$C --profile_memory"
[ "${WARMUP:-0}" = 1 ] && C="$C --compile_warmup"
report() {
  local name=$1
  python3 - "$RUNS/$name" "$name" "$GLOBAL" "$STEPS" <<'PY'
import json, sys, statistics
from pathlib import Path
run, name, pairs, last = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
try:
    rows = [json.loads(l) for l in open(run / "metrics.jsonl")]
    secs = [round(pairs / r["pairs_per_second"], 3) for r in rows]
    steady = [r["pairs_per_second"] for r in rows if min(4, last - 2) < r["step"] < last] or [float("nan")]
    peak = max((r.get("memory/peak_gib", 0) for r in rows), default=0)
    print(f"{name}: median pairs/s before the profiled step {statistics.median(steady):.2f}; peak {peak} GiB; "
          f"s per step {secs}")
except (OSError, ValueError, KeyError) as e:
    print(f"{name}: no metrics ({e})")
for s in sorted(run.glob("profile/rank*/summary.json")):
    print(f"   {s.parent.name}: {json.load(open(s))['line']}")
PY
}
run() {  # name seconds source-dir command...
  local name=$1 t=$2 src=$3; shift 3
  local left=$(( ${DEADLINE:-560} - SECONDS - 15 )); [ "$left" -lt "$t" ] && t=$left
  [ "$t" -lt 30 ] && { echo "== $name: skipped, no time left"; return; }
  PYTHONPATH=$src${BASE_PATH:+:$BASE_PATH} timeout -k 15 "$t" "$@" --output_dir "$RUNS/$name" > "$LOGS/$name.log" 2>&1
  echo "== $name rc=$? (${SECONDS}s)"
  cp "$RUNS/$name/metrics.jsonl" "$LOGS/$name.metrics.jsonl" 2>/dev/null
  for s in "$RUNS/$name"/profile/rank*; do
    [ -d "$s" ] || continue; r=$(basename "$s"); cp "$s/summary.json" "$LOGS/$name.$r.summary.json"
    cp "$s/top.txt" "$LOGS/$name.$r.top.txt"
    [ -f "$s/memory.txt" ] && cp "$s/memory.txt" "$LOGS/$name.$r.memory.txt"
  done
  local ranks=${TRACES-0}; [[ "$name" == 1gpu* ]] && ranks=0; [[ "$name" == before* ]] && ranks=""
  for r in $ranks; do
    [ -f "$RUNS/$name/profile/rank$r/trace.json.gz" ] && cp "$RUNS/$name/profile/rank$r/trace.json.gz" "$OUT/$name.rank$r.trace.json.gz"
  done
  report "$name"
}
extra() { [ "$1" = "$SRC" ] && echo "${EXTRA:-}"; }  # source-dir
extra_env() { [ "$1" = "$SRC" ] && echo "${EXTRA_ENV:-}"; }  # source-dir
one() {  # name gpu source-dir budget
  run "$1" "${RUN_S:-360}" "$3" env CUDA_VISIBLE_DEVICES=$2 $(extra_env "$3") python3 -m fastdpo train $C $(extra "$3") --max_tokens_per_batch "$4" \
    --per_device_train_batch_size $PER --gradient_accumulation_steps $((GLOBAL / PER))
}
BEFORE=($BEFORE); gpu=0
for b in "${BUDGETS[@]}"; do
  one "1gpu_$b" $gpu "$SRC" "$b" &
  gpu=$(( (gpu + 1) % N ))
done
if [ ${#BEFORE[@]} -gt 0 ] && [ ${#BUDGETS[@]} = 1 ] && [ "$N" -gt 1 ]; then
  one "before_1gpu_${BUDGETS[0]}" 1 "${BEFORE[0]%%:*}" "${BUDGETS[0]}" &
fi
wait
for rep in $(seq 1 "${REPEAT:-1}"); do
  suffix=""; [ "$rep" -gt 1 ] && suffix="_r$rep"; i=0
  for entry in "$SRC" "${BEFORE[@]}"; do
    tree=${entry%%:*}; modes=("${MODES[@]}"); [[ "$entry" == *:* ]] && IFS=, read -r -a modes <<< "${entry#*:}"
    prefix=""; [ $i = 1 ] && prefix="before_"; [ $i -gt 1 ] && prefix="before${i}_"; i=$((i + 1))
    for mode in "${modes[@]}"; do
      m=${mode%%/*}; flag="--fsdp $m"; [ "$m" = ddp ] && flag=""; tag=$m
      [[ "$mode" == */* ]] && { flag="$flag --fsdp_layers_per_unit ${mode#*/}"; tag="${m}_u${mode#*/}"; }
      for b in "${BUDGETS[@]}"; do
        run "$prefix${tag}_$b$suffix" "${RUN_S:-360}" "$tree" env $(extra_env "$tree") torchrun --nproc_per_node "$N" -m fastdpo train $C $(extra "$tree") $flag \
          --max_tokens_per_batch "$b" --per_device_train_batch_size $PER \
          --gradient_accumulation_steps $((GLOBAL / PER / N))
      done
    done
  done
done
python3 benchmarks/scaling_table.py "$LOGS" --pairs "$GLOBAL" --gpus "$N" --first 3 --last $((STEPS - 1)) | tee "$OUT/table.md"
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$LOGS"
