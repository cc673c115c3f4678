"""A prompt's row-wise chains as one Triton kernel each: RMS normalization, the gated SiLU and
the rotary embedding (with the query's scale after it).

An uncompiled prefill runs a layer's normalization as the network spells it (a cast to FP32, a
square, a mean, a sum, a square root, a reciprocal, a product, a cast back, a product by the
weight): nine kernels, most of them reading and writing FP32 copies of the whole activation,
and on the H200 the largest share of a 4,000-token Qwen3-8B prefill after the GEMMs. An
optimizing engine (TensorRT) fuses such chains; the lowering pass `fuse_row_chains`
(pipeline/runtime/passes.py) hands each matched chain to one kernel here. Each kernel computes
its chain's rule with the same roundings: FP32 statistics, the normalized row rounded to the
output dtype before the weight's product; the SiLU's sigmoid and both products each rounded to
the 16-bit dtype, as the element-wise layers do; the rotation in FP32, rounded, then scaled in
FP32 and rounded again. Only the order of FP32 sums (and a fused multiply-add) differs.

A residual add and the normalization that reads it are one kernel too (`add_rms_norm`, the
custom op `trtmc::add_rms_norm`): in a decode step Inductor made them one kernel that read the
4,096-wide row twice. A decode step's (and a prompt's) query and key normalizations, their
rotary embeddings and the key and value cache writes are one more, `norm_rotary_cache` (the
custom op `trtmc::norm_rotary_cache`): Inductor left them four kernels of about a microsecond
each in every layer. Both are custom ops so that a compiled step calls them too
(`fuse_traced_chains`, passes.py).

A row tensor is read through `rows(t)`: its rows (all dims but the last, which is contiguous)
at offsets (r // inner) * outer_stride + (r % inner) * inner_stride, so the query heads sliced
from a merged GEMM's output are read where they lie, without a copy.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_COLUMNS = 16384   # a normalized row is one tile
TILE = 4096           # elements a normalization program covers (several short rows at once)
SILU_BLOCK = 1024     # columns per gated-SiLU program
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _rms_norm_kernel(x, w, y, eps, n_rows, inner, sx_outer, sx_inner,
                     D: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    d = tl.arange(0, BLOCK_D)
    live = (r < n_rows)[:, None] & (d < D)[None, :]
    src = (r // inner) * sx_outer + (r % inner) * sx_inner
    xv = tl.load(x + src[:, None] + d[None, :], mask=live, other=0.0).to(tl.float32)
    mean = tl.sum(xv * xv, 1) * (1.0 / D)
    rstd = tl.div_rn(1.0, tl.sqrt_rn(mean + eps))
    normed = (xv * rstd[:, None]).to(y.dtype.element_ty)
    wv = tl.load(w + d, mask=d < D, other=0.0).to(tl.float32)
    tl.store(y + r[:, None] * D + d[None, :], (wv[None, :] * normed.to(tl.float32))
             .to(y.dtype.element_ty), mask=live)


@triton.jit
def _silu_gate_kernel(g, u, y, n_cols, inner, sg_outer, sg_inner, su_outer, su_inner,
                      BLOCK: tl.constexpr):
    r = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = c < n_cols
    gv = tl.load(g + (r // inner) * sg_outer + (r % inner) * sg_inner + c, mask=live, other=0.0)
    uv = tl.load(u + (r // inner) * su_outer + (r % inner) * su_inner + c, mask=live, other=0.0)
    gf = gv.to(tl.float32)
    sig = (1.0 / (1.0 + tl.exp(-gf))).to(gv.dtype)
    gated = (gf * sig.to(tl.float32)).to(gv.dtype)
    tl.store(y + r * n_cols + c, (gated.to(tl.float32) * uv.to(tl.float32)).to(y.dtype.element_ty),
             mask=live)


@triton.jit
def _rotary_kernel(x, cos, sin, pos, y, scale, S, N, P, sx_b, sx_n, sx_s, sp_b, sp_s,
                   HALF: tl.constexpr, BLOCK_N: tl.constexpr, SCALED: tl.constexpr):
    b, s = tl.program_id(0) // S, tl.program_id(0) % S
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    h = tl.arange(0, HALF)
    p = tl.load(pos + b * sp_b + s * sp_s).to(tl.int64)
    in_table = (p >= 0) & (p < P)  # a position past the tables reads row 0, then zeros
    row = tl.where(in_table, p, 0) * HALF + h
    c = tl.where(in_table, tl.load(cos + row).to(tl.float32), 0.0)[None, :]
    sn = tl.where(in_table, tl.load(sin + row).to(tl.float32), 0.0)[None, :]
    live = (n < N)[:, None]
    src = x + b * sx_b + n[:, None] * sx_n + s * sx_s + h[None, :]
    x1 = tl.load(src, mask=live, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=live, other=0.0).to(tl.float32)
    first = (x1 * c - x2 * sn).to(y.dtype.element_ty)
    second = (x2 * c + x1 * sn).to(y.dtype.element_ty)
    if SCALED:
        first = (first.to(tl.float32) * scale).to(y.dtype.element_ty)
        second = (second.to(tl.float32) * scale).to(y.dtype.element_ty)
    dst = y + ((b * N + n[:, None]) * S + s) * (2 * HALF) + h[None, :]
    tl.store(dst, first, mask=live)
    tl.store(dst + HALF, second, mask=live)


@triton.jit
def _add_rms_norm_kernel(a, b, w, s, y, D: tl.constexpr, BLOCK_D: tl.constexpr,
                         EPS: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * D
    d = tl.arange(0, BLOCK_D)
    live = d < D
    dtype = s.dtype.element_ty
    sv = (tl.load(a + r + d, mask=live, other=0.0).to(tl.float32)
          + tl.load(b + r + d, mask=live, other=0.0).to(tl.float32)).to(dtype)
    tl.store(s + r + d, sv, mask=live)
    xf = sv.to(tl.float32)
    rstd = tl.div_rn(1.0, tl.sqrt_rn(tl.sum(xf * xf, 0) * (1.0 / D) + EPS))
    wv = tl.load(w + d, mask=live, other=0.0).to(tl.float32)
    tl.store(y + r + d, (wv * (xf * rstd).to(dtype).to(tl.float32)).to(dtype), mask=live)


@triton.jit
def _normed_rotated(x, w, c, sn, h, EPS: tl.constexpr, HALF: tl.constexpr):
    """One head's row at x: RMS-normalized by `w` (the normalization kernel's roundings), then
    rotated by c, sn (FP32 [HALF]); the two halves in w's dtype."""
    x1 = tl.load(x + h).to(tl.float32)
    x2 = tl.load(x + HALF + h).to(tl.float32)
    mean = (tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) * (1.0 / (2 * HALF))
    rstd = tl.div_rn(1.0, tl.sqrt_rn(mean + EPS))
    dtype = w.dtype.element_ty
    y1 = (tl.load(w + h).to(tl.float32) * (x1 * rstd).to(dtype).to(tl.float32)).to(dtype)
    y2 = (tl.load(w + HALF + h).to(tl.float32) * (x2 * rstd).to(dtype).to(tl.float32)).to(dtype)
    y1, y2 = y1.to(tl.float32), y2.to(tl.float32)
    return (y1 * c - y2 * sn).to(dtype), (y2 * c + y1 * sn).to(dtype)


