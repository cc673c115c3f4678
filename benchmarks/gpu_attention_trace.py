"""Where the Hopper decode-attention kernel's time goes: a tracing build of
examples/byok/decode_attention_hopper.cu (TRTMC_ATTN_MARK records %globaltimer at each phase, thread
0 of every CTA) run as benchmarks/gpu_attention.py's stream timing runs it (one CUDA graph of 36 calls,
one cache each), for each export (`run`, `run_workspace`); the last call's marks are read back.
Phases, per CTA:

  0 entry  1 kv_len read, split known  2 first block landed (warp 0)  3 every warp's last block done
  4 the CTA's partial written (out, or the partials' scratch)  5 ticket drawn (run) or grid barrier
  passed (run_workspace)  6 done (after its merge: run's last CTA, every CTA of run_workspace);
  inside the warps' merge (3 -> 4): 7 each warp's partial in shared memory

    python3 benchmarks/gpu_attention_trace.py --out $OUT/trace.json [--define NAME=VALUE ...]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_attention as ga  # noqa: E402  (the stream timing's method and sizes)

MAX_CTAS, POINTS = 4096, 8
WRAPPER = r"""
#include <cstdint>
__device__ unsigned long long g_trace[{max_ctas}][{points}];
#define TRTMC_ATTN_MARK(point)                                                          \
  do {{                                                                                  \
    if (threadIdx.x == 0 && blockIdx.y * gridDim.x + blockIdx.x < {max_ctas}) {{         \
      unsigned long long t_;                                                            \
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_));                            \
      g_trace[blockIdx.y * gridDim.x + blockIdx.x][point] = t_;                         \
    }}                                                                                   \
  }} while (0)
{defines}
#include "{source}"
namespace {{
// the marks to a CPU int64 tensor of {max_ctas} x {points}, then cleared
void ReadTrace(tvm::ffi::TensorView out) {{
  cudaMemcpyFromSymbol(out.data_ptr(), g_trace, sizeof(g_trace));
  void* p = nullptr;
  cudaGetSymbolAddress(&p, g_trace);
  cudaMemset(p, 0, sizeof(g_trace));
  cudaDeviceSynchronize();
}}
}}  // namespace
TVM_FFI_DLL_EXPORT_TYPED_FUNC(read_trace, ReadTrace);
"""


def build(work: Path, defines: list[str]) -> Path:
    from pipeline.kernels.build import build_kernel
    src, so = work / "decode_attention_hopper_trace.cu", work / "decode_attention_hopper_trace.so"
    src.write_text(WRAPPER.format(max_ctas=MAX_CTAS, points=POINTS, source=ga.SOURCE,
                                  defines="".join(f"#define {d.replace('=', ' ', 1)}\n" for d in defines)))
    build_kernel(src, so, cuda=True, cuda_arch="90a")
    return so


def phases(trace: torch.Tensor) -> dict:
    """Per-CTA phase lengths (ns) of the CTAs that ran (entry mark set: the marks are cleared after
    each read), and the kernel's span."""
    rows = [r for r in trace.tolist() if r[0]]
    t0 = min(r[0] for r in rows)
    out = {"ctas": len(rows), "start_skew_ns": max(r[0] for r in rows) - t0}
    for a, b in ((0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (5, 6), (3, 7), (7, 4)):
        d = [r[b] - r[a] for r in rows if r[a] and r[b]]
        if d:
            out[f"{a}->{b}"] = {"median_ns": statistics.median(d), "max_ns": max(d), "n": len(d)}
    ends = [max(r) for r in rows]
    out["span_ns"] = max(ends) - t0
    out["last_entry_to_end_ns"] = max(ends) - max(r[0] for r in rows)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default="/tmp/work_trace")
    ap.add_argument("--so", help="a tracing build made before (skips the build)")
    ap.add_argument("--define", action="append", default=[], metavar="NAME=VALUE")
    args = ap.parse_args()
    from _gpu import require_cuda
    require_cuda(__file__)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    so = Path(args.so) if args.so else build(work, args.define)
    import tvm_ffi
    module = tvm_ffi.load_module(str(so))
    read = module["read_trace"]
    dev = torch.device("cuda")
    trace = torch.zeros(MAX_CTAS, POINTS, dtype=torch.int64)
    results = []
    for cap in sorted({c for c, _ in ga.TIMING}):
        _, caches, q = ga.stream_inputs(cap, dev)
        out = torch.empty_like(q)
        for ctx, fn in ((c, fn) for c2, c in ga.TIMING if c2 == cap for fn in ga.exports(module, False)):
            kv_len = torch.tensor([ctx], dtype=torch.int32, device=dev)
            us = ga.per_call_us([lambda kv=kv: fn(q, *kv, kv_len, out) for kv in caches])
            read(trace)
            row = {"export": fn.name, "capacity": cap, "context": ctx, "us_per_call": us,
                   "launch": fn.plan(dev, 1, ga.HQ, ga.HKV, cap), **phases(trace)}
            results.append(row)
            ga.log(f"{fn.name} C={cap} ctx={ctx}: {us:.2f} us/call, span {row['span_ns'] / 1e3:.2f} us, skew "
                   f"{row['start_skew_ns']} ns; " + ", ".join(
                       f"{k} {v['median_ns']:.0f}/{v['max_ns']:.0f}" for k, v in row.items()
                       if isinstance(v, dict)))
        del caches
    Path(args.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
                                          "defines": args.define, "method": __doc__, "rows": results},
                                         indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
