#!/usr/bin/env bash
# One device call: the FlashInfer spec's whole doit (export, bind, both gates, promote), verify.
# Resumes from .device/fi-state.tar when carried; always leaves $OUT/state.tar to resume from.
set -uo pipefail
T0=$(date +%s); D=$(dirname "$0")
[ -d $HOME/site ] || bash .device/part1/install.sh >/dev/null || exit 1
export TRTMC_PROGRESS=1 PYTHONUNBUFFERED=1 CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
mkdir -p /tmp/fi/site/flashinfer $HOME/bin && tar xJf .device/fi/flashinfer.tar.xz -C /tmp/fi
cp /tmp/fi/fipkg/_build_meta.py /tmp/fi/site/flashinfer/ && touch /tmp/fi/site/flashinfer/__init__.py
ln -sfn /tmp/fi/fipkg/data /tmp/fi/site/flashinfer/data
export PYTHONPATH=$HOME/site:$PWD:/tmp/fi/site PATH=$HOME/bin:$PATH TMPDIR=/tmp
printf '#!/bin/sh\nexec python3 -m pipeline.cli "$@"\n' > $HOME/bin/trtmc && chmod +x $HOME/bin/trtmc
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee -a $OUT/summary.txt
SPEC=${SPEC:-examples/pipelines/qwen3_8b_flashinfer_decode_attention.json}
NAME=$(python3 -c "import json; print(json.load(open('$SPEC'))['name'])"); A=artifacts/pipelines/$NAME
mkdir -p artifacts; cp $D/opt.db artifacts/.doit.db
[ -f $D/fi-state.tar ] && tar xf $D/fi-state.tar && echo "resumed" | tee -a $OUT/summary.txt
[ -n "${CHANNEL:-}" ] && timeout 60 python3 benchmarks/host_channel.py --mib 64 > $OUT/host_channel.txt 2>&1
s=$(date +%s); trtmc model synth Qwen3-8B --init pattern --seed 0 -o $A/model > /tmp/synth.log 2>&1
echo "synth rc=$? $(( $(date +%s) - s )) s" | tee -a $OUT/summary.txt
s=$(date +%s); timeout ${DOIT_S:-480} python3 -m doit spec=$SPEC > $OUT/doit.log 2>&1
echo "doit rc=$? $(( $(date +%s) - s )) s" | tee -a $OUT/summary.txt
grep -E "\[stage\]|gate (pass|fail)|promoted|error:" $OUT/doit.log | cut -c1-600 | tee -a $OUT/summary.txt
tar cf $OUT/state.tar artifacts/.doit.db $A/kernel $A/reports $A/ledger.jsonl $A/promotion.json 2>/dev/null
if [ -f $A/promotion.json ]; then
  trtmc gate verify $A/promotion.json > $A/reports/verify.log 2>&1; echo "verify rc=$?" | tee -a $OUT/summary.txt
  cp $A/promotion.json $A/reports/
  tar czf $OUT/reports.tgz -C $A/reports .
fi
if [ -n "${EXTRA:-}" ]; then
  left=$(( ${BUDGET:-585} - ($(date +%s) - T0) - 15 ))
  [ $left -gt 60 ] && bash $EXTRA $left || echo "no time left for $EXTRA ($left s)" | tee -a $OUT/summary.txt
fi