@triton.jit
def _norm_rotary_cache_kernel(q, k, v, wq, wk, cos, sin, pos, start, q_out, k_cache, v_cache,
                              P, C, sq_n, sq_s, sk_n, sk_s, sv_n, sv_s, sp_s, skc_n, skc_c,
                              svc_n, svc_c, HQ: tl.constexpr, HALF: tl.constexpr,
                              EPS_Q: tl.constexpr, EPS_K: tl.constexpr, SCALE: tl.constexpr):
    s, n = tl.program_id(0), tl.program_id(1)
    h = tl.arange(0, HALF)
    p = tl.load(pos + s * sp_s).to(tl.int64)
    in_table = (p >= 0) & (p < P)  # a position past the tables rotates by zeros
    row = tl.where(in_table, p, 0) * HALF + h
    c = tl.where(in_table, tl.load(cos + row).to(tl.float32), 0.0)
    sn = tl.where(in_table, tl.load(sin + row).to(tl.float32), 0.0)
    if n < HQ:  # a query head: normalized, rotated, scaled, into q_out [1, HQ, S, 2 HALF]
        first, second = _normed_rotated(q + n * sq_n + s * sq_s, wq, c, sn, h, EPS_Q, HALF)
        if SCALE != 1.0:
            first = (first.to(tl.float32) * SCALE).to(first.dtype)
            second = (second.to(tl.float32) * SCALE).to(second.dtype)
        dst = q_out + (n * tl.num_programs(0) + s) * (2 * HALF)
        tl.store(dst + h, first)
        tl.store(dst + HALF + h, second)
    else:  # a key/value head: the key normalized and rotated, both written at start + s
        n = n - HQ
        slot = tl.load(start).to(tl.int64) + s
        slots = slot + 0 * h  # the mask as a vector
        live = (slots >= 0) & (slots < C)
        first, second = _normed_rotated(k + n * sk_n + s * sk_s, wk, c, sn, h, EPS_K, HALF)
        dst = k_cache + n * skc_n + slot * skc_c
        tl.store(dst + h, first, mask=live)
        tl.store(dst + HALF + h, second, mask=live)
        src, dst = v + n * sv_n + s * sv_s, v_cache + n * svc_n + slot * svc_c
        tl.store(dst + h, tl.load(src + h), mask=live)
        tl.store(dst + HALF + h, tl.load(src + HALF + h), mask=live)


