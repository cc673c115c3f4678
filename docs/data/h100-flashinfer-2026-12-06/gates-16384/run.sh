#!/usr/bin/env bash
# As it ran, on one H100 machine: `PHASES=opt BUDGET=585 bash run.sh`, then `PHASES=eager BUDGET=585
# bash run.sh` in a second device call. `.device/` held that machine's staging: the cp312 wheels
# (part1), FlashInfer 0.7.2.post1's headers (fi), and (c3) the doit record and the artifacts built on
# a CPU machine with `doit spec=examples/pipelines/<spec>.json build_native build_slot`; the
# optimized spec's record came from another machine, so its correctness stage ran again.
# One device call of a sequence: FlashInfer's optimized spec through doit (resumable), verify,
# the decode anchors, then the eager spec (resumable). Each phase runs only while time is left;
# a phase done in an earlier call on the same warm machine is skipped. $BUDGET: this call's seconds.
set -uo pipefail
T0=$(date +%s); BUDGET=${BUDGET:-585}; D=.device/c3
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
log() { echo "$*" | tee -a $OUT/summary.txt; }
[ -d $HOME/site ] || bash .device/part1/install.sh >/dev/null || exit 1
export TRTMC_PROGRESS=1 PYTHONUNBUFFERED=1 CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
if [ ! -d /tmp/fi/site/flashinfer ]; then
  mkdir -p /tmp/fi/site/flashinfer && tar xJf .device/fi/flashinfer.tar.xz -C /tmp/fi
  cp /tmp/fi/fipkg/_build_meta.py /tmp/fi/site/flashinfer/ && touch /tmp/fi/site/flashinfer/__init__.py
  ln -sfn /tmp/fi/fipkg/data /tmp/fi/site/flashinfer/data
fi
mkdir -p $HOME/bin
export PYTHONPATH=$HOME/site:$PWD:/tmp/fi/site PATH=$HOME/bin:$PATH TMPDIR=/tmp
printf '#!/bin/sh\nexec python3 -m pipeline.cli "$@"\n' > $HOME/bin/trtmc && chmod +x $HOME/bin/trtmc
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee -a $OUT/summary.txt
git log -1 --format='main at %h %s' | tee -a $OUT/summary.txt
mkdir -p artifacts/done
if [ ! -f artifacts/done/db ]; then
  cp $D/opt.db artifacts/.doit.db
  [ -f $D/state.tar ] && tar xf $D/state.tar && log "resumed from state.tar"
  touch artifacts/done/db
fi
synth() {  # $1: pipeline folder
  [ -f $1/model/done ] && return 0
  local s=$(date +%s); trtmc model synth Qwen3-8B --init pattern --seed 0 -o $1/model > /tmp/synth.log 2>&1
  local rc=$?; log "synth $1 rc=$rc $(( $(date +%s) - s )) s"; [ $rc = 0 ] && touch $1/model/done
}
gate() {  # $1: spec, $2: tag
  local S=$1 T=$2 NAME=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['name'])" $1)
  local A=artifacts/pipelines/$NAME
  [ -f artifacts/done/$T ] && return 0
  [ -d $A/native.bundle ] || { [ -f $D/$T.tgz ] && tar xzf $D/$T.tgz && log "unpacked $T.tgz"; }
  synth $A
  local t=$(( $(left) - ${RESERVE:-20} )); [ $t -lt 60 ] && { log "$T: no time ($t s)"; return 1; }
  local s=$(date +%s); timeout $t python3 -m doit spec=$S > $OUT/doit-$T-$(date +%H%M%S).log 2>&1
  local rc=$?; log "doit $T rc=$rc $(( $(date +%s) - s )) s"
  grep -hE "\[stage\]|gate (pass|fail)|promoted|error:" $OUT/doit-$T-*.log | cut -c1-700 | tee -a $OUT/summary.txt
  tar cf $OUT/state-$T.tar artifacts/.doit.db $A/kernel $A/reports $A/ledger.jsonl $A/promotion.json 2>/dev/null
  if [ $rc = 0 ] && [ -f $A/promotion.json ]; then
    trtmc gate verify $A/promotion.json > $A/reports/verify.log 2>&1; log "verify $T rc=$?"
    cp $A/promotion.json $A/reports/; rm -f $OUT/state-$T.tar; touch artifacts/done/$T
  fi
  [ $rc = 1 ] && touch artifacts/done/$T  # a gate's verdict: fail
  [ -d $A/reports ] && tar czf $OUT/reports-$T.tgz -C $A/reports .
}
anchor() {
  [ -f artifacts/done/anchor ] && return 0
  local B=artifacts/pipelines/qwen3_8b_decode_attention_all_layers/native.bundle
  local M=artifacts/pipelines/qwen3_8b_flashinfer_decode_attention/model
  [ -d $B ] || { log "anchor: no bundle"; return 1; }
  synth artifacts/pipelines/qwen3_8b_flashinfer_decode_attention
  local t=$(( $(left) - 15 )); [ $t -lt 120 ] && { log "anchor: no time ($t s)"; return 1; }
  local s=$(date +%s)
  timeout $t trtmc bench decode $B --checkpoint $M --prompt-tokens 128 --new-tokens 256 --trials 3 \
    --json --transformers > $OUT/decode-128.json 2> $OUT/decode-128.err
  local rc=$?; log "anchor rc=$rc $(( $(date +%s) - s )) s"; [ $rc = 0 ] && touch artifacts/done/anchor
}
region() {
  [ -f artifacts/done/region ] && return 0
  local t=$(( $(left) - 15 )); [ $t -lt 120 ] && { log "region: no time ($t s)"; return 1; }
  local s=$(date +%s)
  trtmc kernel export flashinfer-decode-attention -o /tmp/fi.so --flashinfer /tmp/fi/fipkg > $OUT/region-export.log 2>&1
  log "region export rc=$? $(( $(date +%s) - s )) s"; t=$(( $(left) - 15 ))
  timeout $t python3 benchmarks/gpu_attention.py --out $OUT/gpu_attention_flashinfer.json --flashinfer /tmp/fi.so \
    --contexts 40960:128,40960:2048,40960:4096,40960:32768 --trials ${TRIALS:-100} > $OUT/region-bench.log 2>&1
  local rc=$?; log "region bench rc=$rc $(( $(date +%s) - s )) s"; [ $rc = 0 ] && touch artifacts/done/region
}
if [ -z "${PHASES:-}" ]; then
  case "$(nvidia-smi --query-gpu=name --format=csv,noheader)" in
    *H100*) PHASES="" ;;
    *) PHASES="anchor region" ;;
  esac
  log "phases: $PHASES"
fi
for phase in $PHASES; do
  case $phase in
    opt) gate examples/pipelines/qwen3_8b_flashinfer_decode_attention.json opt ;;
    eager) gate examples/pipelines/qwen3_8b_flashinfer_decode_attention_eager.json eager ;;
    anchor) anchor ;;
    region) region ;;
  esac
done
log "call done, $(left) s of $BUDGET left"
