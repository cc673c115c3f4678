#!/usr/bin/env bash
# One GPU call: the Hopper decode-attention spec through doit from the carried CPU-built
# artifacts (in this tree, or with `old` in .old: the code before the kernel host), on a fresh
# compile cache, then production tokens/s with the kernel and without.
set -uo pipefail
name=${1:-new}; dir=.; [ "$name" = old ] && dir=.old
[ -d $HOME/site ] || bash .device/part1/install.sh >/dev/null || exit 1
export PYTHONUNBUFFERED=1 CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee $OUT/gpu.txt
SPEC=examples/pipelines/qwen3_decode_attention.json
A=artifacts/pipelines/qwen3_decode_attention
P1="Explain grouped-query attention in one sentence."
now() { python3 -c 'import time; print(time.time())'; }
cd $dir
export PYTHONPATH=$HOME/site:$PWD XDG_CACHE_HOME=/tmp/cache-$name-$$ TMPDIR=/tmp
echo "== $name" | tee -a $OUT/summary.txt
python3 -c "import pipeline.confine as c; print('landlock abi', c.landlock_abi())" 2>&1 | tail -1 | tee -a $OUT/summary.txt
t0=$(now)
timeout 400 python3 -m doit spec=$SPEC > $OUT/$name-doit.log 2>&1; echo "doit rc=$?" | tee -a $OUT/summary.txt
t1=$(now); python3 -c "print('doit wall %.1f s' % ($t1 - $t0))" | tee -a $OUT/summary.txt
grep -E "gate (pass|fail|inconclusive)|Traceback|Error" $OUT/$name-doit.log | cut -c1-700 | tee -a $OUT/summary.txt
grep -E "^[a-z_]+:qwen3|^doit run" $OUT/$name-doit.log | tee -a $OUT/summary.txt
for i in 1; do
  timeout 150 python3 -m pipeline.cli run $A/slot.bundle --kernel-bindings $A/kernel/bindings.json \
    --prompt "$P1" --max-new-tokens 64 --greedy --warmup 2 --benchmark 5 2>>$OUT/$name-run.log \
    | sed 's/^/kernel /' | tee -a $OUT/summary.txt
done
if [ "$name" = new ]; then
  timeout 150 python3 -m pipeline.cli run $A/slot.bundle --kernel-bindings $A/kernel/bindings.json \
    --prompt "$P1" --max-new-tokens 64 --greedy --warmup 2 --benchmark 5 --audit 0.01 2>>$OUT/$name-run.log \
    | sed 's/^/audit1pct /' | tee -a $OUT/summary.txt
fi
timeout 150 python3 -m pipeline.cli run $A/native.bundle --prompt "$P1" --max-new-tokens 64 --greedy \
  --warmup 2 --benchmark 5 2>>$OUT/$name-run.log | sed 's/^/native /' | tee -a $OUT/summary.txt
[ "$name" = new ] && timeout 200 python3 .device/prod.py 15 > $OUT/prod.json 2>>$OUT/$name-run.log && python3 -c "import json; d=json.load(open('$OUT/prod.json')); print({k: d[k] for k in ('tokens_per_s_median', 'hosted_over_in_process', 'hosted_over_native', 'same_tokens')})" | tee -a $OUT/summary.txt
cp $A/reports/correctness.json $OUT/$name-correctness.json 2>/dev/null
cp $A/reports/perf.json $OUT/$name-perf.json 2>/dev/null
tail -5 $OUT/$name-run.log
