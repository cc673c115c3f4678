"""The tutorial's attention flow under both gates: layer 0's decode attention
(`qwen.decode_attention_region@2`) bound to the Hopper kernel, at the Qwen3-8B attention layout
and the tutorial's build arguments (bf16, capacity 40,960, split layout), in a chosen mode.

Inputs built on a CPU machine and carried (docs/performance.md shows the commands): a synthetic
Qwen3 with Qwen3-8B's attention (32 query heads, 8 KV heads, head dim 128) and small everything
else, its native and attention-slot bundles, and the slot's selection receipt. Here: build
examples/byok/decode_attention_hopper.cu (sm_90a on a GPU, the CPU fallback otherwise), write
its binding manifest, then per mode open both pipelines for gating (slot outputs poisoned before
every call) and run `run_correctness_gate` and `run_perf_gate` (every trial kept, with the in-situ
region timing). One JSON of reports to --out.

The slot may instead be a manual selection of the same nodes with a workspace (`trtmc graph
select ... --workspace-bytes N`, N from the DSO's workspace_bytes export), bound to the export
`run_workspace` with --function.

    python3 benchmarks/gpu_attention_flow.py --native N.bundle --slot S.bundle --selection S.json \
        [--function run|run_workspace] [--checkpoint DIR] [--device cuda] [--modes optimized,eager] \
        [--trials 60] --out flow.json
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

KERNEL = Path(__file__).resolve().parent.parent / "examples" / "byok" / "decode_attention_hopper.cu"
PROMPTS = ["Explain grouped-query attention in one sentence.", "A kernel author replaces one region.",
           "The quick brown fox jumps over the lazy dog."]


def main() -> int:
    from gpu_gates import bound_kernel, gate_arguments, gate_modes  # benchmarks/ is first on sys.path
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    gate_arguments(ap, "/tmp/attention_flow", "optimized,eager")
    ap.add_argument("--checkpoint", default=None,
                    help="the checkpoint folder of weight-stripped (--weights reference) bundles")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--function", default="run", choices=("run", "run_workspace"),
                    help="the DSO's export to bind: run (the recipe's ABI) or run_workspace (a "
                         "selection with a workspace)")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    args = ap.parse_args()
    if args.device.startswith("cuda"):
        from _gpu import require_cuda
        require_cuda(__file__)

    from pipeline import log
    log.configure()
    cuda = args.device == "cuda"
    t = time.perf_counter()
    manifest = bound_kernel(KERNEL, Path(args.work), args.selection, cuda, args.function)
    result = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d"), "prompts": PROMPTS, "kernel": KERNEL.name,
              "function": args.function,
              "kernel_build_seconds": time.perf_counter() - t, "method": __doc__}
    gate_modes("qwen3_attention", args.native, args.slot, manifest, args.device, args.checkpoint,
               PROMPTS, args.modes.split(","), args.trials, args.max_new_tokens, Path(args.out),
               result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
