#!/usr/bin/env bash
# GPU call: FlashInfer's decode kernel exported on the GPU, then the region bench beside the Hopper
# kernel and the native region (probe, graph replays, timings at 2k/4k/32k keys, stream timing).
set -uo pipefail
[ -d $HOME/site ] || bash .device/part1/install.sh >/dev/null || exit 1
export PYTHONUNBUFFERED=1 CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} PYTHONPATH=$HOME/site:$PWD
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee $OUT/gpu.txt
mkdir -p /tmp/fi && tar xJf .device/fi/flashinfer.tar.xz -C /tmp/fi
t0=$(date +%s.%N)
python3 -m pipeline.cli kernel export flashinfer-decode-attention -o /tmp/fi.so --flashinfer /tmp/fi/fipkg 2>&1 | tee $OUT/export.log
echo "export $(python3 -c "print(round($(date +%s.%N) - $t0, 1))") s" | tee -a $OUT/export.log
python3 -m pipeline.cli kernel inspect /tmp/fi.so > $OUT/inspect.txt 2>&1; echo "inspect rc=$?" >> $OUT/inspect.txt
timeout 420 python3 bench/gpu_attention.py --out $OUT/gpu_attention_flashinfer.json --flashinfer /tmp/fi.so \
  --contexts 40960:128,40960:2048,40960:4096,40960:32768 --trials ${TRIALS:-100} > $OUT/bench.log 2>&1
echo "bench rc=$?"
grep -E "flashinfer|FAIL|Error|error" $OUT/bench.log | head -80
tail -30 $OUT/bench.log