def _addressable(*ts: torch.Tensor) -> bool:
    """Every element's offset from the first (the pointer a kernel is given) fits the kernels'
    32-bit index arithmetic. Shapes and strides only, so a traced step can ask."""
    return all(sum((d - 1) * st for d, st in zip(t.shape, t.stride())) < 2 ** 31
               and t.numel() < 2 ** 31 for t in ts)


def rows(t: torch.Tensor) -> tuple[int, int, int, int] | None:
    """(n_rows, inner, outer_stride, inner_stride) addressing t's rows in place, or None when
    its last dim is not contiguous or its leading dims do not fold into two strides."""
    if t.dim() < 2 or t.stride(-1) != 1 and t.shape[-1] > 1:
        return None
    n_rows = t.numel() // max(t.shape[-1], 1)
    if t.dim() == 2:
        return n_rows, 1, t.stride(0), 0
    try:
        folded = t.view(-1, t.shape[-2], t.shape[-1])
    except RuntimeError:
        return None
    return n_rows, t.shape[-2], folded.stride(0), folded.stride(1)


def supports_rms_norm(x: torch.Tensor, weight: torch.Tensor, out: torch.dtype) -> bool:
    return (x.dtype in DTYPES and out in DTYPES and weight.dtype in DTYPES
            and 0 < x.shape[-1] <= MAX_COLUMNS and weight.numel() == x.shape[-1]
            and x.numel() > 0 and rows(x) is not None and _addressable(x))


