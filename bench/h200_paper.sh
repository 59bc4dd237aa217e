#!/usr/bin/env bash
# One call on the lent H200 (issues #4/#5): the reduced Fig. 11 suite end to end at Qwen3-8B shapes, then the
# GPU tests of the prefill path. Everything lands in $OUT as it is produced, flat (the device tool returns at
# most 8 files, 2 folders deep): env.log, dmon.log, suite.log, metrics.json/config.json/env.json (copied every
# 10 s and at the end: an interrupted suite keeps its finished points; continue it with
# `oasisbench run SUITE --resume RUN_DIR`), gpu-tests.log.
#
#   run(command="bash bench/h200_paper.sh", timeout_s=600)
#
# BUDGET_S: seconds this script may take in all (default 585); TEST_S: seconds kept for the tests at the end
# (0: no tests); TESTS: the pytest paths to run (default: the prefill path's); RESUME: a run directory in the working tree to continue (its finished points are skipped);
# TRACE: START:COUNT[,START:COUNT...], profile those engine steps of every point (`--trace-steps`; the summary per
# window and step kind lands in $OUT/traces.txt; the profiled steps run slower, so that point's timings are marked
# `traced_steps`).
set -u
OUT=${OUT:-/tmp/h200-out}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TERM=dumb COLUMNS=160
T0=$(date +%s)
BUDGET_S=${BUDGET_S:-585}
TEST_S=${TEST_S:-105}
SUITE=${SUITE:-suites/throughput/paper-qwen3-8b-quick.yaml}
RES=/tmp/oasis-results
elapsed() { echo $(( $(date +%s) - T0 )); }

{
  date -u; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  free -g; nproc; uname -r
} >"$OUT/env.log" 2>&1
nvidia-smi dmon -s u -d 5 >"$OUT/dmon.log" 2>&1 &
DMON=$!

RESUME=${RESUME:-}
copy_results() {
  local d
  d=${RESUME:-$(ls -d "$RES"/*/*/ 2>/dev/null | head -1)}
  [ -n "$d" ] && cp -f "$d"/metrics.json "$d"/config.json "$d"/env.json "$OUT/" 2>/dev/null
  [ -n "$d" ] && [ -f "$d"/traces.txt ] && cp -f "$d"/traces.txt "$OUT/"
  return 0
}
(while sleep 10; do copy_results; done) &
COPIER=$!

# 1. The suite: most of the budget, tests keep TEST_S.
left=$(( BUDGET_S - TEST_S - $(elapsed) ))
echo "suite: $SUITE, ${left}s" | tee "$OUT/suite.log"
timeout --signal=INT --kill-after=10 "$left" \
  python3 -m oasisbench.cli.main run "$SUITE" -o "$RES" ${RESUME:+--resume "$RESUME"} \
  ${TRACE:+--trace-steps "$TRACE"} >>"$OUT/suite.log" 2>&1
echo "suite exit $? at $(elapsed)s" | tee -a "$OUT/suite.log"
copy_results

# 2. GPU tests of what this change touches (ops + engine prefill on CUDA), in what time is left.
if [ "$TEST_S" -gt 0 ]; then
  left=$(( BUDGET_S - $(elapsed) ))
  timeout --kill-after=5 "$left" python3 -m pytest -q -rf -m gpu -p no:cacheprovider \
    ${TESTS:-tests/test_prefill_device.py tests/test_ops.py::test_uva_gather_kernel_matches_ref tests/test_ops.py::test_summary_update_kernel_matches_ref} \
    >"$OUT/gpu-tests.log" 2>&1
  echo "pytest exit $? at $(elapsed)s" | tee -a "$OUT/gpu-tests.log"
fi

kill "$COPIER" "$DMON" 2>/dev/null
copy_results
tail -25 "$OUT/suite.log"
[ "$TEST_S" -gt 0 ] && tail -8 "$OUT/gpu-tests.log"
exit 0
