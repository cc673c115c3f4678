#!/usr/bin/env bash
# The channel's frames, this checkout against the code before 719e1fb (64 KiB pipes, joined
# reads), alternating, three each: bash docs/data/cpu-host-channel-2026-12-06/run.sh > OUT.jsonl
set -euo pipefail
[ -d /tmp/wt-old ] || git worktree add -q /tmp/wt-old 6a87987
for i in 1 2 3; do
  printf '{"code": "new", ' ; PYTHONPATH=$PWD python3 benchmarks/host_channel.py --mib 64 | cut -c2-
  printf '{"code": "old", ' ; PYTHONPATH=/tmp/wt-old python3 benchmarks/host_channel.py --mib 64 --pipe-bytes 65536 | cut -c2-
done
