#!/usr/bin/env bash
# The Hopper spec's whole flow on a GPU after the host's CPU clock was fixed (built on a CPU as in
# ../run.sh), then `gate verify`; the same call then ran the FlashInfer region bench
# (../../h100-flashinfer-2026-12-06/run-region.sh with 30 trials, raw in its recheck/ folder).
set -uo pipefail
export PYTHONUNBUFFERED=1 CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} TMPDIR=/tmp PYTHONPATH=$PWD XDG_CACHE_HOME=/tmp/xdg-g2
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee $OUT/summary.txt
S=examples/pipelines/qwen3_decode_attention.json; A=artifacts/pipelines/qwen3_decode_attention
rm -rf $A/reports/*
s=$(date +%s); timeout 220 python3 -m doit spec=$S > $OUT/doit.log 2>&1; echo "doit rc=$? $(( $(date +%s) - s )) s" | tee -a $OUT/summary.txt
grep -E "^[a-z_]+:|gate (pass|fail|inconclusive)|promoted" $OUT/doit.log | cut -c1-400 | tee -a $OUT/summary.txt
python3 -m pipeline.cli gate verify $A/promotion.json > $A/reports/verify.log 2>&1; echo "verify rc=$?" | tee -a $OUT/summary.txt
cp $A/promotion.json $A/reports/ 2>/dev/null; tar czf $OUT/reports.tgz -C $A/reports .
