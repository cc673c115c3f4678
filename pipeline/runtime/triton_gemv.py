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

# (BLOCK_N, BLOCK_K, num_warps, num_stages): the fastest of 12 on the H200 at every Qwen3-8B
# decode shape (docs/data/gpu_decode_kernels_gemv_configs_2026-12-01.json)
CONFIG = (2, 1024, 4, 3)


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


def launch(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, config=None) -> None:
    """y [N] = w [N, K] @ x [K] (contiguous; N and K multiples of the config's blocks);
    `config` defaults to CONFIG as it is at the call (a bench may set it)."""
    block_n, block_k, num_warps, num_stages = config or CONFIG
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
    block_n, block_k = (config or CONFIG)[:2]
    return (x.shape[-2] == 1 and x.numel() == x.shape[-1] and w.dim() == 2 and w.is_contiguous()
            and w.dtype == x.dtype and w.shape[1] == x.shape[-1]
            and w.shape[0] % block_n == 0 and w.shape[1] % block_k == 0)
