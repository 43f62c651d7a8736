#!/usr/bin/env bash
# Run on a CUDA machine from the repo root: GPU parity tests, then fastdpo bench configurations, then TRL on the
# same workload in the same invocation. Usage: benchmarks/device.sh SHAPE "CONFIG1;CONFIG2;..." "trl-liger ..."
# Each CONFIG is a string of extra `fastdpo bench` flags. Results land in $OUT (or ./bench-out).
set -u
OUT=${OUT:-bench-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
SHAPE=$1; CONFIGS=$2; COMPARE=${3:-}; STEPS=${STEPS:-10}; WARMUP=${WARMUP:-3}
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
i=0
IFS=';' read -ra CFGS <<< "$CONFIGS"
for c in "${CFGS[@]}"; do
  i=$((i+1))
  cmp=""; [ $i -eq 1 ] && [ -n "$COMPARE" ] && cmp="--compare $COMPARE"
  echo "== fastdpo $SHAPE $c $cmp"
  timeout ${PER_RUN:-300} python3 -m fastdpo bench --shape "$SHAPE" --steps $STEPS --warmup $WARMUP $c $cmp \
    --json "$OUT/${SHAPE}_$i.json" 2>&1 | grep -v "^WARNING\|warn" | tail -n 12
done
