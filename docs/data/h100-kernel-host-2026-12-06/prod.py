"""Production decode throughput of one bound kernel, in a kernel host and loaded in this process,
and of the native bundle, alternating in one process: tokens/s medians and their ratios."""
import json, statistics, sys, time
import torch
from pipeline.host import open_pipeline
A = "artifacts/pipelines/qwen3_decode_attention"
P = ["Explain grouped-query attention in one sentence."]
REPS, N = (int(a) for a in (sys.argv[1:] + ["15", "64"][len(sys.argv) - 1:])[:2])
arms = {"hosted": open_pipeline(f"{A}/slot.bundle", f"{A}/kernel/bindings.json", "cuda"),
        "in_process": open_pipeline(f"{A}/slot.bundle", f"{A}/kernel/bindings.json", "cuda", in_process=True),
        "native": open_pipeline(f"{A}/native.bundle", None, "cuda")}
tokens = {}
for name, pipe in arms.items():
    for _ in range(2):
        tokens[name] = pipe.generate(P, N, greedy=True)[0]["token_ids"]
rates = {k: [] for k in arms}
for r in range(REPS):
    for name in (list(arms) if r % 2 == 0 else list(reversed(arms))):
        torch.cuda.synchronize(); t = time.perf_counter()
        out = arms[name].generate(P, N, greedy=True)[0]["token_ids"]
        torch.cuda.synchronize(); rates[name].append(len(out) / (time.perf_counter() - t))
med = {k: statistics.median(v) for k, v in rates.items()}
print(json.dumps({"gpu": torch.cuda.get_device_name(0), "reps": REPS, "new_tokens": N,
                  "tokens_per_s_median": med, "hosted_over_in_process": med["hosted"] / med["in_process"],
                  "hosted_over_native": med["hosted"] / med["native"],
                  "same_tokens": tokens["hosted"] == tokens["in_process"], "rates": rates}, indent=1))
arms["hosted"].close()
