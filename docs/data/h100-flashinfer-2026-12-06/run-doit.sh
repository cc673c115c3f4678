#!/usr/bin/env bash
# GPU call: FlashInfer's decode kernel in all 36 attention layers of Qwen3-8B through doit (both
# gates, promote, verify), then end-to-end tokens/s: native, FlashInfer, our Hopper kernel.
set -uo pipefail
MODE=${1:-optimized}
[ -d $HOME/site ] || bash .device/part1/install.sh >/dev/null || exit 1
export PYTHONUNBUFFERED=1 CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
mkdir -p /tmp/fi/site/flashinfer $HOME/bin && tar xJf .device/fi/flashinfer.tar.xz -C /tmp/fi
cp /tmp/fi/fipkg/_build_meta.py /tmp/fi/site/flashinfer/ && touch /tmp/fi/site/flashinfer/__init__.py
ln -sfn /tmp/fi/fipkg/data /tmp/fi/site/flashinfer/data
export PYTHONPATH=$HOME/site:$PWD:/tmp/fi/site PATH=$HOME/bin:$PATH TMPDIR=/tmp
printf '#!/bin/sh\nexec python3 -m pipeline.cli "$@"\n' > $HOME/bin/trtmc && chmod +x $HOME/bin/trtmc
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee $OUT/gpu.txt
SPEC=examples/pipelines/qwen3_8b_flashinfer_decode_attention.json
[ "$MODE" = eager ] && SPEC=examples/pipelines/qwen3_8b_flashinfer_decode_attention_eager.json
NAME=$(python3 -c "import json; print(json.load(open('$SPEC'))['name'])")
A=artifacts/pipelines/$NAME
s=$(date +%s); trtmc model synth Qwen3-8B --init pattern --seed 0 -o $A/model > $OUT/synth.log 2>&1
echo "synth rc=$? $(( $(date +%s) - s )) s" | tee -a $OUT/summary.txt
s=$(date +%s); timeout ${DOIT_S:-420} python3 -m doit spec=$SPEC > $OUT/doit-$MODE.log 2>&1
echo "doit rc=$? $(( $(date +%s) - s )) s" | tee -a $OUT/summary.txt
grep -E "gate (pass|fail)|promoted|Error|error:" $OUT/doit-$MODE.log | cut -c1-600 | tee -a $OUT/summary.txt
sed -n '/stage times/,$p' $OUT/doit-$MODE.log | tee -a $OUT/summary.txt
trtmc gate verify $A/promotion.json > $OUT/verify-$MODE.log 2>&1; echo "verify rc=$?" | tee -a $OUT/summary.txt
for f in correctness.json perf.json perf.md correctness.md perf.png; do cp $A/reports/$f $OUT/$MODE-$f 2>/dev/null; done
cp $A/promotion.json $OUT/promotion-$MODE.json 2>/dev/null
gzip -f $OUT/$MODE-correctness.json $OUT/$MODE-correctness.md $OUT/$MODE-perf.json 2>/dev/null
[ "$MODE" = eager ] && exit 0
# end to end, one process per arm, in turn: native, FlashInfer, Hopper
mkdir -p $A/hopper && trtmc kernel build examples/byok/decode_attention_hopper.cu --cuda -o $A/hopper/kernel.so > /dev/null 2>&1
trtmc bind manifest $A/selection.json --library $A/hopper/kernel.so -o $A/hopper/bindings.json > /dev/null
P="Explain, in a few careful sentences, why grouped-query attention lets a decoder keep a longer cache in the same memory."
for arm in native flashinfer hopper; do
  case $arm in native) args="$A/native.bundle";; flashinfer) args="$A/slot.bundle --kernel-bindings $A/kernel/bindings.json";;
    hopper) args="$A/slot.bundle --kernel-bindings $A/hopper/bindings.json";; esac
  timeout 100 trtmc run $args --prompt "$P" --max-new-tokens 256 --greedy --warmup 1 --benchmark 3 2>>$OUT/run.log \
    | sed "s/^/$arm /" | tee -a $OUT/summary.txt
done
