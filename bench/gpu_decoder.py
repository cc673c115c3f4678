"""GPU run of the decoder flow: the reference decode-attention kernel's CUDA path, bound to one
layer's attention recipe of a small synthetic Qwen3 (Qwen3-8B head layout: 32 query heads, 8 KV
heads, head_dim 128), against the native bundle: region probe, greedy-token equality, and
generation throughput side by side (alternating, after warm-up). Writes raw figures to --out.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

PROMPTS = ["The kernel was promoted because", "Once upon a time in a small town",
           "TensorRT networks are built from"]


def _generate_seconds(pipe, prompts, new_tokens: int) -> tuple[float, list]:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    records = pipe.generate(prompts, new_tokens, greedy=True)
    torch.cuda.synchronize()
    return time.perf_counter() - t0, records


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--native", required=True)
    ap.add_argument("--slot", required=True)
    ap.add_argument("--selection", required=True)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--trials", type=int, default=5)
    args = ap.parse_args()

    from pipeline.kernels.build import build_kernel
    from pipeline.kernels.manifest import write_manifest
    from pipeline.gates.probe import region_probe
    from pipeline.runtime.pipeline import open_pipeline

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    receipt = json.loads(Path(args.selection).read_text())
    so = build_kernel(Path("examples/byok/decode_attention.cu"), work / "decode_attention_cuda.so",
                      cuda=True, cuda_arch="90a")
    manifest = write_manifest(work / "attention.bindings.json", [receipt], so)
    probe = region_probe(open_pipeline(args.slot, manifest, "cuda", args.checkpoint), seed=0)
    print(f"probe {'PASS' if probe['passed'] else 'FAIL'}: {probe['slots']}", flush=True)

    native = open_pipeline(args.native, None, "cuda", args.checkpoint)
    external = open_pipeline(args.slot, manifest, "cuda", args.checkpoint)
    _generate_seconds(native, PROMPTS[:1], 8)  # warm-up both
    _generate_seconds(external, PROMPTS[:1], 8)
    t_native, t_ext = [], []
    for _ in range(args.trials):  # alternate
        s, ref = _generate_seconds(native, PROMPTS, args.new_tokens)
        t_native.append(s)
        s, out = _generate_seconds(external, PROMPTS, args.new_tokens)
        t_ext.append(s)
    equal = [a["token_ids"] == b["token_ids"] for a, b in zip(ref, out)]
    tokens = sum(len(r["token_ids"]) for r in ref)
    result = {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"), "prompts": PROMPTS, "new_tokens": args.new_tokens,
        "trials": args.trials, "probe": probe, "greedy_tokens_equal": equal,
        "generated_tokens": tokens, "native_seconds": t_native, "external_seconds": t_ext,
        "native_tokens_per_sec_median": tokens / statistics.median(t_native),
        "external_tokens_per_sec_median": tokens / statistics.median(t_ext),
        "throughput_ratio_median": statistics.median(n / e for n, e in zip(t_native, t_ext)),
    }
    print(f"greedy tokens equal: {equal}; tokens/s native {result['native_tokens_per_sec_median']:.1f}"
          f" external {result['external_tokens_per_sec_median']:.1f} ratio "
          f"{result['throughput_ratio_median']:.3f}", flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0 if probe["passed"] and all(equal) else 1


if __name__ == "__main__":
    sys.exit(main())
