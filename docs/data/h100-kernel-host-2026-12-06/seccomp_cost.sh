#!/usr/bin/env bash
# Export and bind on this GPU, then alternate processes with and without the seccomp filter.
set -uo pipefail
[ -d $HOME/site ] || bash .device/part1/install.sh >/dev/null || exit 1
export PYTHONUNBUFFERED=1 CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} PYTHONPATH=$HOME/site:$PWD XDG_CACHE_HOME=/tmp/cache-sc TMPDIR=/tmp TORCHINDUCTOR_COMPILE_THREADS=1
timeout 200 python3 -m doit spec=examples/pipelines/qwen3_decode_attention.json bind > $OUT/sc-doit.log 2>&1; echo "doit rc=$?"
for round in 1 2; do for mode in plain seccomp; do
  timeout 150 python3 .device/seccomp_cost.py $mode 15 64 >> $OUT/seccomp-cost.jsonl 2>>$OUT/sc.err
done; done
python3 -c "
import json, statistics
rows=[json.loads(l) for l in open('$OUT/seccomp-cost.jsonl')]
for m in ('plain','seccomp'): print(m, [round(r['median']) for r in rows if r['mode']==m])
"
grep -m2 "applied" $OUT/sc.err
