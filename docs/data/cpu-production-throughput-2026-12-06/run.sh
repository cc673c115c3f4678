#!/usr/bin/env bash
# Production tokens/s of one bound kernel hosted (a kernel host, as trtmc run) and in process,
# and of the native bundle: K processes per arm, one arm per process, the order rotating, so the
# spread between processes is measured, not assumed.
#   bash docs/data/cpu-production-throughput-2026-12-06/run.sh K RUNS NEW_TOKENS DEVICE OUT.jsonl
# (artifacts: doit spec=examples/pipelines/qwen3_decode_attention.json build_slot bind)
set -uo pipefail
K=$1; RUNS=$2; N=$3; DEVICE=$4; OUT=$5
here=$(dirname "$0"); A=artifacts/pipelines/qwen3_decode_attention
: > "$OUT"
for i in $(seq 1 "$K"); do
  order="hosted in_process native"; [ $((i % 2)) = 0 ] && order="native in_process hosted"
  [ $((i % 3)) = 0 ] && order="in_process native hosted"
  for arm in $order; do
    python3 "$here/arm.py" "$A" "$arm" "$RUNS" "$N" "$DEVICE" 2>/dev/null >> "$OUT" || echo "{\"arm\": \"$arm\", \"failed\": true}" >> "$OUT"
  done
done
python3 - "$OUT" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
by = {a: [r["median"] for r in rows if r["arm"] == a and "median" in r] for a in ("hosted", "in_process", "native")}
med = {a: statistics.median(v) for a, v in by.items() if v}
print(json.dumps({"per_process_medians": by, "median_of_process_medians": med,
                  "hosted_over_in_process": med["hosted"] / med["in_process"],
                  "hosted_over_native": med["hosted"] / med["native"],
                  "spread_in_process": [min(by["in_process"]), max(by["in_process"])],
                  "spread_hosted": [min(by["hosted"]), max(by["hosted"])],
                  "same_tokens": len({tuple(r["tokens"]) for r in rows if r.get("tokens") and r["arm"] != "native"}) == 1}, indent=1))
PY
