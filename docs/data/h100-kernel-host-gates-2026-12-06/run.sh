#!/usr/bin/env bash
# Kernel host cost on a GPU, one call: (1) the Hopper spec's gates, HEAD (kernel host) against
# 6049f4b (kernel in the gate's worker), alternating, each doit on an empty compile cache;
# (2) production decode, K processes per arm in rotating order (hosted / in process / native).
# Before it, on any machine with the project installed (`pip install .`): `git worktree add .old
# 6049f4b`, and in the checkout and in .old, `python3 -m doit spec=examples/pipelines/
# qwen3_decode_attention.json build_slot` (the TensorRT builder runs on a CPU); then copy the
# checkout with its artifacts to the GPU machine and run this from its root with OUT set to a
# folder for the results. (As run, the artifacts and wheels travelled packed; the steps unpacking
# them are left out here.)
set -uo pipefail
K=${K:-5}; REPS=${REPS:-7}; N=${N:-64}; PAIRS=${PAIRS:-1}
export PYTHONUNBUFFERED=1 CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} TMPDIR=/tmp TRTMC_PROGRESS=0
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee $OUT/gpu.txt
S=examples/pipelines/qwen3_decode_attention.json; A=artifacts/pipelines/qwen3_decode_attention
echo "# $(date -u +%F) new = $(git rev-parse --short HEAD 2>/dev/null || echo HEAD) (kernel host), old = 6049f4b (kernel in the gate's worker)" | tee $OUT/gatecost.txt
for i in $(seq 1 $PAIRS); do for t in new old; do d=$PWD; [ $t = old ] && d=$PWD/.old
  rm -rf $d/$A/reports/*
  s=$(date +%s.%N)
  (cd $d && XDG_CACHE_HOME=/tmp/xdg-$t-$i PYTHONPATH=$d timeout 280 python3 -m doit spec=$S correctness perf > $OUT/doit-$t-$i.log 2>&1)
  rc=$?; e=$(python3 -c "import time; print(round(time.time()-$s,1))")
  grep -E "^(export_dso|bind|correctness|perf):|gate (pass|fail|inconclusive)" $OUT/doit-$t-$i.log | cut -c1-200 | sed "s/^/$t $i /" | tee -a $OUT/gatecost.txt
  echo "$t $i doit rc=$rc wall=$e s" | tee -a $OUT/gatecost.txt
  cp $d/$A/reports/correctness.json $OUT/correctness-$t-$i.json 2>/dev/null; cp $d/$A/reports/perf.json $OUT/perf-$t-$i.json 2>/dev/null
done; done
export PYTHONPATH=$PWD XDG_CACHE_HOME=/tmp/xdg-prod
for i in $(seq 1 $K); do
  order="hosted in_process native"; [ $((i % 2)) = 0 ] && order="native in_process hosted"
  for arm in $order; do
    timeout 100 python3 $(dirname $0)/prod_arm.py $A $arm $REPS $N 2>>$OUT/prod_many.err | tee -a $OUT/prod_many.jsonl
  done
done
echo done | tee -a $OUT/gatecost.txt
