#!/usr/bin/env bash
# As it ran, in one device call on one H100 (the package's dependencies on PYTHONPATH): the channel
# GPU to GPU, with the page-locked staging and without it, alternating, three each, 64 and 160 MiB
# frames: bash docs/data/h100-host-channel-2026-12-06/run.sh > runs.jsonl
set -euo pipefail
for mib in 64 160; do for i in 1 2 3; do for how in "" --pageable; do
  timeout 60 python3 benchmarks/host_channel.py --mib $mib --cuda $how
done; done; done
