"""The optimized decode step's pieces at Qwen3-8B dimensions, one against another, on the GPU.

`python3 benchmarks/gpu_decode_kernels.py --out result.json` (CUDA torch and triton; no TensorRT).

* GEMVs (one row, bf16): each weight GEMM of a decoder layer, with the element-wise work the
  network puts around it, compiled by Inductor: cuBLAS (torch.matmul) against the product written
  as a broadcast multiply summed over K, a reduction Inductor fuses with its neighbours (with and
  without Inductor's coordinate-descent tuning of block sizes).
* GEMV configs: the bare one-row product, cuBLAS against pipeline/runtime/triton_gemv.py's
  kernel in several block shapes (`--parts gemv_configs`).
* Decode attention: the Triton kernels of pipeline/runtime/triton_attention.py (several split and
  block sizes) against flex attention over a device-built block mask, at capacities 4,096 and
  40,960 and several active lengths; checked against float64 first.

Method: one CUDA graph holds COPIES calls, each on its own weights or cache
(36, as the model has layers, so nothing is served from L2 that a decode step would re-read from
memory), replayed 20 times between CUDA events after warm-up (gpu_attention.per_call_us); time
per call = the median replay over COPIES. Bandwidth = the bytes a call must read (weights, or the active keys and
values) over that time, beside the device-to-device copy bandwidth measured in the same run.
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from gpu_attention import copy_bandwidth, per_call_us  # benchmarks/ is first on sys.path
from pipeline.runtime import triton_attention, triton_gemv

COPIES = 36  # calls in one graph, each on its own weights or cache
HIDDEN, INTER, HQ, HKV, D, EPS = 4096, 12288, 32, 8, 128, 1e-6
BF16 = torch.bfloat16


def rms(x, g):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(BF16) * g


# -- the layer's GEMMs with their neighbours: (name, weight shapes, fn(x, h, g, *weights, gemm)) --
def qkv(x, h, g, w, gemm):
    return gemm(rms(x, g), w)


def o_residual(x, h, g, w, gemm):
    return h + gemm(x, w)


def gate_up_merged(x, h, g, w, gemm):
    gu = gemm(rms(x, g), w)
    gate, up = gu.split(INTER, dim=-1)
    return F.silu(gate) * up


def gate_up_separate(x, h, g, wg, wu, gemm):
    n = rms(x, g)
    return F.silu(gemm(n, wg)) * gemm(n, wu)


def down_residual(x, h, g, w, gemm):
    return h + gemm(x, w)


def lm_head(x, h, g, w, gemm):
    return gemm(rms(x, g), w)


GEMMS = [("qkv + rmsnorm", [(6144, HIDDEN)], HIDDEN, qkv),
         ("o + residual", [(HIDDEN, HIDDEN)], HIDDEN, o_residual),
         ("gate/up merged + rmsnorm + silu*mul", [(2 * INTER, HIDDEN)], HIDDEN, gate_up_merged),
         ("gate/up separate + rmsnorm + silu*mul", [(INTER, HIDDEN)] * 2, HIDDEN, gate_up_separate),
         ("down + residual", [(HIDDEN, INTER)], INTER, down_residual),
         ("lm head + rmsnorm", [(151936, HIDDEN)], HIDDEN, lm_head)]
def single_row_gemv(x, weight, out):
    """x [..., 1, K] @ weight[N, K]^T as a broadcast product summed over K in FP32: a reduction
    Inductor generates itself and fuses with the element-wise work around it."""
    return (x.unsqueeze(-2).float() * weight.float()).sum(-1).to(out)


GEMM_WAYS = {"cublas": lambda x, w: torch.matmul(x, w.mT),
             "reduction": lambda x, w: single_row_gemv(x, w, BF16)}
WAY_OPTIONS = {"cublas": {}, "reduction": {}, "reduction+cdt": {"coordinate_descent_tuning": True}}


def gemv_rows() -> list[dict]:
    rows = []
    for name, shapes, k, fn in GEMMS:
        copies = 1 if shapes[0][0] > 100000 else COPIES
        weights = [[torch.randn(s, device="cuda", dtype=BF16) * 0.02 for s in shapes]
                   for _ in range(copies)]
        nbytes = sum(n * kk * 2 for n, kk in shapes)
        x = torch.randn(1, 1, k, device="cuda", dtype=BF16)
        h = torch.randn(1, 1, HIDDEN, device="cuda", dtype=BF16)
        g = torch.randn(k, device="cuda", dtype=BF16)
        row = {"gemm": name, "weight_bytes": nbytes}
        outs = {}
        for way, options in WAY_OPTIONS.items():
            gemm = GEMM_WAYS[way.split("+")[0]]
            compiled = torch.compile(lambda x, h, g, *ws, gemm=gemm: fn(x, h, g, *ws, gemm),
                                     fullgraph=True, dynamic=False, options=options)
            outs[way] = compiled(x, h, g, *weights[0])
            us = per_call_us([lambda ws=ws: compiled(x, h, g, *ws) for ws in weights])
            row[way] = {"us": us, "bytes_per_s": nbytes / (us * 1e-6)}
        ref = fn(x.double(), h.double(), g.double(), *[w.double() for w in weights[0]],
                 lambda a, b: a @ b.mT)
        for way, o in outs.items():
            row[way]["rel_err"] = ((o.double() - ref).norm() / ref.norm()).item()
        rows.append(row)
        print(f"{name:42s} " + "  ".join(
            f"{w} {row[w]['us']:6.2f} us {row[w]['bytes_per_s'] / 1e12:5.2f} TB/s "
            f"err {row[w]['rel_err']:.1e}" for w in WAY_OPTIONS), flush=True)
        del weights
        torch.cuda.empty_cache()
    return rows


GEMV_SHAPES = [("q/k/v", 6144, HIDDEN), ("o", HIDDEN, HIDDEN), ("gate/up", 2 * INTER, HIDDEN),
               ("down", HIDDEN, INTER), ("lm head", 151936, HIDDEN)]
GEMV_CONFIGS = [(4, 512, 4, 3), (8, 512, 4, 3), (8, 256, 4, 4), (16, 256, 4, 3), (8, 1024, 8, 3),
                (16, 512, 8, 3), (4, 1024, 4, 2), (2, 1024, 4, 3), (8, 512, 8, 4), (16, 128, 4, 4),
                (32, 128, 4, 3), (4, 256, 2, 4), (1, 2048, 4, 3), (2, 2048, 4, 3), (1, 1024, 4, 3),
                (2, 1024, 4, 4), (2, 1024, 8, 3), (2, 1024, 2, 3), (1, 2048, 8, 3), (1, 2048, 4, 4),
                (1, 2048, 2, 3), (1, 2048, 4, 2), (2, 2048, 8, 3), (1, 4096, 4, 2), (1, 4096, 4, 3),
                (1, 4096, 8, 2), (1, 4096, 8, 3), (2, 4096, 8, 2)]


def gemv_config_rows() -> list[dict]:
    """The bare product (no neighbours): cuBLAS against triton_gemv's kernel in each config, the
    graph of 36 calls on 36 weight copies (one for the LM head)."""
    rows = []
    for name, n, k in GEMV_SHAPES:
        copies = 1 if n > 100000 else COPIES
        weights = [torch.randn(n, k, device="cuda", dtype=BF16) * 0.02 for _ in range(copies)]
        x = torch.randn(1, 1, k, device="cuda", dtype=BF16)
        y = torch.empty(1, 1, n, device="cuda", dtype=BF16)
        ref = (x.double() @ weights[0].double().mT)
        row = {"gemm": name, "n": n, "k": k, "weight_bytes": n * k * 2}

        def record(way, fn):
            out = fn(weights[0]).clone()  # before the timed calls overwrite a shared output
            us = per_call_us([lambda w=w: fn(w) for w in weights])
            row[way] = {"us": us, "bytes_per_s": n * k * 2 / (us * 1e-6),
                        "rel_err": ((out.double() - ref).norm() / ref.norm()).item()}
        record("cublas", lambda w: torch.matmul(x, w.mT))
        for config in GEMV_CONFIGS:
            if n % config[0] == 0 and k % config[1] == 0:
                record(f"triton {config}", lambda w, c=config: triton_gemv.launch(x, w, y, c) or y)
        best = min((w for w in row if w.startswith("triton")), key=lambda w: row[w]["us"])
        print(f"{name:8s} cublas {row['cublas']['us']:7.2f} us "
              f"({row['cublas']['bytes_per_s'] / 1e12:.2f} TB/s)  best {best} {row[best]['us']:7.2f} us "
              f"({row[best]['bytes_per_s'] / 1e12:.2f} TB/s, err {row[best]['rel_err']:.1e}); "
              f"default {row.get('triton ' + str(triton_gemv.CONFIG), {}).get('us', float('nan')):.2f}",
              flush=True)
        rows.append(row)
        weights = None  # noqa: F841 - frees this shape's copies before the next
        torch.cuda.empty_cache()
    return rows


def flex(q, k, v, lengths):
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
    block, capacity = 128, k.shape[2]
    n = capacity // block
    full = (lengths // block).reshape(1, 1, 1)
    ends = ((lengths % block) > 0).to(torch.int32).reshape(1, 1, 1)
    blocks = torch.arange(n, dtype=torch.int32, device=q.device).reshape(1, 1, 1, n)
    last = torch.clamp(blocks + full.reshape(1, 1, 1, 1), max=n - 1).to(torch.int32)
    mask = BlockMask.from_kv_blocks(ends, last.contiguous(), full.to(torch.int32),
                                    blocks.contiguous(), BLOCK_SIZE=(block, block),
                                    mask_mod=lambda b, h, qi, ki: ki < lengths[b],
                                    seq_lengths=(1, capacity))
    return flex_attention(q, k, v, block_mask=mask, scale=1.0, enable_gqa=True)


VARIANTS = [dict(splits=s, block_n=n, num_warps=w, num_stages=st)
            for s, n, w, st in ((16, 64, 4, 3), (32, 64, 4, 3), (8, 64, 4, 3), (16, 32, 4, 3),
                                (32, 128, 8, 3), (64, 64, 4, 2))]


def attention_rows() -> list[dict]:
    rows = []
    for capacity, contexts in ((4096, (128, 256, 1000, 4000)), (40960, (128, 4000, 32000))):
        caches = [(torch.randn(1, HKV, capacity, D, device="cuda", dtype=BF16),
                   torch.randn(1, HKV, capacity, D, device="cuda", dtype=BF16))
                  for _ in range(COPIES)]
        q = torch.randn(1, HQ, 1, D, device="cuda", dtype=BF16) * D ** -0.5
        flexc = torch.compile(flex, fullgraph=True, dynamic=False)
        for ctx in contexts:
            lengths = torch.tensor([ctx], dtype=torch.int32, device="cuda")
            k, v = caches[0]
            kk = k[:, :, :ctx].double().repeat_interleave(HQ // HKV, 1)
            vv = v[:, :, :ctx].double().repeat_interleave(HQ // HKV, 1)
            ref = torch.softmax(q.double() @ kk.mT, -1) @ vv
            nbytes = 2 * HKV * ctx * D * 2
            row = {"capacity": capacity, "context": ctx, "bytes": nbytes}

            def record(name, fn):
                out = fn(*caches[0])
                err = ((out.double() - ref).norm() / ref.norm()).item()
                us = per_call_us([lambda kv=kv: fn(*kv) for kv in caches])
                row[name] = {"us": us, "bytes_per_s": nbytes / (us * 1e-6), "rel_err": err}
            record("flex", lambda k, v: flexc(q, k, v, lengths))
            for var in VARIANTS:
                out = torch.empty_like(q)
                record("triton " + ",".join(f"{a}={b}" for a, b in var.items()),
                       lambda k, v, var=var, out=out: triton_attention.launch(
                           q, k, v, lengths, out, **var) or out)
            op = torch.compile(lambda k, v: triton_attention.decode_attention(q, k, v, lengths),
                               fullgraph=True, dynamic=False)
            record("triton op compiled", op)
            rows.append(row)
            best = min((n for n in row if n.startswith("triton")), key=lambda n: row[n]["us"])
            print(f"C={capacity:6d} ctx={ctx:6d}  flex {row['flex']['us']:7.2f} us  best {best} "
                  f"{row[best]['us']:7.2f} us ({row[best]['bytes_per_s'] / 1e12:.2f} TB/s, err "
                  f"{row[best]['rel_err']:.1e}); default {row['triton op compiled']['us']:.2f}",
                  flush=True)
        caches = None  # noqa: F841 - frees the caches before the next capacity
        torch.cuda.empty_cache()
    return rows


def main() -> int:
    torch._dynamo.config.recompile_limit = 64  # one compile per shape and way, same code object
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--parts", default="attention,gemv")
    args = ap.parse_args()
    from _gpu import require_cuda
    require_cuda(__file__)
    t0 = time.perf_counter()
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d"), "method": __doc__,
              "copy_bytes_per_s": copy_bandwidth("cuda")["bytes_per_s"]}
    print(f"copy bandwidth {result['copy_bytes_per_s'] / 1e12:.2f} TB/s", flush=True)
    for part in args.parts.split(","):
        result[part] = {"attention": attention_rows, "gemv": gemv_rows,
                        "gemv_configs": gemv_config_rows}[part]()
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    result["wall_s"] = time.perf_counter() - t0
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
