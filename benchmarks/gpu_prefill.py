"""A prompt's prefill on the GPU: the attention rules side by side, and where a prefill's time goes.

`python3 benchmarks/gpu_prefill.py attention --out a.json` (CUDA torch and triton; no artifacts):
Qwen3-8B's attention (32 query heads, 8 KV heads, head dim 128, BF16, causal, from an empty
cache) at each `--tokens` length, three ways:
* `triton`: the optimized mode's prompt kernel (pipeline/runtime/triton_attention.py,
  FlashAttention's rule: P rounded to BF16 before P@V);
* `fp32`: the eager mode's rule (pipeline/runtime/decoder_ops.py: torch's fused attention on FP32
  copies, FP32 P);
* `sdpa_bf16`: torch's scaled_dot_product_attention on the BF16 tensors, is_causal (what torch
  picks for BF16 on this GPU), for scale.
Time per call: the median of 20 calls between CUDA events after 3 warm-up calls. Error: the
relative Frobenius error against float64 on the same inputs, and the largest absolute difference.

`python3 benchmarks/gpu_prefill.py profile BUNDLE --out p.json`: the bundle's prefill (the mode the
pipeline opens in on CUDA, `--mode` to choose) at each `--tokens` length: wall time of one
synchronized prefill (median of 5 after 2 warm-up runs), then one more under torch.profiler: the
GPU's busy time and the kernels that take it, grouped by name.
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

HQ, HKV, D = 32, 8, 128


def _event_ms(fn, calls: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(calls):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def attention(args) -> dict:
    from pipeline.runtime import decoder_ops, triton_attention
    rows = []
    for s in args.tokens:
        g = torch.Generator(device="cuda").manual_seed(s)
        q = torch.randn(1, HQ, s, D, device="cuda", generator=g).bfloat16()
        k, v = (torch.randn(1, HKV, s, D, device="cuda", generator=g).bfloat16() for _ in range(2))
        n = torch.tensor([s], dtype=torch.int32, device="cuda")
        allow = torch.ones(1, 1, s, s, dtype=torch.bool, device="cuda").tril()
        kr, vr = (t.repeat_interleave(HQ // HKV, 1) for t in (k, v))
        ways = {"triton": lambda: triton_attention.prompt_attention(q, k, v, n, True),
                "fp32": lambda: decoder_ops._prompt_attention(q, k, v, allow, None).bfloat16(),
                "sdpa_bf16": lambda: F.scaled_dot_product_attention(q, kr, vr, is_causal=True,
                                                                    scale=1.0)}
        want = torch.softmax((q.double() @ kr.double().mT).masked_fill(~allow, float("-inf")),
                             -1) @ vr.double()
        row = {"tokens": s}
        for name, fn in ways.items():
            got = fn().double()
            row[name] = {"ms": _event_ms(fn),
                         "rel_error": ((got - want).norm() / want.norm()).item(),
                         "max_abs_diff": (got - want).abs().max().item()}
        del want
        rows.append(row)
        print(json.dumps(row), flush=True)
    return {"shape": {"heads": HQ, "kv_heads": HKV, "head_dim": D, "dtype": "bf16"}, "rows": rows}


def profile(args) -> dict:
    import time

    from torch.profiler import ProfilerActivity, profile as torch_profile

    from pipeline.gates.bench import _prompt
    from pipeline.runtime.generate import KVCache, _programs, _Step
    from pipeline.runtime.pipeline import open_pipeline
    pipe = open_pipeline(args.bundle, None, "cuda", mode=args.mode)
    prefill, _ = _programs(pipe)
    cache = KVCache(prefill, pipe.family.io)
    run = _Step(prefill, cache)
    rows = []
    for s in args.tokens:
        ids = torch.tensor([_prompt(pipe, s, 0)], dtype=torch.int32, device="cuda")
        past = torch.zeros(1, dtype=torch.int32, device="cuda")

        def once():
            cache.reset()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            run(ids, past).argmax().item()
            return time.perf_counter() - t0
        with torch.inference_mode():
            for _ in range(2):
                once()
            walls = [once() for _ in range(5)]
            with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
                once()
        kernels: dict[str, list] = {}
        for e in prof.events():
            if e.device_type.name == "CUDA":
                k = kernels.setdefault(e.name[:90], [0, 0.0])
                k[0] += 1
                k[1] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        busy_us = sum(c for _, c in kernels.values())
        top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:args.top]
        row = {"tokens": s, "mode": pipe.mode.value, "wall_ms": [w * 1e3 for w in walls],
               "median_wall_ms": statistics.median(walls) * 1e3, "gpu_busy_ms": busy_us / 1e3,
               "kernel_launches": sum(n for n, _ in kernels.values()),
               "top": [{"kernel": name, "calls": n, "ms": us / 1e3} for name, (n, us) in top]}
        rows.append(row)
        print(json.dumps({k: row[k] for k in ("tokens", "mode", "median_wall_ms", "gpu_busy_ms",
                                              "kernel_launches")}), flush=True)
    return {"bundle": str(args.bundle), "rows": rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="part", required=True)
    a = sub.add_parser("attention")
    p = sub.add_parser("profile")
    p.add_argument("bundle")
    p.add_argument("--mode", choices=("optimized", "eager"), default=None)
    p.add_argument("--top", type=int, default=12)
    for q in (a, p):
        q.add_argument("--tokens", type=lambda v: [int(x) for x in v.split(",")],
                       default=[128, 4000])
        q.add_argument("--out", required=True)
    args = ap.parse_args()
    from _gpu import require_cuda
    require_cuda(__file__)
    result = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
              **(attention(args) if args.part == "attention" else profile(args))}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
