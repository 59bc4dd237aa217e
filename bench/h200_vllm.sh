#!/usr/bin/env bash
# One device call with vLLM 0.26 on the H200: install the offline bundle (../shared/vllm_gpu_bundle.sh; its parts
# carried in earlier calls to /tmp/vst, the last one in .vbundle/), register the plug-in's entry point without
# building the project (a dist-info beside the bundle), run the plug-in's GPU tests, then bench/vllm_decode.py.
#   run(command="bash bench/h200_vllm.sh", carry=[".vbundle"])
# BENCH_ARGS: bench/vllm_decode.py arguments (default below); BUDGET_S: seconds for the bench (default 480).
set -u
OUT=${OUT:-/tmp/h200-vllm}
mkdir -p "$OUT" /tmp/vst
here=$(pwd)
cp .vbundle/part-* /tmp/vst/ 2>/dev/null
(cd /tmp/vst && cat part-* > b.tar && md5sum b.tar && tar -xf b.tar \
  && python3 -m pip install -q --no-index --no-deps --target /tmp/site vllm-*.whl deps/*.whl) >"$OUT/install.log" 2>&1
echo "install exit $?" | tee -a "$OUT/install.log"
dist=/tmp/site/oasiskv_plugin-0.0.0.dist-info
mkdir -p "$dist"
printf 'Metadata-Version: 2.1\nName: oasiskv-plugin\nVersion: 0.0.0\n' >"$dist/METADATA"
printf '[vllm.general_plugins]\noasiskv = oasiskv_runtime.vllm.plugin:register\n' >"$dist/entry_points.txt"
export PYTHONPATH=/tmp/site:$here VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
python3 -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" 2>&1 | tail -1 | tee "$OUT/env.txt"
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/test_vllm_plugin.py >"$OUT/gpu-tests.log" 2>&1
echo "pytest exit $?" | tee -a "$OUT/gpu-tests.log"; tail -4 "$OUT/gpu-tests.log"
# shellcheck disable=SC2086
timeout "${BUDGET_S:-480}" python3 bench/vllm_decode.py ${BENCH_ARGS:---model qwen3-8b --batch 16 --context 16384,32768 \
  --output-len 64 --top-k 128 --kv-gb 80 --timeout 230} --out "$OUT/vllm-decode.json" >"$OUT/vllm-decode.log" 2>&1
echo "bench exit $?" | tee -a "$OUT/vllm-decode.log"; tail -8 "$OUT/vllm-decode.log"
