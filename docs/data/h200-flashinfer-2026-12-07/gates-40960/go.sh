#!/usr/bin/env bash
# FlashInfer's specs at capacity 40,960 through doit on a Hopper GPU: eager (the mode expected to promote), then optimized. doit runs
# in its own session (setsid) so one run outlives a device call; every call polls it until its
# BUDGET, copies the logs to $OUT and returns; the next call on the same warm machine polls on.
# A doit that died with a call (no rc written) is started again: it resumes after its last stage.
set -uo pipefail
T0=$(date +%s); BUDGET=${BUDGET:-585}; D=.device/c4; S=/tmp/c5
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
log() { echo "$(date +%H:%M:%S) $*" | tee -a $S/summary.txt; }
mkdir -p $S
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
if [ ! -f $S/memsampler ]; then  # each compute process's GPU memory every 5 s, for the whole run
  touch $S/memsampler
  setsid bash -c "while true; do nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | sed \"s/^/\$(date +%H:%M:%S) /\" >> $S/gpu-memory.txt; sleep 5; done" < /dev/null > /dev/null 2>&1 &
fi
if [ ! -f $S/setup ]; then
  { whoami; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    git log -1 --format='main at %h %s'; } | tee -a $S/summary.txt
  tar xzf $D/built.tgz && log "unpacked the CPU-built artifacts and their doit record"
  touch $S/setup
fi
spec() { case $1 in opt) echo examples/pipelines/qwen3_8b_flashinfer_decode_attention_40960.json;;
  eager) echo examples/pipelines/qwen3_8b_flashinfer_decode_attention_40960_eager.json;; esac; }
folder() { echo artifacts/pipelines/$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['name'])" $(spec $1)); }
synth() {  # $1: pipeline folder
  [ -f $1/model/done ] && return 0
  local m; for m in artifacts/pipelines/*/model/done; do  # the same checkpoint: link its files
    [ -f "$m" ] && { cp -al "$(dirname $m)" $1/model && log "linked $1/model"; return 0; }
  done
  local s=$(date +%s); trtmc model synth Qwen3-8B --init pattern --seed 0 -o $1/model > $S/synth.log 2>&1
  local rc=$?; log "synth $1 rc=$rc $(( $(date +%s) - s )) s"; [ $rc = 0 ] && touch $1/model/done
}
alive() { [ -f $S/$1.pid ] && kill -0 $(cat $S/$1.pid) 2>/dev/null; }
launch() {  # $1: tag; doit in a session of its own, its exit line ending its log
  synth $(folder $1); rm -f $S/$1.pid
  setsid bash -c "echo \$\$ > $S/$1.pid; ${DOIT:-python3 -m doit} spec=$(spec $1) >> $S/doit-$1.log 2>&1; echo doit-exit rc=\$? >> $S/doit-$1.log" \
    < /dev/null > /dev/null 2>&1 &
  while [ ! -f $S/$1.pid ]; do sleep 0.2; done
  sleep 1; log "$1: doit started (pid $(cat $S/$1.pid))"; date +%s > $S/$1.start
}
finish() {  # $1: tag; its doit has ended
  local A=$(folder $1)
    log "$1: doit ended ($(grep -ho "^doit-exit rc=[0-9]*" $S/doit-$1.log | tail -1)) after $(( $(date +%s) - $(cat $S/$1.start) )) s in this launch; $(tail -c 300 $S/doit-$1.log | tr '\r' '\n' | tail -2 | tr '\n' ' ')"
  if [ -f $A/promotion.json ]; then
    trtmc gate verify $A/promotion.json > $S/verify-$1.log 2>&1; log "$1: verify rc=$?"
    cp $A/promotion.json $S/promotion-$1.json
  fi
  [ -d $A/reports ] && tar czf $S/reports-$1.tgz -C $A/reports .
  cp $A/ledger.jsonl $S/ledger-$1.jsonl 2>/dev/null
  nvidia-smi --query-compute-apps=pid --format=csv,noheader | xargs -r kill -9 2>/dev/null
  touch $S/$1.done
}
for T in ${PHASES:-eager opt}; do
  [ -f $S/$T.done ] && continue
  if ! alive $T; then
    if [ -f $S/$T.start ] && grep -q "^doit-exit" $S/doit-$T.log 2>/dev/null; then finish $T; continue; fi
    [ -f $S/$T.start ] && log "$T: its doit is gone without an exit line; starting it again"
    launch $T
  fi
  while alive $T && [ $(left) -gt 20 ]; do sleep 5; done
  alive $T && break
  finish $T
done
if [ -f $S/eager.done ] && [ -f $S/opt.done ] && [ ! -f $S/channel.done ] && [ $(left) -gt 90 ]; then
  for i in 1 2 3; do for how in "" --pageable; do  # alternating, 160 MiB: a probe call's caches at 40,960
    timeout 40 python3 benchmarks/host_channel.py --mib 160 --cuda $how >> $S/channel.jsonl 2>> $S/channel.err
  done; done; log "channel bench done"; touch $S/channel.done
fi
if [ -f $S/eager.done ] && [ -f $S/opt.done ] && [ ! -f $S/tests.done ] && [ $(left) -gt 120 ]; then
  [ -d $HOME/pt ] || pip install -q --no-index --no-deps --target $HOME/pt .device/pt/*.whl > /dev/null 2>&1
  PYTHONPATH=$HOME/site:$PWD:/tmp/fi/site:$HOME/pt timeout $(( $(left) - 30 )) python3 -m pytest -q -p no:cacheprovider \
    tests/test_generate_graphs.py > $S/gpu-tests.log 2>&1; log "gpu tests rc=$? $(tail -1 $S/gpu-tests.log)"; touch $S/tests.done
fi
grep -hE "\[stage\]|gate (pass|fail)|promoted|error:" $S/doit-*.log 2>/dev/null | cut -c1-600 > $S/stages.txt
tar czf $OUT/c5.tgz -C $S --exclude='*.pid' --exclude='*.start' --exclude=memsampler --exclude=setup . 2>/dev/null
for T in opt eager; do [ -f $S/doit-$T.log ] && tr '\r' '\n' < $S/doit-$T.log | tail -4 | sed "s/^/$T| /"; done
log "call done, $(left) s of $BUDGET left"
