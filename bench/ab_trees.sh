#!/usr/bin/env bash
# The decode-step table of two source trees side by side in one device call (before / after a change that must
# not move step times): each tree's own bench/bench_decode.py in its own process, in the order old new new old ...
# so the machine's drift over the call hits both alike; then one table of the median step per point and tree and
# the ratio new / old.
#
#   OLD=.old bash bench/ab_trees.sh     (OLD: a copy of the other tree's oasiskv_runtime/, oasisbench/, csrc/ and
#                                        bench/bench_decode.py, e.g. from `git archive REV ... | tar -x -C .old`)
#
# OUT: where files go (default /tmp/ab-out); ROUNDS: old/new pairs (default 2); BUDGET_S: seconds for all runs
# (default 480; a run that would not fit is skipped); BENCH_ARGS: bench_decode.py arguments (default below).
set -u
OUT=${OUT:-/tmp/ab-out}
OLD=${OLD:?set OLD to a directory holding the other tree}
mkdir -p "$OUT"
T0=$(date +%s)
BUDGET_S=${BUDGET_S:-480}
ARGS=${BENCH_ARGS:---model qwen3-8b --modes oasiskv,oasiskv-no-transfer,dense --batch 16,64 --context 16384,32768 \
--graphs auto --warmup 20 --steps 10 --host-gb 16 --sweep=}
order=""
for _ in $(seq 1 "${ROUNDS:-2}"); do order="$order old new"; done
order=$(echo "$order" | awk '{for (i = 1; i <= NF; i += 4) {printf "%s %s ", $i, $(i+1); if (i+3 <= NF) printf "%s %s ", $(i+3), $(i+2)}}')
n=0
last=90
for side in $order; do
  n=$((n + 1))
  left=$(( BUDGET_S - ($(date +%s) - T0) ))
  if [ "$left" -lt "$last" ]; then echo "run $n ($side) skipped: ${left}s left" | tee -a "$OUT/ab.log"; continue; fi
  dir=.
  [ "$side" = old ] && dir=$OLD
  t=$(date +%s)
  # shellcheck disable=SC2086
  (cd "$dir" && PYTHONPATH=. PYTHONUNBUFFERED=1 timeout --signal=INT "$left" python3 bench/bench_decode.py $ARGS \
    --out "$OUT/ab-$n-$side.json") >"$OUT/ab-$n-$side.log" 2>&1
  rc=$?
  last=$(( $(date +%s) - t ))
  echo "run $n ($side): exit $rc in ${last}s" | tee -a "$OUT/ab.log"
done
python3 - "$OUT" <<'EOF' | tee "$OUT/ab-summary.txt"
import glob, json, statistics, sys
runs = {}
for path in sorted(glob.glob(f"{sys.argv[1]}/ab-*-*.json")):
    side = path.rsplit("-", 1)[1][:-5]
    for p in json.load(open(path))["points"]:
        if "step_ms" in p:
            runs.setdefault((p["mode"], p["batch"], p["context"]), {}).setdefault(side, []).append(p["step_ms"])
print(f"{'mode':22} {'B':>4} {'ctx':>6} {'old ms':>16} {'new ms':>16} {'new/old':>8}")
for (mode, b, ctx), d in sorted(runs.items()):
    o, n = d.get("old", []), d.get("new", [])
    fmt = lambda xs: ("/".join(f"{x:.2f}" for x in xs)) or "-"
    ratio = f"{statistics.median(n) / statistics.median(o):.3f}" if o and n else "-"
    print(f"{mode:22} {b:4} {ctx:6} {fmt(o):>16} {fmt(n):>16} {ratio:>8}")
EOF
