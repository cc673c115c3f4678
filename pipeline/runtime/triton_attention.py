"""Decode attention over the active length of a fixed-capacity cache, as two Triton kernels.

What the optimized mode runs for one query against a KV cache (the rule of decoder_ops'
ATTENTION_INPUT with key/value lengths, no mask, no causal mask): the length is read on the device,
so a step reads only the keys in use and the call is CUDA-graph safe (no host sync, no allocation
that depends on the length).

* split pass, grid (KV heads, SPLITS, batch): each program serves all G query heads of its KV head
  from one read of its keys (grouped-query attention): S = Q K^T on the tensor cores with the G
  heads as rows, online softmax in FP32, P rounded to the value dtype for P @ V (FlashAttention's
  and flex attention's rule; the eager rule keeps P in FP32). The keys are cut into SPLITS chunks
  of ceil(len / SPLITS) rounded up to BLOCK_N; programs whose chunk starts past the length store an
  empty partial and stop.
* merge pass, grid (query heads, batch): the partials combined by their maxima and sums.

The kernels are registered as the custom op `trtmc::decode_attention` through
torch.library.triton_op, so Inductor calls them inside a compiled step without a graph break.

A prompt (more than one query) takes one more kernel, `prompt_attention`, FlashAttention's
forward pass: grid (query blocks, query heads, batch), each program walks the key blocks its
queries may use (only up to its last query under the causal mask, only up to the length),
scores on the tensor cores, online softmax in FP32 (base 2), P rounded to the value dtype for
P @ V as in decode. Key blocks wholly below the length and the tile's first query skip the masks;
under the causal mask the longest programs start first. The length is read on the device, so
nothing syncs with the host.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N = 64          # keys per inner step
SPLITS = 16           # chunks of the key range: Hkv x SPLITS programs (128 for 8 KV heads)
MIN_ROWS = 16         # the tensor cores' smallest M: G query heads padded to this
PROMPT_BLOCK_M = 128  # queries per prompt program
PROMPT_BLOCK_N = 64   # keys per prompt inner step
LOG2E = tl.constexpr(1.4426950408889634)  # softmax in base 2: exp(x) = exp2(x * log2(e))


@triton.jit
def _split_kernel(q, k, v, lengths, part_acc, part_ml,
                  sq_b, sq_h, sk_b, sk_h, sk_c, sv_b, sv_h, sv_c,
                  G: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr,
                  BLOCK_N: tl.constexpr, SPLITS: tl.constexpr):
    kv_head, split, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    length = tl.load(lengths + b)
    chunk = tl.cdiv(tl.cdiv(length, SPLITS), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, length)
    rows, d = tl.arange(0, ROWS), tl.arange(0, D)
    heads = kv_head * G + rows
    q_tile = tl.load(q + b * sq_b + heads[:, None] * sq_h + d[None, :],
                     mask=rows[:, None] < G, other=0.0)
    m = tl.full([ROWS], float("-inf"), tl.float32)
    l = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, D], tl.float32)
    k_base, v_base = k + b * sk_b + kv_head * sk_h, v + b * sv_b + kv_head * sv_h
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        valid = n < end
        keys = tl.load(k_base + n[:, None] * sk_c + d[None, :], mask=valid[:, None], other=0.0)
        scores = tl.dot(q_tile, tl.trans(keys))
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        values = tl.load(v_base + n[:, None] * sv_c + d[None, :], mask=valid[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(values.dtype), values)
        m = m_new
    row = (b * tl.num_programs(0) * G + heads) * SPLITS + split
    keep = rows < G
    tl.store(part_acc + row[:, None] * D + d[None, :], acc, mask=keep[:, None])
    tl.store(part_ml + row * 2, m, mask=keep)
    tl.store(part_ml + row * 2 + 1, l, mask=keep)


@triton.jit
def _merge_kernel(part_acc, part_ml, out, so_b, so_h, HQ: tl.constexpr, D: tl.constexpr,
                  SPLITS: tl.constexpr):
    head, b = tl.program_id(0), tl.program_id(1)
    s, d = tl.arange(0, SPLITS), tl.arange(0, D)
    row = (b * HQ + head) * SPLITS + s
    m = tl.load(part_ml + row * 2)
    l = tl.load(part_ml + row * 2 + 1)
    top = tl.max(m, 0)
    w = tl.where(m > float("-inf"), tl.exp(m - top), 0.0)
    acc = tl.load(part_acc + row[:, None] * D + d[None, :])
    o = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)
    tl.store(out + b * so_b + head * so_h + d, o.to(out.dtype.element_ty))


def launch(q, k, v, lengths, out, *, splits: int = SPLITS, block_n: int = BLOCK_N,
           num_warps: int = 4, num_stages: int = 3) -> None:
    """Both passes into `out` [B, Hq, 1, D] (the tuning knobs are the bench's to vary)."""
    b, hq, _, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    part_acc = torch.empty((b * hq * splits, d), dtype=torch.float32, device=q.device)
    part_ml = torch.empty((b * hq * splits, 2), dtype=torch.float32, device=q.device)
    torch.library.wrap_triton(_split_kernel)[(hkv, splits, b)](
        q, k, v, lengths, part_acc, part_ml, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        k.stride(2), v.stride(0), v.stride(1), v.stride(2), G=g,
        ROWS=max(MIN_ROWS, triton.next_power_of_2(g)), D=d, BLOCK_N=block_n, SPLITS=splits,
        num_warps=num_warps, num_stages=num_stages)
    torch.library.wrap_triton(_merge_kernel)[(hq, b)](
        part_acc, part_ml, out, out.stride(0), out.stride(1), HQ=hq, D=d, SPLITS=splits,
        num_warps=4)


@torch.library.triton_op("trtmc::decode_attention", mutates_args=())
def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     lengths: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T) v for q [B, Hq, 1, D] over keys 0 .. lengths[b]-1 of k, v [B, Hkv, C, D];
    lengths int32 [B] on the device. Returns [B, Hq, 1, D] in q's dtype."""
    out = torch.empty((q.shape[0], q.shape[1], 1, q.shape[3]), dtype=q.dtype, device=q.device)
    launch(q, k, v, lengths, out)
    return out


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Shapes the kernels take: one query, a power-of-two head dim of at least 16, stride-1 rows,
    keys and values of one layout; BF16 dot products only on GPUs that have them (SM 8.0 on)."""
    d = q.shape[-1]
    bf16_ok = (q.dtype != torch.bfloat16 or not q.is_cuda
               or torch.cuda.get_device_capability(q.device) >= (8, 0))
    return (q.shape[2] == 1 and d >= 16 and d & (d - 1) == 0 and q.shape[1] % k.shape[1] == 0
            and all(t.stride(-1) == 1 for t in (q, k, v)) and k.shape == v.shape and bf16_ok)


@triton.jit
def _prompt_keys(acc, l, m, q_tile, k_base, v_base, sk_s, sv_s, rows, d, lo, hi, end,
                 CAUSAL: tl.constexpr, MASKED: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys lo .. hi - 1 into the running (acc, l, m), scores in the base-2 domain. Unmasked
    blocks (every key below the length and below every query of the tile) skip the masks."""
    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        if MASKED:
            valid = n < end
            keys = tl.load(k_base + n[:, None] * sk_s + d[None, :], mask=valid[:, None], other=0.0)
            values = tl.load(v_base + n[:, None] * sv_s + d[None, :], mask=valid[:, None],
                             other=0.0)
        else:
            keys = tl.load(k_base + n[:, None] * sk_s + d[None, :])
            values = tl.load(v_base + n[:, None] * sv_s + d[None, :])
        scores = tl.dot(q_tile, tl.trans(keys)) * LOG2E
        if MASKED:
            use = valid[None, :]
            if CAUSAL:
                use = use & (n[None, :] <= rows[:, None])
            scores = tl.where(use, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(values.dtype), values)
        m = m_new
    return acc, l, m


