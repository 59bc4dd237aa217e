#!/usr/bin/env bash
# One short call on the lent H200: how much host memory the exact-size pinned pool can take and how long pinning
# takes, the GPU tests of what changed, then the prefill profile (with --sync-sites: where steps wait for the GPU).
#   run(command="bash bench/h200_check.sh", timeout_s=600)
# PIN_GB: pool sizes to try (GiB); TESTS: pytest paths; PROFILE: 0 skips the profile; MODES: profile modes;
# PROFILE_ARGS: more profile_prefill.py options (e.g. "--decode-rows 40": mixed steps, as end to end).
set -u
OUT=${OUT:-/tmp/h200-out}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  free -g; nproc; ulimit -l; } >"$OUT/env.log" 2>&1
for gb in ${PIN_GB:-96 104}; do
  python3 - "$gb" >>"$OUT/pin.log" 2>&1 <<'PY'
import sys, time, torch
from oasiskv_runtime.transfer.host_memory import PinnedRegion, available_host_bytes
gb = float(sys.argv[1]); torch.cuda.init()
print(f"available {available_host_bytes() / 2**30:.1f} GiB; asking {gb} GiB", flush=True)
t = time.perf_counter()
try:
    r = PinnedRegion(int(gb * 2**30))
    x = r.take((1 << 20,), torch.bfloat16)
    print(f"pinned {gb} GiB in {time.perf_counter() - t:.1f} s; pinned={x.is_pinned()}", flush=True)
    t = time.perf_counter(); del r, x; import gc; gc.collect()
    print(f"released in {time.perf_counter() - t:.1f} s", flush=True)
except Exception as e:
    print(f"failed after {time.perf_counter() - t:.1f} s: {type(e).__name__}: {e}", flush=True)
PY
done
timeout 240 python3 -m pytest -q -rf -m gpu -p no:cacheprovider \
  ${TESTS:-tests/test_host_memory.py tests/test_prefill_device.py tests/test_ops.py::test_uva_gather_kernel_matches_ref} \
  >"$OUT/gpu-tests.log" 2>&1
echo "pytest exit $?" >>"$OUT/gpu-tests.log"
tail -3 "$OUT/gpu-tests.log"
if [ "${PROFILE:-1}" != 0 ]; then
  timeout 200 python3 bench/profile_prefill.py --model qwen3-8b --context 16384 --chunk 8192 \
    --modes ${MODES:-oasiskv,dense} --sync-sites ${PROFILE_ARGS:-} --out "$OUT/prefill-profile.txt" >"$OUT/profile.log" 2>&1
  echo "profile exit $?" >>"$OUT/profile.log"
fi
cat "$OUT/pin.log"; grep -A30 "host synchronisations" "$OUT/prefill-profile.txt" | head -40
