#!/usr/bin/env bash
# One call on the lent H200 (issue #4): CUDA graphs for decode-only steps. First the GPU tests of the graph
# path (replay equals eager, every mode), then the decode-step bench with graphs off and on side by side on
# the same engine, at Qwen3-8B shapes (random weights). Files land flat in $OUT as they are produced.
#
#   run(command="bash bench/h200_graphs.sh", timeout_s=600)
#
# BUDGET_S: seconds in all (default 570); BENCH_ARGS: extra bench_decode.py arguments; TESTS: pytest paths
# (default: the graph and engine tests); KERNELS: bench_kernels.py parts to run first (e.g. gather,overlap;
# default none); GRAPHS: graph settings per point (default off,auto); GATHER: UVA gather grids to compare
# (the summary's grid/sel column: gather grid / fused selection kernel 1 or 0, from --select-kernel in BENCH_ARGS,
# then /cN with --gather-copies N, /pN with --pipeline-priority N, /lN with --link-gbps N in BENCH_ARGS).
set -u
OUT=${OUT:-/tmp/h200-out}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
T0=$(date +%s)
BUDGET_S=${BUDGET_S:-570}
elapsed() { echo $(( $(date +%s) - T0 )); }
. bench/h200_common.sh
h200_env "$OUT/env.log"
# shellcheck disable=SC2086
h200_tests "$OUT" 15 ${TESTS:-tests/test_cuda_graphs.py tests/test_gpu_engine.py}
if [ -n "${KERNELS:-}" ]; then
  h200_kernels "$OUT" "$KERNELS" 150
  tail -30 "$OUT/kernels.log"
fi

left=$(( BUDGET_S - $(elapsed) ))
timeout --signal=INT --kill-after=10 "$left" python3 bench/bench_decode.py --model qwen3-8b \
  --modes "${MODES:-oasiskv,dense,oasiskv-no-transfer,fetch-on-demand,sparse-resident}" \
  --batch "${BATCH:-16,64,128}" --context "${CONTEXT:-16384,32768}" --warmup 3 --steps 5 \
  --graphs "${GRAPHS:-off,auto}" ${GATHER:+--gather-ctas "$GATHER"} --sweep "${SWEEP:-}" \
  --out "$OUT/decode-graphs.json" ${BENCH_ARGS:-} >"$OUT/bench.log" 2>&1
echo "bench exit $? at $(elapsed)s" | tee -a "$OUT/bench.log"
python3 - "$OUT/decode-graphs.json" <<'EOF' | tee "$OUT/summary.txt"
import json, sys
r = json.load(open(sys.argv[1]))
rows = {}
for p in r["points"]:
    variant = f"{p.get('gather_ctas', '-')}/{int(p['select_kernel']) if 'select_kernel' in p else '-'}"
    if "gather_copies" in p:
        variant += f"/c{p['gather_copies']}"
    if "pipeline_priority" in p:
        variant += f"/p{p['pipeline_priority']}"
    if "link_gbps" in p:
        variant += f"/l{p['link_gbps']:g}"
    if "fused_norm_rope" in p:
        variant += f"/f{int(p['fused_norm_rope'])}"
    rows.setdefault((p["mode"], variant, p["context"], p["batch"]), {})[p["cuda_graphs"]] = p
print(f"{'mode':20} {'grid/sel':>8} {'ctx':>6} {'B':>4} {'eager ms':>9} {'graph ms':>9} {'speedup':>8} {'replays':>7}"
      f" {'MB/step':>8} {'cap':>5}  note")
for (mode, grid, ctx, b), d in rows.items():
    e, g = d.get("off", {}), d.get("auto", {})
    es, gs = e.get("step_ms"), g.get("step_ms")
    sp = f"{es / gs:.2f}x" if es and gs else "-"
    mb = (g or e).get("fetched_bytes_per_step", 0) / 1e6
    cap = (g or e).get("mean_fetch_cap")
    cap = f"{cap:5.1f}" if cap is not None else "    -"
    note = e.get("error") or g.get("error") or g.get("graphs_disabled") or ""
    print(f"{mode:20} {grid:>8} {ctx:6} {b:4} {es or 0:9.1f} {gs or 0:9.1f} {sp:>8} {g.get('graph_replays', '-'):>7}"
          f" {mb:8.0f} {cap}  {note}")
EOF
