#!/usr/bin/env bash
# On the GPU: the engine and transformers' generate (dynamic cache; static cache, compiled) on one
# checkpoint, one process. The bundle is built on a CPU machine first:
#   doit spec=examples/pipelines/qwen3_8b_decode_attention_all_layers.json build_native
# The checkpoint is the same `pattern` synthesis the capacity-40,960 FlashInfer spec's run wrote on that machine.
set -euo pipefail
M=artifacts/pipelines/qwen3_8b_flashinfer_decode_attention_40960/model
trtmc model synth Qwen3-8B --init pattern --seed 0 -o $M
trtmc bench decode artifacts/pipelines/qwen3_8b_decode_attention_all_layers/native.bundle --checkpoint $M \
  --prompt-tokens 128 --new-tokens 256 --trials 3 --json --transformers \
  > engine_128_transformers.json 2> engine_128_transformers.err
