#!/usr/bin/env bash
# Device calls with vLLM 0.26 on the H200. The offline bundle (../shared/vllm_gpu_bundle.sh DIR MB) goes over one part
# per call, calls back to back (a warm machine keeps /tmp, and goes cold after ~30 s idle): lay the parts out once,
# one folder each (hard links: for x in a b c d; do mkdir -p .vbundle/$x; ln DIR/part-a$x .vbundle/$x/; done), then
# call with carry=[".vbundle/a"], [".vbundle/b"], ... and no local step in between, each running
#   mkdir -p /tmp/vst && cp .vbundle/*/part-* /tmp/vst/ && ls /tmp/vst
# and the last one this script too (vLLM's n-gram drafter needs numba; the 0.26 bundle brings it). Swapping the part in
# one .vbundle folder between calls let the machine go cold (seen: the first parts were gone). A call carries at most
# 64 MiB with the working tree (~24 MiB with results/ and the shipped draft head): parts of 62 - tree MiB. This script
# installs what
# /tmp/vst holds (once per warm machine), registers the plug-in's entry point without building the project (a
# dist-info beside the bundle) and runs the steps named in STEPS (default "tests bench"):
#   tests     the plug-in's GPU tests (pytest -m gpu tests/test_vllm_plugin.py)
#   profile   bench/vllm_decode.py --profile: host syncs and top ops of PROFILE_MODES at 16K x 16 (in-process engine)
#   embedded  our engine's dense and oasiskv on the bench's prompts (the within-engine agreement bar)
#   bench     bench/vllm_decode.py over BENCH_MODES (decode step and agreement beside plain vLLM)
#   suite     oasisbench run SUITE (default suites/throughput/paper-qwen3-8b-vllm.yaml) from the source tree, its run
#             directory under /tmp/suite/SUITE_TAG (default all): a later call with the same tag (machine still warm)
#             resumes it, so a suite longer than one call's 10 minutes runs over several calls, each keeping the
#             points it finished (SUITE_S per call); SUITE_POINTS (e.g. 4-5) runs only those points (--points), and
#             a run per call (its own SUITE_TAG) keeps each call's pair side by side in one run directory;
#             $OUT/suite.tgz holds /tmp/suite (refreshed every 20 s while it runs)
# Writes $OUT/<step>.log and <step>.json. BENCH_ARGS replaces the shared bench arguments.
set -u
OUT=${OUT:-/tmp/h200-vllm}
mkdir -p "$OUT" /tmp/vst
here=$(pwd)
cp .vbundle/part-* .vbundle/*/part-* .vbundle/*.whl /tmp/vst/ 2>/dev/null
if [ ! -d /tmp/site/vllm ]; then
  (cd /tmp/vst && cat part-* > b.tar && md5sum b.tar && tar -xf b.tar \
    && python3 -m pip install -q --no-index --no-deps --target /tmp/site vllm-*.whl deps/*.whl $(ls *.whl 2>/dev/null)) \
    >"$OUT/install.log" 2>&1
  echo "install exit $?" | tee -a "$OUT/install.log"
fi
dist=/tmp/site/oasiskv_plugin-0.0.0.dist-info
mkdir -p "$dist"
printf 'Metadata-Version: 2.1\nName: oasiskv-plugin\nVersion: 0.0.0\n' >"$dist/METADATA"
printf '[vllm.general_plugins]\noasiskv = oasiskv_runtime.vllm.plugin:register\n' >"$dist/entry_points.txt"
export PYTHONPATH=/tmp/site:$here VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
python3 -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" 2>&1 | tail -1 | tee "$OUT/env.txt"
python3 -c "import numba; print('numba', numba.__version__)" 2>&1 | tail -1 | tee -a "$OUT/env.txt"
git -C "$here" rev-parse --short HEAD 2>/dev/null | tee -a "$OUT/env.txt"
ARGS=${BENCH_ARGS:---model qwen3-8b --batch 16 --context 16384,32768 --output-len 64 --top-k 128 --kv-gb 74}
decode() {  # $1 step name, $2 seconds, rest: bench/vllm_decode.py arguments
  local name=$1 limit=$2; shift 2
  # shellcheck disable=SC2086
  timeout "$limit" python3 bench/vllm_decode.py $ARGS "$@" --out "$OUT/$name.json" >"$OUT/$name.log" 2>&1
  echo "$name exit $?" | tee -a "$OUT/$name.log"; grep -E "^[a-z-]+ \{\"context" "$OUT/$name.log" | cut -c1-400
}
for step in ${STEPS:-tests bench}; do
  case $step in
    tests) timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/test_vllm_plugin.py >"$OUT/tests.log" 2>&1
           echo "pytest exit $?" | tee -a "$OUT/tests.log"; tail -3 "$OUT/tests.log" ;;
    profile) decode profile "${PROFILE_S:-300}" --modes "${PROFILE_MODES:-sparse-resident,oasiskv}" --context 16384 \
               --profile --timeout 200 ;;
    embedded) decode embedded "${EMBEDDED_S:-240}" --modes embedded-dense,embedded-oasiskv --timeout 200 ;;
    suite) base=/tmp/suite/${SUITE_TAG:-all}; run=$(ls -d "$base"/*/* 2>/dev/null | head -1)
           if [ -n "$run" ]; then where=(--resume "$run"); else where=(--output-dir "$base"); fi
           [ -n "${SUITE_POINTS:-}" ] && where+=(--points "$SUITE_POINTS")
           # The run directory goes back as one archive, refreshed every 20 s: a call that ends early (device time
           # spent, machine taken back) still returns the points finished (nested run folders do not come back).
           (while sleep 20; do tar -czf "$OUT/suite.tgz.part" -C /tmp suite && mv "$OUT/suite.tgz.part" "$OUT/suite.tgz"
            done) & saver=$!
           COLUMNS=250 timeout "${SUITE_S:-570}" python3 -m oasisbench.cli.main run \
             "${SUITE:-suites/throughput/paper-qwen3-8b-vllm.yaml}" "${where[@]}" >>"$OUT/suite.log" 2>&1
           echo "suite exit $?" | tee -a "$OUT/suite.log"
           kill "$saver" 2>/dev/null
           # a point cut by the timeout leaves its vLLM child (and its engine core) holding the GPU
           pkill -9 -f "oasisbench.runners" 2>/dev/null; pkill -9 -f "VLLM::EngineCore|EngineCore" 2>/dev/null
           tar -czf "$OUT/suite.tgz" -C /tmp suite && grep -E "^point|tok/s|error" "$OUT/suite.log" | tail -20 ;;
    bench) decode bench "${BENCH_S:-540}" --modes "${BENCH_MODES:-plain,sparse-resident,proxy-prefetch,oasiskv}" \
             --timeout 200 ;;
  esac
done
