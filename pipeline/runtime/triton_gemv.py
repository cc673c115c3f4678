"""One-row products by a load-time weight (decode's GEMMs), y = x @ W^T, as one Triton kernel.

cuBLAS runs the decode step's square and wide-K GEMMs (o: 4096 x 4096, down: 4096 x 12288) as a
split-K GEMM plus a reduce kernel and a copy; this kernel streams each weight row once with no
second pass: grid N / BLOCK_N programs, each accumulating a [BLOCK_N, BLOCK_K] FP32 tile over K
(weights loaded with evict-first, since nothing reads them again in the step) and summing it
once. Registered as the custom op `trtmc::gemv` through torch.library.triton_op.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# (BLOCK_N, BLOCK_K, num_warps, num_stages): of 28 on the H200, the fastest over a Qwen3-8B
# decode step's products (docs/data/gpu_decode_kernels_gemv_configs_2026-12-04.json): one row a
# program, a whole 4,096-wide stretch of it per load. A K it does not divide takes the widest
# BLOCK_K that does (`config_for`).
CONFIG = (1, 4096, 8, 2)


@triton.jit
def _gemv_kernel(x, w, y, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        xv = tl.load(x + cols).to(tl.float32)
        wv = tl.load(w + rows[:, None] * K + cols[None, :], eviction_policy="evict_first")
        acc += wv.to(tl.float32) * xv[None, :]
    tl.store(y + rows, tl.sum(acc, 1).to(y.dtype.element_ty))


def config_for(k: int, config=None) -> tuple | None:
    """`config` (default CONFIG, as it is at the call: a bench may set it) with BLOCK_K halved
    until it divides K, down to 256; None when none does."""
    block_n, block_k, num_warps, num_stages = config or CONFIG
    while k % block_k and block_k > 256:
        block_k //= 2
    return None if k % block_k else (block_n, block_k, num_warps, num_stages)


def launch(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, config=None) -> None:
    """y [N] = w [N, K] @ x [K] (contiguous; N a multiple of BLOCK_N, `config_for(K)` not
    None)."""
    chosen = config_for(w.shape[1], config)
    if chosen is None:
        raise ValueError(f"no GEMV configuration for K = {w.shape[1]} (config_for)")
    block_n, block_k, num_warps, num_stages = chosen
    torch.library.wrap_triton(_gemv_kernel)[(w.shape[0] // block_n,)](
        x, w, y, K=w.shape[1], BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps,
        num_stages=num_stages)


@torch.library.triton_op("trtmc::gemv", mutates_args=())
def gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., 1, K] @ w[N, K]^T -> [..., 1, N] in x's dtype, FP32 accumulation."""
    y = torch.empty((*x.shape[:-1], w.shape[0]), dtype=x.dtype, device=x.device)
    launch(x.contiguous(), w, y)
    return y


def supports(x: torch.Tensor, w: torch.Tensor, config=None) -> bool:
    """One row, a contiguous weight of the row's dtype, sizes the blocks divide."""
    return (x.shape[-2] == 1 and x.numel() == x.shape[-1] and w.dim() == 2 and w.is_contiguous()
            and w.dtype == x.dtype and w.shape[1] == x.shape[-1]
            and w.shape[0] % (config or CONFIG)[0] == 0
            and config_for(w.shape[1], config) is not None)
