"""One-row products by a load-time weight (decode's GEMMs), y = x @ W^T, as one Triton kernel.

cuBLAS runs the decode step's square and wide-K GEMMs (o: 4096 x 4096, down: 4096 x 12288) as a
split-K GEMM plus a reduce kernel and a copy; this kernel streams each weight row once with no
second pass: grid N / BLOCK_N programs, each accumulating a [BLOCK_N, BLOCK_K] FP32 tile over K
(weights loaded with evict-first, since nothing reads them again in the step) and summing it
once. Registered as the custom op `trtmc::gemv` through torch.library.triton_op.

A decode step's small row kernels cost more in launches than in bytes, so the kernel can also
take in the row operation before the product and the residual add after it
(`passes.fuse_into_products`): the RMS normalization of x (every program normalizes the whole
row, which it reads anyway), the gated SiLU of two halves, and `+ residual` on each output.
Each computes its rule with the row kernels' roundings (triton_rows.py).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

# (BLOCK_N, BLOCK_K, num_warps, num_stages): of 28 on the H200, the fastest over a Qwen3-8B
# decode step's products (docs/data/gpu_decode_kernels_gemv_configs_2026-12-04.json): one row a
# program, a whole 4,096-wide stretch of it per load. A K it does not divide takes the widest
# BLOCK_K that does (`config_for`).
CONFIG = (1, 4096, 8, 2)
# what the kernel does to x before the product (the kernel's PROLOGUE)
PROLOGUES = {"PLAIN": 0, "RMS_NORM": 1, "SILU_GATE": 2}
# the row operations and residual adds are taken into the products (a bench may turn it off)
FUSE = True


@triton.jit
def _gemv_kernel(x, aux, w, residual, y, eps, K: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, PROLOGUE: tl.constexpr, ADD: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    dtype = x.dtype.element_ty
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):  # one block of K for RMS_NORM (`supports`)
        cols = k0 + tl.arange(0, BLOCK_K)
        wv = tl.load(w + rows[:, None] * K + cols[None, :], eviction_policy="evict_first")
        if PROLOGUE == 1:  # RMS_NORM; aux: the normalization's weight
            xf = tl.load(x + cols).to(tl.float32)
            # eps is FP64 when Inductor launches the kernel: the statistics stay FP32
            rstd = tl.div_rn(1.0, tl.sqrt_rn(tl.sum(xf * xf, 0) * (1.0 / K) + tl.cast(eps, tl.float32)))
            normed = (xf * rstd).to(dtype).to(tl.float32)
            xv = (tl.load(aux + cols).to(tl.float32) * normed).to(dtype)
        elif PROLOGUE == 2:  # SILU_GATE; x: the gate, aux: the up projection
            gv = tl.load(x + cols)
            gf = gv.to(tl.float32)
            sig = (1.0 / (1.0 + tl.exp(-gf))).to(dtype).to(tl.float32)
            gated = (gf * sig).to(dtype).to(tl.float32)
            xv = (gated * tl.load(aux + cols).to(tl.float32)).to(dtype)
        else:
            xv = tl.load(x + cols)
        acc += wv.to(tl.float32) * xv.to(tl.float32)[None, :]
    out = tl.sum(acc, 1).to(y.dtype.element_ty)
    if ADD:
        out = (out.to(tl.float32) + tl.load(residual + rows).to(tl.float32)).to(y.dtype.element_ty)
    tl.store(y + rows, out)


def config_for(k: int, config=None) -> tuple | None:
    """`config` (default CONFIG, as it is at the call: a bench may set it) with BLOCK_K halved
    until it divides K, down to 256; None when none does."""
    block_n, block_k, num_warps, num_stages = config or CONFIG
    while k % block_k and block_k > 256:
        block_k //= 2
    return None if k % block_k else (block_n, block_k, num_warps, num_stages)


def launch(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, config=None, *,
           aux: torch.Tensor | None = None, residual: torch.Tensor | None = None,
           prologue: str = "PLAIN", eps: float = 0.0) -> None:
    """y [N] = w [N, K] @ f(x [K]) (+ residual [N]): contiguous, N a multiple of BLOCK_N,
    `config_for(K)` not None, one block of K for RMS_NORM."""
    block_n, block_k, num_warps, num_stages = config_for(w.shape[1], config)
    torch.library.wrap_triton(_gemv_kernel)[(w.shape[0] // block_n,)](
        x, x if aux is None else aux, w, x if residual is None else residual, y, eps,
        K=w.shape[1], BLOCK_N=block_n, BLOCK_K=block_k, PROLOGUE=PROLOGUES[prologue],
        ADD=residual is not None, num_warps=num_warps, num_stages=num_stages)


@torch.library.triton_op("trtmc::gemv", mutates_args=())
def gemv(x: torch.Tensor, w: torch.Tensor, aux: Optional[torch.Tensor] = None,
         residual: Optional[torch.Tensor] = None, prologue: str = "PLAIN",
         eps: float = 0.0) -> torch.Tensor:
    """f(x) [..., 1, K] @ w[N, K]^T (+ residual [..., 1, N]) -> [..., 1, N] in x's dtype, FP32
    accumulation; f is `prologue` (with `aux` and `eps`)."""
    y = torch.empty((*x.shape[:-1], w.shape[0]), dtype=x.dtype, device=x.device)
    launch(x.contiguous(), w, y, aux=aux, residual=residual, prologue=prologue, eps=eps)
    return y


def _fits(x: torch.Tensor, w: torch.Tensor, config=None) -> bool:
    """One row, a contiguous weight, sizes the blocks divide."""
    return (x.shape[-2] == 1 and x.numel() == x.shape[-1] and w.dim() == 2 and w.is_contiguous()
            and w.shape[1] == x.shape[-1] and w.shape[0] % (config or CONFIG)[0] == 0
            and config_for(w.shape[1], config) is not None)


def supports(x: torch.Tensor, w: torch.Tensor, config=None) -> bool:
    """`_fits`, the weight of the row's dtype."""
    return w.dtype == x.dtype and _fits(x, w, config)


def _row_like(t: torch.Tensor | None, like: torch.Tensor, n: int) -> bool:
    """`t` is one contiguous row of `n` elements of `like`'s dtype."""
    return (t is not None and t.dtype == like.dtype and t.numel() == t.shape[-1] == n
            and t.is_contiguous())


def supports_fused(x: torch.Tensor, w: torch.Tensor, aux: torch.Tensor | None,
                   residual: torch.Tensor | None, prologue: str) -> bool:
    """`_fits` (the weight of any dtype: the product is in FP32, the prologue in x's dtype and the
    output too), and operands the prologue and the add can read in place: the normalization's
    weight, or the up projection, a row of x's size and dtype; the residual a row of the
    output's; the normalized row one block of K."""
    return (FUSE and _fits(x, w) and x.is_contiguous()
            and (prologue == "PLAIN" or _row_like(aux, x, x.shape[-1]))
            and (prologue != "RMS_NORM" or config_for(w.shape[1])[1] == w.shape[1])
            and (residual is None or _row_like(residual, x, w.shape[0])))
