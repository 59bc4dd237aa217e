#!/usr/bin/env bash
# Step 7 on a lent H200: self-distillation text, EAGLE-3 head training, held-out accuracy and per-layer
# prediction recall at 2K and 4K (budget 1/8 of the context), both forced continuations.
#
# The SmolLM2 GGUF (98 MB) is over one call's 64 MiB (which includes the ~18 MB tree), so it travels in three
# parts (`split -b 33M -d -a 2`: .dev/a/part00, .dev/c/part01, .dev/b/part02, gitignored) in calls made back to
# back (a warm machine keeps /tmp for ~30 s); `stage DIR` copies DIR's parts, the run call adds .dev/b's:
#   run(command="bash bench/h200_draft.sh stage .dev/a", carry=[".dev/a"])
#   run(command="bash bench/h200_draft.sh stage .dev/c", carry=[".dev/c"])
#   run(command="bash bench/h200_draft.sh run", carry=[".dev/b", ".whl"], timeout_s=540)
# `recall` (right after `run`, on the same warm machine, carry=[".dev/b", ".whl"], SKIP_PIP=1): the trained
# head's recalls beside proxy-prefetch and the oracle, without training (NUM_STEPS, TEXTS_A/B, HOLDOUT as in `run`).
# Everything lands under $OUT (at most 8 files come back): run.log, train.log, recall-{base,head}-{2048,4096}.json,
# head.tar (config.json, model.safetensors, train_summary.json) and logs.tgz.
set -u
SMOL=/tmp/smol
if [ "${1:-run}" = stage ]; then
  mkdir -p $SMOL && cp -f ${2:-.dev/a}/part* $SMOL/ && ls -la $SMOL && nvidia-smi -L
  exit
fi

OUT=${OUT:-/tmp/h200-out}
mkdir -p "$OUT" /tmp/logs
T0=$(date +%s)
say() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/run.log"; }
# Knobs (seconds are wall time on the device). Measured in run 1 (2026-11-29; `git show fc56694:bench/NOTES.md`):
# install + GGUF conversion 57 s; dense generation of one 512-sample round of 256 new tokens 236 s (0.9 s per step,
# beside the baseline recalls); capture of 414 windows 17 s; held-out scoring 3 s; the head's recalls 35 s
# (2K and 4K in parallel); baselines 2K 89 s, 4K 64 s. The defaults below are the plan for run 2: baselines
# already measured (BASELINES=0), generation cut at 150 s, training until 380 s after train-draft starts.
# Run 1 was: BASELINES=1 TRAIN_LIMIT=250 GEN_LIMIT=60 (then a limit between rounds only: 1 training step).
DEVICE=${DEVICE:-cuda}
CTX_A=${CTX_A:-2048} TEXTS_A=${TEXTS_A:-4}   # windows: the first 8192 essay tokens = both heads' holdout
CTX_B=${CTX_B:-4096} TEXTS_B=${TEXTS_B:-2}
BASELINES=${BASELINES:-0}         # 1: also proxy-prefetch, ngram, oracle and the shipped head, beside training
TRAIN_LIMIT=${TRAIN_LIMIT:-330}   # train-draft's --time-limit, counted from its own start
GEN_LIMIT=${GEN_LIMIT:-130}       # generation stops here, counted from train-draft's start (samples keep what they have).
                                  # Cached rounds load first, so a later call with the same settings GENERATES the
                                  # missing rounds until this limit: GEN_LIMIT=0 to train on the cached text only.
GEN_SAMPLES=${GEN_SAMPLES:-960}   # + GEN_EVAL held-out = 2 rounds of 512
GEN_EVAL=${GEN_EVAL:-64}
GEN_TOKENS=${GEN_TOKENS:-256}
RECALL_LIMIT=${RECALL_LIMIT:-300} # per baseline recall invocation
HEAD_RECALL_LIMIT=${HEAD_RECALL_LIMIT:-120}
DEADLINE=${DEADLINE:-500}         # stop waiting for the baselines this many seconds after the start
BATCH_TOKENS=${BATCH_TOKENS:-8192}
HOLDOUT=${HOLDOUT:-8192}          # essay tokens held out of training (recall's windows come from their start)
GEN_PROMPT=${GEN_PROMPT:-384}     # excerpt tokens per generated sample (they join the training text too)
GEN_PROMPT_MIN=${GEN_PROMPT_MIN:-$GEN_PROMPT}  # below GEN_PROMPT: excerpt lengths drawn from [min, GEN_PROMPT]
SEQ_LEN=${SEQ_LEN:-1024}          # captured window (packed whole samples)
STEPS=${STEPS:-20000}             # 1: generate and capture only (the cache in $CACHE_DIR serves the next call)
GEN_ONLY=${GEN_ONLY:-}            # 1: generate only (--gen-only): no states, whose capture the next call repeats anyway
                                  # when the cache's .pt files are deleted to spare the disk (runs 7-8)
CROP_ROWS=${CROP_ROWS:-}          # head rows per training crop = the head's sliding window (empty: train-draft's default)
GEN_BATCH=${GEN_BATCH:-512}
RECALLS=${RECALLS:-1}             # 0: train only (the head's recalls in a later `recall` call)
NUM_STEPS=${NUM_STEPS:-32}        # forced decode steps per recall text
NUM_TRAIN=${NUM_TRAIN:-200000}    # more than the essays hold after the holdout: all of them
EVAL_TOKENS=${EVAL_TOKENS:-8192}
CACHE_DIR=${CACHE_DIR:-/tmp/cache}
HEAD=${HEAD:-oasiskv_runtime/drafts/heads/smollm2-135m}
MODEL=${MODEL:-smollm2-135m}
RUN=${RUN:-/tmp/run}
. bench/h200_smol.sh
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv >> "$OUT/run.log" 2>&1
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" >> "$OUT/run.log"
python3 -c "from oasiskv_runtime.models.loader import model_config_for; print(model_config_for('$MODEL')[0].name)" \
  >> "$OUT/run.log" 2>&1 || { say "GGUF conversion failed"; exit 6; }
