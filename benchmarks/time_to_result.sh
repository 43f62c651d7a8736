#!/usr/bin/env bash
# Time to result: a whole job, from process start to saved model, with empty compile caches, for fastdpo train and
# for TRL + Liger (the shared harness's trl_train.py) on the same random-init model dir and the same anchor rows, in
# one invocation. Both compute the reference every step (TRL's default; fastdpo's default without
# --precompute_ref_log_probs), 8 pairs per step, one epoch, lr 1e-6, beta 0.1, max_length 2048.
# Usage (repo root, CUDA machine): benchmarks/time_to_result.sh SHAPE ROWS ["FASTDPO FLAGS"]
# TRL runs when `trl` imports and .anchor/trl_train.py is there. One JSON line per job lands in $OUT/ttr.jsonl.
set -u
OUT=${OUT:-ttr-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
SHAPE=$1; ROWS=$2; FLAGS=${3:-}; LIMIT=${PER_RUN:-300}
work=$(mktemp -d)
python3 benchmarks/make_shape.py "$SHAPE" "$work/model" "$work/rows.jsonl" --rows "$ROWS" > "$OUT/make_shape.log" 2>&1 || {
  tail -5 "$OUT/make_shape.log"; exit 1; }

job() {  # name, command...: wall time with a cold compile cache of its own
  local name=$1; shift
  export TORCHINDUCTOR_CACHE_DIR=$work/inductor-$name TRITON_CACHE_DIR=$work/triton-$name
  local t0; t0=$(date +%s.%N)
  timeout -k 10 "$LIMIT" "$@" > "$OUT/$name.log" 2>&1
  local rc=$? t1; t1=$(date +%s.%N)
  python3 - "$name" "$rc" "$t0" "$t1" "$work" "$SHAPE" "$ROWS" "$FLAGS" >> "$OUT/ttr.jsonl" <<'PY'
import json, pathlib, sys
name, rc, t0, t1, work, shape, rows, flags = sys.argv[1:]
rec = {"job": name, "shape": shape, "rows": int(rows), "rc": int(rc), "wall_s": round(float(t1) - float(t0), 1)}
if name == "fastdpo":
    rec["flags"] = flags
    m = pathlib.Path(work, "out-fastdpo", "metrics.jsonl")
    recs = [json.loads(x) for x in m.read_text().splitlines()] if m.exists() else []
    recs = [r for r in recs if "loss" in r and "step" in r]
    if recs:
        rec["peak_gib"] = max(r.get("memory/peak_gib", 0) for r in recs)
        rec["pairs_per_s_last"] = recs[-1].get("pairs_per_second")
        rec["saved"] = pathlib.Path(work, "out-fastdpo", "final").is_dir()
print(json.dumps(rec))
PY
  tail -n 3 "$OUT/$name.log" | cut -c1-300
}

job fastdpo python3 -m fastdpo train --model "$work/model" --dataset "$work/rows.jsonl" --per_device_train_batch_size 8 \
  --learning_rate 1e-6 --beta 0.1 --max_length 2048 --num_train_epochs 1 --logging_steps 10 \
  --output_dir "$work/out-fastdpo" $FLAGS
if python3 -c "import trl" 2>/dev/null && [ -f .anchor/trl_train.py ]; then
  job trl-liger python3 .anchor/trl_train.py "$work/model" "$work/rows.jsonl" 8 "$work/out-trl" liger
  grep -h "^RESULT" "$OUT/trl-liger.log" | sed 's/^RESULT /{"trl_result": /; s/$/}/' >> "$OUT/ttr.jsonl"
fi
cat "$OUT/ttr.jsonl"
