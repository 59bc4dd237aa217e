#!/usr/bin/env bash
# One call on the lent H200 (issue #4): where oasiskv's decode step loses to the all-resident step at B >= 64.
# Qwen3-8B RANDOM WEIGHTS, CUDA graphs, warm-up 20 + 10 timed steps (past the 17th token's new block bucket).
#   1. the decode table's B = 64 / 128 points at CONTEXT (default 32768) with the gather grid, its copies in
#      flight per CTA and the pipeline's stream priority as A/B variants (GRIDS, COPIES, PRIOS); oasiskv and
#      oasiskv-no-transfer side by side;
#   2. raw torch.profiler traces (2 steps as they run, graph replays included) of oasiskv and of the no-transfer
#      step at B = 64 and CONTEXT, and of oasiskv at 16K (the link-bound case), for bench/trace_overlap.py.
# Everything lands in $OUT/overlap.tar.gz (the device returns at most 8 files) and the summary in $OUT.
#
#   run(command="bash bench/h200_overlap.sh", timeout_s=600)
#
# KERNELS: bench_kernels.py parts to run first (e.g. interference). HINTS: gather cache hints to A/B in step 1
# (e.g. ',stream,cv'). SKIP_RAW=1: only step 1. EXTRA: more bench_decode.py arguments for every process.
set -u
OUT=${OUT:-/tmp/h200-out}
R=$OUT/overlap
mkdir -p "$R"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
T0=$(date +%s)
BUDGET_S=${BUDGET_S:-560}
CONTEXT=${CONTEXT:-32768}
elapsed() { echo $(( $(date +%s) - T0 )); }
. bench/h200_common.sh
h200_env "$R/env.log"
# shellcheck disable=SC2086
[ -z "${TESTS:-}" ] || h200_tests "$R" 5 $TESTS
if [ -n "${KERNELS:-}" ]; then
  h200_kernels "$R" "$KERNELS" 200
  grep -A40 "Gather beside" "$R/kernels.log" | tee "$OUT/kernels.txt"
fi

bench() {  # NAME, then bench_decode.py arguments
  local name=$1; shift
  local left=$(( BUDGET_S - $(elapsed) ))
  [ "$left" -gt 30 ] || { echo "skip $name: budget spent"; return; }
  timeout --signal=INT --kill-after=10 "$left" python3 bench/bench_decode.py --model qwen3-8b --graphs auto \
    --warmup 20 --steps 10 --sweep "" --out "$R/$name.json" --trace "$R/$name-trace.txt" ${EXTRA:-} "$@" \
    >"$R/$name.log" 2>&1
  echo "$name exit $? at $(elapsed)s"
}
bench ab --modes oasiskv,oasiskv-no-transfer --batch 64,128 --context "$CONTEXT" \
  --gather-ctas "${GRIDS:-32,16}" --gather-copies "${COPIES:-1,2}" --pipeline-priority "${PRIOS:-0,-1}" \
  ${HINTS:+--gather-hint "$HINTS"}
if [ -z "${SKIP_RAW:-}" ]; then
  bench resident --modes oasiskv-no-transfer --batch 64 --context "$CONTEXT"
  bench link16k --modes oasiskv --batch 64 --context 16384
fi

python3 - "$R" <<'EOF' | tee "$OUT/summary.txt"
import glob, json, os, sys
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    for p in json.load(open(f))["points"]:
        var = ",".join(f"{k}={p[k]}" for k in ("gather_ctas", "gather_copies", "gather_hint", "pipeline_priority")
                       if k in p)
        print(f"{os.path.basename(f):14} {p['mode']:20} ctx={p['context']:6} B={p['batch']:4} {var:32} "
              f"{p.get('step_ms', float('nan')):7.2f} ms  {p.get('fetched_bytes_per_step', 0) / 1e6:7.0f} MB/step "
              f"{p.get('error', '')}")
EOF
for f in "$R"/*-trace.txt; do head -12 "$f"; done
tar -czf "$OUT/overlap.tar.gz" -C "$OUT" overlap && rm -rf "$R"
ls -la "$OUT"