say "GGUF converted"

copy_out() {  # progressive: a timed-out call still returns what is done
  for d in base-$CTX_A base-$CTX_B head-$CTX_A head-$CTX_B; do
    f=$(ls /tmp/r-$d/recall/*/recall.json 2>/dev/null | head -1); [ -n "$f" ] && cp "$f" "$OUT/recall-$d.json"
  done
  [ -f $RUN/train.log ] && cp $RUN/train.log "$OUT/train.log"
  tar czf "$OUT/logs.tgz" -C /tmp logs 2>/dev/null
}
( while sleep 15; do copy_out; done ) &
COPIER=$!

recall() {  # tag ctx texts drafts [--no-proxy]
  local tag=$1 ctx=$2 n=$3 drafts=$4; shift 4
  timeout $RECALL_LIMIT python3 -m oasisbench.cli.main recall --model $MODEL --context-len $ctx \
    --num-texts $n --num-steps $NUM_STEPS --drafts "$drafts" --continuation self,text --fetch-ratio 0.05 \
    --device $DEVICE --dtype float32 --output-dir /tmp/r-$tag-$ctx "$@" > /tmp/logs/recall-$tag-$ctx.log 2>&1
  say "recall $tag $ctx rc=$?"
}
recall_both() {  # tag drafts [args]: the 2K and 4K recalls in parallel
  local tag=$1 drafts=$2; shift 2
  recall $tag $CTX_A $TEXTS_A $drafts "$@" &
  local a=$!
  recall $tag $CTX_B $TEXTS_B $drafts "$@" &
  wait $a $!
}

# `recall`: no training; proxy-prefetch, the oracle, the head in $RUN (the previous `run` call's, still on the warm
# machine, or NEW_HEAD) alone and with n-gram, and the shipped head alone and with n-gram; --continuation self only.
if [ "${1:-run}" = recall ]; then
  NEW=${NEW_HEAD:-$RUN}
  [ -f $NEW/model.safetensors ] || { say "no head at $NEW"; exit 7; }
  SHIPPED=; [ "$NEW" != "$HEAD" ] && SHIPPED=",eagle3:$HEAD,ngram+eagle3:$HEAD"  # the shipped head beside a new one
  recall_both base oracle,eagle3:$NEW,ngram+eagle3:$NEW$SHIPPED --continuation self
  TRAIN=0 RECALLS=0
fi

# Baselines (proxy-prefetch, ngram, oracle, the shipped CPU-trained head) run beside the training.
BASE=
if [ "$BASELINES" = 1 ]; then
  ( recall base $CTX_A $TEXTS_A ngram,oracle,eagle3:$HEAD; recall base $CTX_B $TEXTS_B ngram,oracle,eagle3:$HEAD ) &
  BASE=$!
fi

if [ "${TRAIN:-1}" = 1 ]; then
python3 -m oasisbench.cli.main train-draft --model $MODEL --output $RUN --device $DEVICE --seed 0 \
  --holdout-tokens $HOLDOUT --eval-tokens $EVAL_TOKENS --num-train-tokens $NUM_TRAIN --seq-len $SEQ_LEN --batch-tokens $BATCH_TOKENS \
  --steps $STEPS --lr 1e-3 --draft-vocab 4096 --intermediate-size 1536 --checkpoint-every 0 \
  --time-limit $TRAIN_LIMIT --time-schedule --cache-dir $CACHE_DIR \
  --gen-samples $GEN_SAMPLES --gen-eval-samples $GEN_EVAL --gen-prompt-tokens $GEN_PROMPT --gen-tokens $GEN_TOKENS \
  --gen-prompt-min-tokens $GEN_PROMPT_MIN ${CROP_ROWS:+--crop-rows $CROP_ROWS} \
  --gen-batch $GEN_BATCH ${GEN_ONLY:+--gen-only} \
  --gen-time-limit $GEN_LIMIT --compare-head $HEAD > /tmp/logs/train-draft.log 2>&1
say "train-draft rc=$?"
[ -f $RUN/model.safetensors ] && tar cf "$OUT/head.tar" -C $RUN config.json model.safetensors train_summary.json train.log
cp $RUN/train.log "$OUT/train.log" 2>/dev/null
tail -n 30 /tmp/logs/train-draft.log
fi

if [ -f $RUN/model.safetensors ] && [ "$RECALLS" = 1 ]; then
  # the new head, and the hybrids (n-gram on full matches)
  RECALL_LIMIT=$HEAD_RECALL_LIMIT recall_both head eagle3:$RUN,ngram+eagle3:$RUN,ngram+eagle3:$HEAD --no-proxy \
    --continuation self
fi
if [ -n "$BASE" ]; then
  while kill -0 $BASE 2>/dev/null && [ $(( $(date +%s) - T0 )) -lt $DEADLINE ]; do sleep 2; done
  kill -0 $BASE 2>/dev/null && say "baselines still running at the deadline: returning what is done"
fi
kill $COPIER 2>/dev/null
copy_out
say "done"
python3 - "$OUT" <<'EOF'
import json, glob, sys
for f in sorted(glob.glob(sys.argv[1] + "/recall-*.json")):
    for p in json.load(open(f))["points"]:
        print(f"{p['context_len']:5d} K={p['top_k_blocks']:2d} {p['continuation']:4s} {p['mode']:14s} "
              f"{(p['draft'] or '-')[:40]:40s} recall={p['recall']} acc={p['draft_accuracy']}")
EOF
