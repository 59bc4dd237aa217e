# Sourced by the decode bench scripts (h200_graphs.sh, h200_overlap.sh) after T0 and `elapsed` are set.
#   h200_env FILE               the machine, driver, torch / triton versions and the tree, into FILE
#   h200_tests DIR LINES PATHS  `pytest -m gpu` over PATHS into DIR/gpu-tests.log (200 s at most); prints its
#                               last LINES lines
#   h200_kernels DIR PARTS S    bench_kernels.py --quick --only PARTS into DIR/kernels.{json,log} (S seconds at most)
h200_env() {
  {
    date -u; git log -1 --format=%H 2>/dev/null
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
    free -g | head -2; nproc
  } >"$1" 2>&1
}
h200_tests() {
  local dir=$1 lines=$2; shift 2
  timeout --kill-after=5 200 python3 -m pytest -q -rf -m gpu -p no:cacheprovider "$@" >"$dir/gpu-tests.log" 2>&1
  echo "pytest exit $? at $(elapsed)s" | tee -a "$dir/gpu-tests.log"
  tail -"$lines" "$dir/gpu-tests.log"
}
h200_kernels() {
  timeout --kill-after=5 "$3" python3 bench/bench_kernels.py --quick --only "$2" --out "$1/kernels.json" \
    >"$1/kernels.log" 2>&1
  echo "kernels exit $? at $(elapsed)s" | tee -a "$1/kernels.log"
}