def _rows(t: torch.Tensor) -> tuple[int, int, int, int]:
    """`rows` of a tensor its `supports_*` check accepted."""
    found = rows(t)
    assert found is not None, "called past its supports_* check"
    return found


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.dtype) -> torch.Tensor:
    """weight * (x / sqrt(mean(x^2) + eps)) over x's last dim, as `supports_rms_norm` allows."""
    n_rows, inner, s_outer, s_inner = _rows(x)
    d = x.shape[-1]
    block_d = triton.next_power_of_2(d)
    per = max(1, TILE // block_d)
    y = torch.empty(x.shape, dtype=out, device=x.device)
    _rms_norm_kernel[(triton.cdiv(n_rows, per),)](
        x, weight, y, eps, n_rows, inner, s_outer, s_inner, D=d, BLOCK_D=block_d, ROWS=per,
        num_warps=8 if block_d >= 2048 else 4)
    return y


def supports_silu_gate(gate: torch.Tensor, up: torch.Tensor) -> bool:
    return (gate.dtype in DTYPES and up.dtype == gate.dtype and gate.shape == up.shape
            and gate.numel() > 0 and rows(gate) is not None and rows(up) is not None
            and _addressable(gate, up))


def silu_gate(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """(gate * sigmoid(gate)) * up, as `supports_silu_gate` allows."""
    n_rows, inner, sg_outer, sg_inner = _rows(gate)
    _, _, su_outer, su_inner = _rows(up)
    n = gate.shape[-1]
    y = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    _silu_gate_kernel[(n_rows, triton.cdiv(n, SILU_BLOCK))](
        gate, up, y, n, inner, sg_outer, sg_inner, su_outer, su_inner, BLOCK=SILU_BLOCK,
        num_warps=4)
    return y


def supports_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    positions: torch.Tensor) -> bool:
    """x [B, N, S, D] with D even and contiguous, rotated whole by [P, D/2] tables, positions
    [B, S]."""
    half = x.shape[-1] // 2 if x.dim() == 4 else 0
    return (x.dtype in DTYPES and half > 0 and x.shape[-1] == 2 * half and x.stride(-1) == 1
            and half == triton.next_power_of_2(half) and cos.dim() == 2 and cos.shape[1] == half
            and cos.is_contiguous() and sin.is_contiguous() and sin.shape == cos.shape
            and cos.dtype == sin.dtype and positions.shape == (x.shape[0], x.shape[2])
            and not positions.is_floating_point() and x.numel() > 0 and _addressable(x))


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
           scale: float | None, out: torch.dtype) -> torch.Tensor:
    """(x1 c - x2 s, x2 c + x1 s) by position, times `scale` after rounding when given; a
    contiguous [B, N, S, D] of dtype `out`, as `supports_rotary` allows."""
    b, n, s, d = x.shape
    block_n = min(triton.next_power_of_2(n), max(1, TILE // d))
    y = torch.empty((b, n, s, d), dtype=out, device=x.device)
    _rotary_kernel[(b * s, triton.cdiv(n, block_n))](
        x, cos, sin, positions, y, 1.0 if scale is None else scale, s, n, cos.shape[0],
        x.stride(0), x.stride(1), x.stride(2), positions.stride(0), positions.stride(1),
        HALF=d // 2, BLOCK_N=block_n, SCALED=scale is not None, num_warps=4)
    return y


def supports_norm_rotary_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor,
                               sin: torch.Tensor, positions: torch.Tensor, start: torch.Tensor,
                               k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Batch 1: q [1, Hq, S, D], k and v [1, Hkv, S, D] (last dims contiguous), weights [D],
    tables [P, D/2], positions [1, S], start [1], caches [1, Hkv, C, D]; one dtype throughout
    but the integers."""
    d = q.shape[-1]
    half = d // 2
    return (q.dim() == k.dim() == v.dim() == k_cache.dim() == v_cache.dim() == 4
            and q.dtype in DTYPES and half > 0 and d == 2 * half
            and half == triton.next_power_of_2(half)
            and all(t.dtype == q.dtype for t in (k, v, q_weight, k_weight, k_cache, v_cache))
            and q.shape[0] == 1 and k.shape == v.shape and k.shape[0] == 1
            and k.shape[2] == q.shape[2] and k.shape[3] == d
            and k_cache.shape == v_cache.shape and k_cache.shape[:2] == k.shape[:2]
            and k_cache.shape[3] == d and q_weight.numel() == k_weight.numel() == d
            and q_weight.is_contiguous() and k_weight.is_contiguous()
            and all(t.stride(-1) == 1 for t in (q, k, v, k_cache, v_cache))
            and cos.dim() == 2 and cos.shape[1] == half and cos.is_contiguous()
            and sin.is_contiguous() and sin.shape == cos.shape and cos.dtype == sin.dtype
            and positions.shape == (1, q.shape[2]) and not positions.is_floating_point()
            and start.numel() == 1 and not start.is_floating_point()
            and q.numel() > 0 and _addressable(q, k, v, k_cache, v_cache))


@torch.library.triton_op("trtmc::norm_rotary_cache", mutates_args={"k_cache", "v_cache"})
def norm_rotary_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor,
                      k_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      positions: torch.Tensor, start: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, q_eps: float, k_eps: float,
                      scale: float) -> torch.Tensor:
    """The query rows RMS-normalized by q_weight, rotated by position and scaled (a contiguous
    [1, Hq, S, D]); the key rows normalized by k_weight and rotated, written into k_cache, and
    the value rows into v_cache, at sequence positions start .. start + S - 1 (positions past
    the capacity are not written), as `supports_norm_rotary_cache` allows."""
    _, hq, s, d = q.shape
    out = torch.empty((1, hq, s, d), dtype=q.dtype, device=q.device)
    torch.library.wrap_triton(_norm_rotary_cache_kernel)[(s, hq + k.shape[1])](
        q, k, v, q_weight, k_weight, cos, sin, positions, start, out, k_cache, v_cache,
        cos.shape[0], k_cache.shape[2], q.stride(1), q.stride(2), k.stride(1), k.stride(2),
        v.stride(1), v.stride(2), positions.stride(1), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(1), v_cache.stride(2), HQ=hq, HALF=d // 2, EPS_Q=q_eps, EPS_K=k_eps,
        SCALE=scale, num_warps=1)
    return out


def supports_add_rms_norm(a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor) -> bool:
    """a and b contiguous, of one shape and dtype, rows of up to MAX_COLUMNS; weight [D] of it."""
    return (a.dtype in DTYPES and b.dtype == a.dtype == weight.dtype and a.shape == b.shape
            and a.dim() >= 1 and 0 < a.shape[-1] <= MAX_COLUMNS
            and weight.numel() == a.shape[-1] and weight.is_contiguous()
            and a.is_contiguous() and b.is_contiguous() and a.numel() > 0
            and _addressable(a))


@torch.library.triton_op("trtmc::add_rms_norm", mutates_args=())
def add_rms_norm(a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, y): s = a + b rounded to their dtype, y = weight * (s / sqrt(mean(s^2) + eps)) over
    the last dim (the normalization kernel's roundings), as `supports_add_rms_norm` allows."""
    d = a.shape[-1]
    block_d = triton.next_power_of_2(d)
    total, y = torch.empty_like(a), torch.empty_like(a)
    torch.library.wrap_triton(_add_rms_norm_kernel)[(a.numel() // d,)](
        a, b, weight, total, y, D=d, BLOCK_D=block_d, EPS=eps,
        num_warps=8 if block_d >= 2048 else 4)
    return total, y
