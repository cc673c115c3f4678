"""One arm of the production-throughput comparison in a process of its own: the bound kernel in a
kernel host (hosted) or loaded here (in_process), or the native bundle; prints the arm's rates."""
import json, statistics, sys, time
import torch
from pipeline.host import open_pipeline
A, arm, reps, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
P = ["Explain grouped-query attention in one sentence."]
bundle, bindings = (f"{A}/native.bundle", None) if arm == "native" else (f"{A}/slot.bundle", f"{A}/kernel/bindings.json")
pipe = open_pipeline(bundle, bindings, "cuda", **({"in_process": True} if arm == "in_process" else {}))
for _ in range(2):
    pipe.generate(P, n, greedy=True)
rates = []
for _ in range(reps):
    torch.cuda.synchronize(); t = time.perf_counter()
    out = pipe.generate(P, n, greedy=True)[0]["token_ids"]
    torch.cuda.synchronize(); rates.append(len(out) / (time.perf_counter() - t))
print(json.dumps({"arm": arm, "median": statistics.median(rates), "rates": rates, "tokens": out}))
close = getattr(pipe, "close", None)
close and close()
