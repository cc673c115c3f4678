"""One-row products by a load-time weight (decode's GEMMs), y = x @ W^T, as one Triton kernel.

cuBLAS runs the decode step's square and wide-K GEMMs (o: 4096 x 4096, down: 4096 x 12288) as a
split-K GEMM plus a reduce kernel and a copy; this kernel streams each weight row once with no
second pass: grid N / BLOCK_N programs, each accumulating a [BLOCK_N, BLOCK_K] FP32 tile over K
(weights loaded with evict-first, since nothing reads them again in the step) and summing it
once. Registered as the custom op `trtmc::gemv` through torch.library.triton_op.

A decode step's small row kernels cost more in launches than in bytes, so the kernel can also
take in the row operation before the product and the residual add after it
(`passes.fuse_into_products`): the RMS normalization of x, the gated SiLU of two halves, and
`+ residual` on each output. Every program reads all of x anyway; it sums x's squares as it
goes and scales its dot product by 1 / rms(x) at the end, so nothing waits for the statistics.
All in FP32, rounded once: the network's own roundings of the normalized row and of the SiLU's
steps are not reproduced (the unfused steps keep them), so tokens can part from them at a near
tie, as Inductor's can.
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
# the same for a product with a prologue, which each program computes over the whole of x: more
# rows a program repeat it less often (bench/gpu_decode_kernels.py --parts fused_configs)
FUSED_CONFIG = {"RMS_NORM": (2, 4096, 8, 2), "SILU_GATE": (4, 1024, 4, 3)}
# what the kernel does to x before the product (the kernel's PROLOGUE)
PROLOGUES = {"PLAIN": 0, "RMS_NORM": 1, "SILU_GATE": 2}
# the row operations and residual adds are taken into the products (a bench may turn it off)
FUSE = True


@triton.jit
def _gemv_kernel(x, aux, w, residual, y, eps, K: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, PROLOGUE: tl.constexpr, ADD: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    squares = tl.zeros([BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        wv = tl.load(w + rows[:, None] * K + cols[None, :], eviction_policy="evict_first")
        xf = tl.load(x + cols).to(tl.float32)
        if PROLOGUE == 1:  # RMS_NORM, aux its weight: W (aux * x), scaled by 1 / rms(x) after
            squares += xf * xf
            xf = xf * tl.load(aux + cols).to(tl.float32)
        elif PROLOGUE == 2:  # SILU_GATE, x the gate, aux the up projection
            xf = xf / (1.0 + tl.exp(-xf)) * tl.load(aux + cols).to(tl.float32)
        acc += wv.to(tl.float32) * xf[None, :]
    out = tl.sum(acc, 1)
    if PROLOGUE == 1:  # eps is FP64 when Inductor launches the kernel: the statistics stay FP32
        out = out * tl.div_rn(1.0, tl.sqrt_rn(tl.sum(squares, 0) * (1.0 / K)
                                              + tl.cast(eps, tl.float32)))
    if ADD:
        out = out.to(y.dtype.element_ty).to(tl.float32) + tl.load(residual + rows).to(tl.float32)
    tl.store(y + rows, out.to(y.dtype.element_ty))


def config_for(k: int, config=None, prologue: str = "PLAIN") -> tuple | None:
    """`config` (default: the prologue's FUSED_CONFIG, else CONFIG, as they are at the call: a
    bench may set them) with BLOCK_K halved until it divides K, down to 256; None when none
    does."""
    block_n, block_k, num_warps, num_stages = config or FUSED_CONFIG.get(prologue, CONFIG)
    while k % block_k and block_k > 256:
        block_k //= 2
    return None if k % block_k else (block_n, block_k, num_warps, num_stages)


def launch(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, config=None, *,
           aux: torch.Tensor | None = None, residual: torch.Tensor | None = None,
           prologue: str = "PLAIN", eps: float = 0.0) -> None:
    """y [N] = w [N, K] @ f(x [K]) (+ residual [N]): contiguous, N a multiple of BLOCK_N,
    `config_for(K)` not None."""
    block_n, block_k, num_warps, num_stages = config_for(w.shape[1], config, prologue)
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


def _fits(x: torch.Tensor, w: torch.Tensor, config=None, prologue: str = "PLAIN") -> bool:
    """One row, a contiguous weight, sizes the blocks divide."""
    blocks = config_for(w.shape[1], config, prologue)
    return (x.shape[-2] == 1 and x.numel() == x.shape[-1] and w.dim() == 2 and w.is_contiguous()
            and w.shape[1] == x.shape[-1] and blocks is not None and w.shape[0] % blocks[0] == 0)


def supports(x: torch.Tensor, w: torch.Tensor, config=None) -> bool:
    """`_fits`, the weight of the row's dtype."""
    return w.dtype == x.dtype and _fits(x, w, config)


def _row_like(t: torch.Tensor | None, like: torch.Tensor, n: int) -> bool:
    """`t` is one contiguous row of `n` elements of `like`'s dtype."""
    return (t is not None and t.dtype == like.dtype and t.numel() == t.shape[-1] == n
            and t.is_contiguous())


def supports_fused(x: torch.Tensor, w: torch.Tensor, aux: torch.Tensor | None,
                   residual: torch.Tensor | None, prologue: str) -> bool:
    """`_fits` (the weight of any dtype: all is computed in FP32, the output in x's dtype), and
    operands the prologue and the add can read in place: the normalization's weight, or the up
    projection, a row of x's size and dtype; the residual a row of the output's."""
    return (FUSE and _fits(x, w, None, prologue) and x.is_contiguous()
            and (prologue == "PLAIN" or _row_like(aux, x, x.shape[-1]))
            and (residual is None or _row_like(residual, x, w.shape[0])))
