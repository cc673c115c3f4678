"""One arm of the production-throughput comparison, alone in its process: the bound kernel in a
kernel host (hosted, as `trtmc run` opens it) or loaded into this process (in_process), or the
native bundle; prints the arm's tokens/s per run as one JSON line.
    python3 arm.py ARTIFACTS ARM RUNS NEW_TOKENS DEVICE"""
import json
import statistics
import sys
import time

from pipeline.host import open_pipeline

A, arm, runs, n, device = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
prompt = ["Explain grouped-query attention in one sentence."]
bundle, bindings = ((f"{A}/native.bundle", None) if arm == "native"
                    else (f"{A}/slot.bundle", f"{A}/kernel/bindings.json"))
pipe = open_pipeline(bundle, bindings, device, **({"in_process": True} if arm == "in_process" else {}))
pipe.generate(prompt, n, greedy=True)  # warm-up
rates = []
for _ in range(runs):
    t = time.perf_counter()
    tokens = pipe.generate(prompt, n, greedy=True)[0]["token_ids"]
    rates.append(len(tokens) / (time.perf_counter() - t))
print(json.dumps({"arm": arm, "median": statistics.median(rates), "rates": rates, "tokens": tokens}))
getattr(pipe, "close", lambda: None)()
