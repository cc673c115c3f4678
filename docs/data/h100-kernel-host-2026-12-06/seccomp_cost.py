"""Decode tokens/s of the bound kernel loaded in this process, with or without the kernel host's
seccomp filter applied first (argv[1]: plain | seccomp): what the filter costs per token."""
import json, statistics, sys, time
mode, reps, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
if mode == "seccomp":
    from pipeline.confine import apply_seccomp
    print(apply_seccomp(allow_exec=True), file=sys.stderr)
import torch
from pipeline.host import open_pipeline
A = "artifacts/pipelines/qwen3_decode_attention"
pipe = open_pipeline(f"{A}/slot.bundle", f"{A}/kernel/bindings.json", "cuda", in_process=True)
P = ["Explain grouped-query attention in one sentence."]
for _ in range(2):
    pipe.generate(P, n, greedy=True)
rates = []
for _ in range(reps):
    torch.cuda.synchronize(); t = time.perf_counter()
    out = pipe.generate(P, n, greedy=True)[0]["token_ids"]
    torch.cuda.synchronize(); rates.append(len(out) / (time.perf_counter() - t))
print(json.dumps({"mode": mode, "new_tokens": n, "median": statistics.median(rates), "rates": rates}))