@triton.jit
def _prompt_kernel(q, k, v, lengths, out, sq_b, sq_h, sq_s, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s,
                   so_b, so_h, so_s, SQ, SKV, G: tl.constexpr, D: tl.constexpr, CAUSAL: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    block, head, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if CAUSAL:  # the longest programs (the last query blocks) first
        block = tl.num_programs(0) - 1 - block
    kv_head = head // G
    length = tl.load(lengths + b)
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, D)
    q_tile = tl.load(q + b * sq_b + head * sq_h + rows[:, None] * sq_s + d[None, :],
                     mask=rows[:, None] < SQ, other=0.0)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    end = tl.minimum(length, SKV)
    unmasked = end
    if CAUSAL:  # query i uses keys j <= i: none past this block's last query
        end = tl.minimum(end, (block + 1) * BLOCK_M)
        unmasked = tl.minimum(end, block * BLOCK_M)
    unmasked = unmasked // BLOCK_N * BLOCK_N
    k_base, v_base = k + b * sk_b + kv_head * sk_h, v + b * sv_b + kv_head * sv_h
    acc, l, m = _prompt_keys(acc, l, m, q_tile, k_base, v_base, sk_s, sv_s, rows, d, 0, unmasked,
                             end, CAUSAL, False, BLOCK_N)
    acc, l, m = _prompt_keys(acc, l, m, q_tile, k_base, v_base, sk_s, sv_s, rows, d, unmasked,
                             end, end, CAUSAL, True, BLOCK_N)
    o = acc / l[:, None]
    tl.store(out + b * so_b + head * so_h + rows[:, None] * so_s + d[None, :],
             o.to(out.dtype.element_ty), mask=rows[:, None] < SQ)


def launch_prompt(q, k, v, lengths, out, *, causal: bool, block_m: int = PROMPT_BLOCK_M,
                  block_n: int = PROMPT_BLOCK_N, num_warps: int = 8, num_stages: int = 3) -> None:
    """The prompt kernel into `out` [B, Hq, Sq, D] (the tuning knobs are the bench's to vary)."""
    b, hq, sq, d = q.shape
    torch.library.wrap_triton(_prompt_kernel)[(triton.cdiv(sq, block_m), hq, b)](
        q, k, v, lengths, out, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1),
        k.stride(2), v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1),
        out.stride(2), sq, k.shape[2], G=hq // k.shape[1], D=d, CAUSAL=causal, BLOCK_M=block_m,
        BLOCK_N=block_n, num_warps=num_warps, num_stages=num_stages)


@torch.library.triton_op("trtmc::prompt_attention", mutates_args=())
def prompt_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor,
                     causal: bool) -> torch.Tensor:
    """softmax(q k^T) v for q [B, Hq, Sq, D] over keys 0 .. min(lengths[b], Skv) - 1 of k, v
    [B, Hkv, Skv, D], query i using keys j <= i when `causal` (UPPER_LEFT); lengths int32 [B] on
    the device. Returns [B, Hq, Sq, D] in q's dtype."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    launch_prompt(q, k, v, lengths, out, causal=causal)
    return out


def supports_prompt(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """What the prompt kernel takes: the decode kernels' shapes (`supports`) with any number of
    queries, q, k and v of one 16-bit dtype (FP32 operands would be rounded to TF32)."""
    return (q.dtype in (torch.bfloat16, torch.float16) and q.dtype == k.dtype == v.dtype
            and supports(q[:, :, :1], k, v))
