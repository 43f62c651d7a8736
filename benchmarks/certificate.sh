#!/usr/bin/env bash
# The run's certificate on a CUDA machine (from the repo root): its cost on the cold 600-pair Qwen3-1.7B job (off,
# on, off, on: JOBS to choose; each with empty compile caches, the first on a fresh machine also with cold page
# caches, which is why a plain run goes first) and on Qwen3-8B LoRA r16 (its own timing by stage; LORA_OFF=1 adds a
# run without it, LORA_FP8=1 one on the FP8 base: speed and memory against bf16), its checks on every bench workload
# (WORKLOADS to choose), and (profile) where its first-forward stage's time goes.
# (coldprofile, after jobs) where a cold process's certificate stages spend their time under cProfile.
# Usage: benchmarks/certificate.sh [jobs|lora|workloads|profile|coldprofile]...  Logs and JSON land in $OUT (default cert-out).
set -u
OUT=${OUT:-cert-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

jobs() {  # alternating, the first run on a fresh machine being a plain one: its cold page cache is not the certificate's
  i=0
  for c in ${JOBS:-off on off on}; do
    i=$((i + 1)); rm -rf "/tmp/cert-job-$i"
    timeout -k 20 ${T_JOB:-170} python3 -m fastdpo bench --shape qwen3-1.7b --job --rows 600 --certificate $c \
      --job_dir "/tmp/cert-job-$i" --json "$OUT/job_$i.json" > "$OUT/job_$i.log" 2>&1
    echo "job $i certificate=$c rc=$?"
    python3 - "$OUT/job_$i.json" <<'PY'
import json, sys
try:
    r = next(j for j in json.load(open(sys.argv[1]))["jobs"] if j["impl"] == "fastdpo")
except (OSError, ValueError, KeyError, StopIteration) as e:
    print("  no result:", e); raise SystemExit
t, cert = r.get("timeline_s") or {}, r.get("certificate") or {}
print("  wall_s", r["wall_s"], "first step", round(t.get("first_step", 0) - t.get("ready", 0), 2), "timeline", t)
print("  certificate", cert.get("status"), cert.get("seconds"), cert.get("seconds_by_part"), cert.get("checks"))
print("  its costs besides seconds", cert.get("costs"))
PY
  done
}

lora() {  # 8B LoRA r16: the certificate's cost on its first step; then the same with the FP8 base (its speed, memory)
  for v in "on" ${LORA_FP8:+"on --fp8_base"} ${LORA_OFF:+off}; do
    n=$(echo "$v" | tr -d ' -')
    timeout -k 20 ${T_LORA:-170} python3 -m fastdpo bench --shape qwen3-8b --train_type lora --lora_rank 16 \
      --steps 3 --warmup 1 --certificate $v --json "$OUT/lora_$n.json" > "$OUT/lora_$n.log" 2>&1
    echo "8B LoRA --certificate $v rc=$?"; grep -E "certificate|bench step" "$OUT/lora_$n.log" | head -n 5
    python3 -c "import json; r=json.load(open('$OUT/lora_$n.json'))['results'][0]; print('  first_step_s', r['first_step_s'], 'pairs/s', r['pairs_per_s'], 'peak', r['peak_gib'], 'mfu', r['mfu'])"
  done
}

workloads() {  # kto: the anchor rows, unpaired, under --loss_type kto
  for w in ${WORKLOADS:-anchor long-prompt long-answer grouped kto}; do
    if [ "$w" = kto ]; then args=(--loss_type kto); else args=(--workload "$w"); fi
    timeout -k 5 ${T_W:-120} python3 -m fastdpo bench --shape qwen3-1.7b "${args[@]}" --steps 2 --warmup 1 \
      --json "$OUT/w_$w.json" > "$OUT/w_$w.log" 2>&1
    echo "workload $w rc=$?"; grep -E "certificate" "$OUT/w_$w.log" | head -n 2
  done
}

profile() {  # where the first-forward stage's time goes: cProfile of a bench step, then the same with every CUDA module
  # loaded at start (CUDA_MODULE_LOADING=EAGER): if the stage shrinks there, its cost is loading kernels on first use
  timeout -k 10 ${T_PROF:-100} python3 -m cProfile -o "$OUT/cert.prof" -m fastdpo bench --shape qwen3-1.7b --steps 1 \
    --warmup 1 --json "$OUT/cert_prof.json" > "$OUT/cert_prof.log" 2>&1
  echo "profiled rc=$?"
  CUDA_MODULE_LOADING=EAGER timeout -k 10 ${T_PROF:-100} python3 -m fastdpo bench --shape qwen3-1.7b --steps 1 \
    --warmup 1 --json "$OUT/cert_eager.json" > "$OUT/cert_eager.log" 2>&1
  echo "eager module loading rc=$?"
  python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
for name in ("cert_prof", "cert_eager"):
    try:
        r = json.load(open(f"{out}/{name}.json"))["results"][0]
        print(name, "stages", r["certificate"]["seconds_by_part"], "first step", r.get("first_step_s"))
    except (OSError, KeyError, IndexError, ValueError) as e:
        print(name, "no result:", e)
PY
  callees "$OUT/cert.prof" 25
}

callees() {  # a cProfile file's certificate stages: their callees, and the N functions of most time of their own
  python3 - "$1" "${2:-0}" <<'PY'
import io, pstats, sys
try:
    text = io.StringIO()
    stats = pstats.Stats(sys.argv[1], stream=text)
    stats.sort_stats("cumulative").print_callees("_fast_path|_plain_sums|reference_sums|_sums")  # the stages' parts
    if int(sys.argv[2]):  # where the time itself is spent (a kernel's first load: in its op)
        stats.sort_stats("tottime").print_stats(int(sys.argv[2]))
    print(text.getvalue()[:14000])
except OSError as e:
    print("no profile:", e)
PY
}

coldprofile() {  # the certificate's stages in a cold process under cProfile: `jobs`' first job's model and config,
  # compile caches empty again (what a cold job has that a warm bench process has not, stage by stage)
  local job=/tmp/cert-job-1
  [ -f "$job/fastdpo-job.yaml" ] || { echo "coldprofile: run jobs first ($job/fastdpo-job.yaml)"; return; }
  rm -rf /tmp/cert-cold-out /tmp/cert-cold-triton /tmp/cert-cold-inductor
  TRITON_CACHE_DIR=/tmp/cert-cold-triton TORCHINDUCTOR_CACHE_DIR=/tmp/cert-cold-inductor timeout -k 10 \
    ${T_PROF:-120} python3 -m cProfile -o "$OUT/cold.prof" -m fastdpo train --config "$job/fastdpo-job.yaml" \
    --output_dir /tmp/cert-cold-out --certificate on > "$OUT/cold_prof.log" 2>&1
  echo "cold profile rc=$?"
  python3 - <<'PY'
import json
try:
    run = json.load(open("/tmp/cert-cold-out/summary.json"))
    print("stages", run["certificate"]["seconds_by_part"], "timeline", run.get("timeline_s"))
except (OSError, KeyError, ValueError) as e:
    print("no summary:", e)
PY
  callees "$OUT/cold.prof"
}

parts=("$@"); [ $# -eq 0 ] && parts=(jobs lora workloads)
for part in "${parts[@]}"; do $part; done
