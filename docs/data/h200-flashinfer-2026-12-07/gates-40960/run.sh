#!/usr/bin/env bash
# As it ran, on one H200 (2026-12-07), in three back-to-back device calls on one machine:
#   BUDGET=575 go.sh (with /tmp/c5/channel.done and /tmp/c5/tests.done made first: no channel
#   benchmark, no GPU tests), BUDGET=585 go.sh, BUDGET=240 go.sh
# (go.sh is the H100 run's script, docs/data/h100-flashinfer-2026-12-07/gates-40960/go.sh, as it is;
# each call polls the doit run the first one started and returns the logs so far). It ran the eager
# spec, then the optimized one, each as
#   python3 -m doit spec=examples/pipelines/qwen3_8b_flashinfer_decode_attention_40960{_eager,}.json
# on the artifacts built on a CPU machine with `doit spec=S build_native build_slot` and their doit
# record (unpacked from .device/c4/built.tgz), the checkpoint written there with
# `trtmc model synth Qwen3-8B --init pattern --seed 0`, and each compute process's GPU memory
# sampled every 5 s (gpu-memory.txt: time, pid, MiB). The working tree was main at 1e41b42.
# summary.txt is what the calls printed; per mode: the doit log, the reports, the ledger, and for
# the promoted spec its receipt and `trtmc gate verify`'s output.
mkdir -p /tmp/c5 && touch /tmp/c5/channel.done /tmp/c5/tests.done
BUDGET=575 bash "$(dirname "$0")/../../h100-flashinfer-2026-12-07/gates-40960/go.sh"
BUDGET=585 bash "$(dirname "$0")/../../h100-flashinfer-2026-12-07/gates-40960/go.sh"
BUDGET=240 bash "$(dirname "$0")/../../h100-flashinfer-2026-12-07/gates-40960/go.sh"
