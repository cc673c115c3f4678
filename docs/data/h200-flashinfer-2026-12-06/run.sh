#!/usr/bin/env bash
# As it ran on one H200, in back-to-back device calls on one machine:
#   PHASES=opt BUDGET=585 bash run.sh             (the optimized spec's gates: stopped by the call's limit)
#   PHASES="anchor region" BUDGET=375 bash run.sh (the region rows; the anchor is in the decode section)
#   PHASES=e2e BUDGET=170 bash run.sh             (end to end: native, then our Hopper kernel)
# and the FlashInfer arm of e2e again, with native before it, after binding the DSO from its own folder
# (the version below). `.device/` held that machine's staging: the cp312 wheels (part1), FlashInfer
# 0.7.2.post1's headers (fi), and (c4) the artifacts built on a CPU machine with
# `doit spec=examples/pipelines/<spec>.json build_native build_slot` and their doit record.
# One device call of a sequence on an H200: FlashInfer's specs at capacity 40,960 through doit
# (resumable), verify, the region bench, the end-to-end runs and transformers' decode anchors. Each phase runs only while time is left;
# a phase done in an earlier call on the same warm machine is skipped. $BUDGET: this call's seconds.
set -uo pipefail
T0=$(date +%s); BUDGET=${BUDGET:-585}; D=.device/c4
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
  tar xzf $D/built.tgz && log "unpacked the CPU-built artifacts and their doit record"
  touch artifacts/done/db
fi
synth() {  # $1: pipeline folder
  [ -f $1/model/done ] && return 0
  local m; for m in artifacts/pipelines/*/model/done; do  # the same checkpoint: link its files
    [ -f "$m" ] && { cp -al "$(dirname $m)" $1/model && log "linked $1/model from $(dirname $m)"; return 0; }
  done
  local s=$(date +%s); trtmc model synth Qwen3-8B --init pattern --seed 0 -o $1/model > /tmp/synth.log 2>&1
  local rc=$?; log "synth $1 rc=$rc $(( $(date +%s) - s )) s"; [ $rc = 0 ] && touch $1/model/done
}
gate() {  # $1: spec, $2: tag
  local S=$1 T=$2 NAME=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['name'])" $1)
  local A=artifacts/pipelines/$NAME
  [ -f artifacts/done/$T ] && return 0
  [ -d $A/native.bundle ] || { [ -f $D/$T.tgz ] && tar xzf $D/$T.tgz && log "unpacked $T.tgz"; }
  synth $A
  local t=$(( $(left) - ${RESERVE:-20} )); [ $t -lt ${GATE_MIN:-400} ] && { log "$T: no time ($t s)"; return 1; }
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
  reap
}
reap() {  # a stage cut off by timeout must not leave a process holding the GPU
  nvidia-smi --query-compute-apps=pid --format=csv,noheader | xargs -r kill -9 2>/dev/null; sleep 1
}
anchor() {
  [ -f artifacts/done/anchor ] && return 0
  local B=artifacts/pipelines/qwen3_8b_decode_attention_all_layers/native.bundle
  local M=artifacts/pipelines/qwen3_8b_flashinfer_decode_attention_40960/model
  [ -d $B ] || { log "anchor: no bundle"; return 1; }
  synth artifacts/pipelines/qwen3_8b_flashinfer_decode_attention_40960
  local t=$(( $(left) - 15 )); [ $t -lt 240 ] && { log "anchor: no time ($t s)"; return 1; }
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
  trtmc kernel inspect /tmp/fi.so > $OUT/inspect.txt 2>&1; echo "inspect rc=$?" >> $OUT/inspect.txt
  timeout $t python3 benchmarks/gpu_attention.py --out $OUT/gpu_attention_flashinfer.json --flashinfer /tmp/fi.so \
    --contexts 40960:128,40960:2048,40960:4096,40960:32768 --trials ${TRIALS:-100} > $OUT/region-bench.log 2>&1
  local rc=$?; log "region bench rc=$rc $(( $(date +%s) - s )) s"; [ $rc = 0 ] && touch artifacts/done/region
  reap
}
e2e() {  # end to end, one process per arm, in turn: native, FlashInfer, our Hopper kernel
  [ -f artifacts/done/e2e ] && return 0
  [ $(left) -lt 170 ] && { log "e2e: no time ($(left) s)"; return 1; }
  local A=artifacts/pipelines/qwen3_8b_flashinfer_decode_attention_40960 s=$(date +%s) arm args
  synth $A
  [ -f /tmp/fi.so ] || trtmc kernel export flashinfer-decode-attention -o /tmp/fi.so --flashinfer /tmp/fi/fipkg > /dev/null 2>&1
  mkdir -p /tmp/e2e/fi /tmp/e2e/hopper
  cp /tmp/fi.so /tmp/e2e/fi/kernel.so  # a manifest binds a library in its own folder
  trtmc bind manifest $A/selection.json --library /tmp/e2e/fi/kernel.so -o /tmp/e2e/fi/bindings.json > $OUT/e2e-bind.log 2>&1
  trtmc kernel build examples/byok/decode_attention_hopper.cu --cuda -o /tmp/e2e/hopper/kernel.so >> $OUT/e2e-bind.log 2>&1
  trtmc bind manifest $A/selection.json --library /tmp/e2e/hopper/kernel.so -o /tmp/e2e/hopper/bindings.json >> $OUT/e2e-bind.log 2>&1
  local P="Explain, in a few careful sentences, why grouped-query attention lets a decoder keep a longer cache in the same memory."
  for arm in native flashinfer hopper; do
    case $arm in native) args="$A/native.bundle";; flashinfer) args="$A/slot.bundle --kernel-bindings /tmp/e2e/fi/bindings.json";;
      hopper) args="$A/slot.bundle --kernel-bindings /tmp/e2e/hopper/bindings.json";; esac
    timeout 150 trtmc run $args --prompt "$P" --max-new-tokens 256 --greedy --warmup 1 --benchmark 3 2>>$OUT/e2e-run.log \
      | sed "s/^/$arm /" | tee -a $OUT/summary.txt $OUT/e2e.txt
  done
  log "e2e $(( $(date +%s) - s )) s"; touch artifacts/done/e2e; reap
}
if [ -z "${PHASES:-}" ]; then
  case "$(nvidia-smi --query-gpu=name --format=csv,noheader)" in
    *H100*) PHASES="" ;;
    *) PHASES="opt anchor region e2e eager" ;;
  esac
  log "phases: $PHASES"
fi
for phase in $PHASES; do
  case $phase in
    opt) gate examples/pipelines/qwen3_8b_flashinfer_decode_attention_40960.json opt ;;
    eager) gate examples/pipelines/qwen3_8b_flashinfer_decode_attention_40960_eager.json eager ;;
    anchor) anchor ;;
    region) region ;;
    e2e) e2e ;;
  esac
done
log "call done, $(left) s of $BUDGET left"
