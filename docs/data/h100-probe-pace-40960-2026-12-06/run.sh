#!/usr/bin/env bash
# As it ran: the spec here (examples/pipelines/qwen3_decode_attention_all_layers.json at capacity
# 40,960, 10 perf trials) built on a CPU machine with `doit spec=S build_native build_slot`, its
# artifacts and doit record carried to one H100 without the synthetic model, the model synthesized
# there from the spec's recipe, then, in one device call:
S=docs/data/h100-probe-pace-40960-2026-12-06/spec.json
python3 -m doit spec=$S
trtmc gate verify artifacts/pipelines/qwen3_tiny_attention_40960_check/promotion.json
