#!/usr/bin/env bash
# The current source against an earlier one in one call, on a CUDA machine, from the repo root:
#   BEFORE=.before/src benchmarks/before_after.sh NAME "BENCH FLAGS" [COMPARE]
# (make the earlier tree with `git archive HEAD src | tar -x -C .before`). Runs `fastdpo bench FLAGS` with the current
# source, then the earlier one, then (REPEAT=1, the default) the current again (A B A: drift shows), and, with COMPARE (e.g. trl-lora-liger),
# TRL on the same rows in the first run. Each run has its own timeout (PER_RUN seconds); JSON and logs land in $OUT;
# a line per run is printed last.
set -u
OUT=${OUT:-bench-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
NAME=$1; FLAGS=$2; COMPARE=${3:-}; BEFORE=${BEFORE:-}
runs=("after:$PWD/src")
[ -n "$BEFORE" ] && runs+=("before:$PWD/$BEFORE")
[ -n "$BEFORE" ] && [ "${REPEAT:-1}" = 1 ] && runs+=("after2:$PWD/src")
i=0
for r in "${runs[@]}"; do
  tag=${r%%:*}; src=${r#*:}; i=$((i+1))
  cmp=""; [ $i -eq 1 ] && [ -n "$COMPARE" ] && cmp="--compare $COMPARE"
  PYTHONPATH=$src:${PYTHONPATH:-} timeout -k 20 ${PER_RUN:-240} python3 -m fastdpo bench $FLAGS $cmp \
    --json "$OUT/${NAME}_$tag.json" > "$OUT/${NAME}_$tag.log" 2>&1
  echo "rc=$?" >> "$OUT/${NAME}_$tag.log"
done
for r in "${runs[@]}"; do
  tag=${r%%:*}; j="$OUT/${NAME}_$tag.json"
  echo "== $NAME $tag: $(grep -E '^rc=' "$OUT/${NAME}_$tag.log")  $(grep -o 'Memory: --gradient_checkpointing [^,]*' "$OUT/${NAME}_$tag.log" | head -1)"
  grep -E "Error|error" "$OUT/${NAME}_$tag.log" | tail -n 3
  [ -f "$j" ] && python3 -c "import json; d=json.load(open('$j')); [print('  ', {k: v for k, v in r.items() if k in ('impl','pairs_per_s','pairs_per_s_median','peak_gib','mfu','gradient_checkpointing','first_step_s','error')}) for r in d['results']]"
done
