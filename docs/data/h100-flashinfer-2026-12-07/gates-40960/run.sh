#!/usr/bin/env bash
# As it ran, on one H100 (2026-12-07), in one device call: `BUDGET=575 bash go.sh` (the script
# beside this one), with the channel benchmark it ends with switched off (/tmp/c5/channel.done
# made first). It ran the eager spec, then the optimized one, each as
#   python3 -m doit spec=examples/pipelines/qwen3_8b_flashinfer_decode_attention_40960{_eager,}.json
# on the artifacts built on a CPU machine with `doit spec=S build_native build_slot` and their doit
# record (unpacked from .device/c4/built.tgz), the checkpoint written there with
# `trtmc model synth Qwen3-8B --init pattern --seed 0`, and each compute process's GPU memory
# sampled every 5 s (gpu-memory.txt: time, pid, MiB). The working tree was main at 6785fb9 (the
# "main at" line of summary.txt is the device checkout's own, older, git record); summary.txt is
# what the call printed. Only the logs, the memory samples and the eager spec's ledger (its
# correctness verdict) came back from the call.
mkdir -p /tmp/c5 && touch /tmp/c5/channel.done
BUDGET=575 bash "$(dirname "$0")/go.sh"
