#!/usr/bin/env bash
# Run on a CUDA machine from the repo root: fastdpo bench configurations, TRL on the same workload in the same
# invocation (with the first configuration). Usage: benchmarks/device.sh SHAPE "FLAGS1;FLAGS2;..." ["trl-liger ..."]
# Full logs and JSON land in $OUT (default ./bench-out); a one-line summary per run is printed last.
set -u
OUT=${OUT:-bench-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
SHAPE=$1; CONFIGS=$2; COMPARE=${3:-}; STEPS=${STEPS:-10}; WARMUP=${WARMUP:-3}
i=0
IFS=';' read -ra CFGS <<< "$CONFIGS"
for c in "${CFGS[@]}"; do
  i=$((i+1))
  cmp=""; [ $i -eq 1 ] && [ -n "$COMPARE" ] && cmp="--compare $COMPARE"
  log="$OUT/${SHAPE}_$i.log"
  echo "== $SHAPE $c $cmp" > "$log"
  timeout -k 20 ${PER_RUN:-300} python3 -m fastdpo bench --shape "$SHAPE" --steps $STEPS --warmup $WARMUP $c $cmp \
    --json "$OUT/${SHAPE}_$i.json" >> "$log" 2>&1
  echo "rc=$?" >> "$log"
done
for f in "$OUT"/${SHAPE}_*.log; do
  head -n 1 "$f"; grep -E "bench step|rc=|Error|error" "$f" | tail -n 4
  j="${f%.log}.json"
  [ -f "$j" ] && python3 -c "import json,sys; d=json.load(open('$j')); [print('  ', {k: v for k, v in r.items() if k in ('impl','pairs_per_s','peak_gib','mfu','first_step_s','error')}) for r in d['results']]"
done
