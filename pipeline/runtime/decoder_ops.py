"""Lowering rules for the decoder layer types: KV cache update, rotary embedding, attention.

Semantics implemented here (the reference for what a kernel replacing a region must compute):

* KV_CACHE_UPDATE (LINEAR, PADDED_BHND): `cache` [B, H, C, D] is a buffer the runtime owns and
  passes as a network input; `update` [B, H, S, D] is written at sequence positions
  write_indices[b] .. write_indices[b] + S - 1, **in place**, and the output is the same tensor
  (TensorRT binds the output to the input's memory). Batch 1 only.
* ROTARY_EMBEDDING (non-interleaved, "rotate half"): x [B, N, S, D]; with `position_ids` [B, S] the
  cos/sin caches are [P, R/2] tables indexed by position, otherwise they are [B, S, R/2]. For the
  first R dims, x1 = x[..., :R/2], x2 = x[..., R/2:R]: out = (x1 c - x2 s, x2 c + x1 s); the rest
  passes through. Computed in FP32, rounded once.
* ATTENTION_INPUT + ATTENTION_OUTPUT (the pair TensorRT makes of one attention): q [B, Hq, Sq, D],
  k/v [B, Hkv, Skv, D] with Hq a multiple of Hkv, query head h using key/value head
  h // (Hq / Hkv) (grouped-query attention, transformers' repeat_kv order). softmax(q k^T) v with
  softmax scale 1.0 (the network scales the query). Keys j >= key_value_lengths[b] are not used
  (a fixed-capacity cache is padded beyond the length). Causal UPPER_LEFT: query i uses keys
  j <= i (prefill from an empty cache, where the length equals Sq), so only the first Sq keys
  are read. NONE: no causal mask (decode,
  Sq = 1). LOWER_RIGHT (j <= i + Skv - Sq) only without lengths: with a padded cache its alignment
  is not documented, so it is refused at load. A BOOL mask (true = attend) or a float mask (added
  to the scores) is honoured together with the above. Scores, softmax and P@V in FP32, output
  rounded to q's dtype; the optimized mode on CUDA rounds P to the value dtype before P@V
  (FlashAttention's rule: its Triton kernels, for decode and for prompts without a mask). The
  whole computation runs in ATTENTION_INPUT; ATTENTION_OUTPUT passes it on.
"""
from __future__ import annotations

import torch

from pipeline.runtime.ops import lowering

# ATTENTION_INPUT input slots, as TensorRT numbers them
_Q, _K, _V, _MASK, _QUANT_SCALE, _QUERY_LENGTHS, _KV_LENGTHS = range(7)


@lowering("KV_CACHE_UPDATE", fold=False)
def _kv_cache_update(layer, ctx):
    if layer["attrs"]["cache_mode"] != "LINEAR":
        raise ctx.error(layer, f"cache mode {layer['attrs']['cache_mode']} is not supported (LINEAR)")
    if ctx.inp(layer).shape[0] != 1:
        raise ctx.error(layer, f"cache shape {list(ctx.inp(layer).shape)}: only batch 1 is supported")
    device = ctx.device

    def step(cache, update, write_indices):
        positions = write_indices.to(torch.long) + torch.arange(update.shape[2], device=device)
        return cache.index_copy_(2, positions, update)
    return step


@lowering("ROTARY_EMBEDDING")
def _rotary(layer, ctx):
    a = layer["attrs"]
    if a["interleaved"]:
        raise ctx.error(layer, "interleaved rotary embedding is not supported")
    r, out = a["rotary_embedding_dim"], ctx.out(layer).torch_dtype
    half = r // 2
    by_position = len(layer["inputs"]) > 3 and layer["inputs"][3] is not None

    def tables(cos, sin, positions):
        if by_position:  # [P, R/2] tables -> [B, 1, S, R/2]
            p = positions.to(torch.long)
            return cos[p].unsqueeze(1).float(), sin[p].unsqueeze(1).float()
        return cos.unsqueeze(1).float(), sin.unsqueeze(1).float()

    def step(x, cos, sin, positions=None):
        c, s = tables(cos, sin, positions)
        xf = x.float()
        x1, x2, rest = xf[..., :half], xf[..., half:r], xf[..., r:]
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s, rest), dim=-1).to(out)
    return step


@lowering("ATTENTION_INPUT")
def _attention(layer, ctx):
    a, inputs = layer["attrs"], layer["inputs"] + [None] * (7 - len(layer["inputs"]))
    if a["norm_op"] != "SOFTMAX":
        raise ctx.error(layer, f"normalization {a['norm_op']} is not supported (SOFTMAX)")
    for slot, what in ((_QUANT_SCALE, "a normalization quantize scale"),
                       (_QUERY_LENGTHS, "query lengths (packed query form)")):
        if inputs[slot] is not None:
            raise ctx.error(layer, f"{what} is not supported")
    q, k = ctx.spec(inputs[_Q]), ctx.spec(inputs[_K])
    if q.shape[1] % k.shape[1]:
        raise ctx.error(layer, f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} "
                               f"key/value heads")
    causal, has_lengths = a["causal_kind"], inputs[_KV_LENGTHS] is not None
    if causal == "LOWER_RIGHT" and has_lengths:
        raise ctx.error(layer, "LOWER_RIGHT causal alignment together with key/value lengths is "
                               "not defined for a padded cache (use UPPER_LEFT from an empty cache, "
                               "NONE for one query, or a mask)")
    float_mask = inputs[_MASK] is not None and ctx.spec(inputs[_MASK]).dtype != "BOOL"
    out = ctx.out(layer).torch_dtype
    # FP32 scores, softmax and P@V on every device, rounded once at the output: TensorRT's fused
    # attention keeps scores and softmax in FP32, and a kernel gated against this rule should not
    # fail on the reference's own rounding (seen on the H200: BF16 scores flipped greedy tokens).
    acc, device = torch.float32, ctx.device

    def allowed(sq: int, skv: int, lengths, mask):
        """BOOL [B|1, 1, Sq, Skv]: which keys each query may use (shape-only branches)."""
        ok = torch.ones(1, 1, sq, skv, dtype=torch.bool, device=device)
        if causal == "UPPER_LEFT":
            ok = ok.tril()
        elif causal == "LOWER_RIGHT":
            ok = ok.tril(skv - sq)
        if has_lengths:
            ok = ok & (torch.arange(skv, device=device) < lengths.to(device)[:, None])[:, None, None, :]
        if mask is not None and not float_mask:
            ok = ok & mask
        return ok

    # On CUDA, BF16 q/k/v go to the tensor cores as they are with FP32 outputs (exact products,
    # FP32 sums) instead of FP32 copies of the whole fixed-capacity cache every step.
    products = _bf16_products if device.type == "cuda" and _has_fp32_bmm(device) and all(
        ctx.spec(inputs[i]).dtype == "BF16" for i in (_Q, _K, _V)) else _upcast_products

    # Decode (one query, a key length, nothing else) compiled in the optimized mode on CUDA: the
    # Triton split-K kernels of triton_attention, which read the length on the device and only
    # the keys in use.
    active_decode = ctx.triton and has_lengths and causal == "NONE" and inputs[_MASK] is None
    # A prompt in the optimized mode on CUDA, compiled or not (prefill runs uncompiled): the
    # Triton FlashAttention kernel of triton_attention, by the same rule as decode there.
    flash_prompt = ctx.triton and causal != "LOWER_RIGHT" and inputs[_MASK] is None

    def step(q, k, v, mask=None, _scale=None, _qlen=None, lengths=None):
        # also run uncompiled (generate(compile=False)): Triton only where it is traced
        if active_decode and torch.compiler.is_compiling() and q.shape[2] == 1:  # static when traced
            from pipeline.runtime import triton_attention
            if triton_attention.supports(q, k, v):
                return triton_attention.decode_attention(q, k, v, lengths.to(torch.int32)).to(out)
        b, hq, sq, d = q.shape
        if causal == "UPPER_LEFT" and k.shape[2] > sq:  # shape-only: static when traced
            # query i uses keys j <= i < Sq, so a padded cache's slots past Sq are never used:
            # a prefill reads Sq keys, not the whole capacity (40,960 slots for Qwen3-8B)
            k, v = k[:, :, :sq], v[:, :, :sq]
            mask = mask[..., :sq] if mask is not None and mask.shape[-1] > sq else mask
        hkv, skv = k.shape[1], k.shape[2]
        if sq > 1 and flash_prompt and q.is_cuda:
            from pipeline.runtime import triton_attention
            if triton_attention.supports_prompt(q, k, v):
                n = lengths.to(torch.int32) if lengths is not None else \
                    torch.full((b,), skv, dtype=torch.int32, device=q.device)
                return triton_attention.prompt_attention(q, k, v, n, causal == "UPPER_LEFT")
        if sq > 1:  # a prompt (shape-only: static when traced)
            return _prompt_attention(q, k, v, allowed(sq, skv, lengths, mask),
                                     mask.to(acc) if float_mask else None).to(out)
        if has_lengths and not q.is_cuda and not torch.compiler.is_compiling():
            # uncompiled on a CPU (reading the length costs no device sync there): the keys in
            # use, not the whole capacity; a key past every length has weight exactly 0
            used = max(1, min(skv, int(lengths.max())))
            k, v, skv = k[:, :, :used], v[:, :, :used], used
            mask = mask[..., :used] if mask is not None and mask.shape[-1] > used else mask
        # query head h = kv head h // G: [B, Hq, Sq, D] viewed as [B * Hkv, G * Sq, D]
        scores = products.scores(q.reshape(b * hkv, -1, d), k.reshape(b * hkv, skv, d))
        scores = scores.reshape(b, hq, sq, skv)
        if float_mask:
            scores = scores + mask.to(acc)
        scores = scores.masked_fill(~allowed(sq, skv, lengths, mask), float("-inf"))
        p = torch.softmax(scores, -1, dtype=torch.float32)
        pv = products.weighted(p.reshape(b * hkv, -1, skv), v.reshape(b * hkv, skv, d))
        return pv.reshape(b, hq, sq, d).to(out)
    return step


def _prompt_attention(q, k, v, allow, bias):
    """The same rule for Sq > 1 queries without the [B, Hq, Sq, Skv] FP32 scores in memory (2 GB
    per layer for a 4,000-token prompt of Qwen3-8B, then read and written again by the mask, the
    softmax and the exact P@V split): FP32 copies of q, k and v (key/value heads repeated per
    query group), one fused attention over them (torch's scaled_dot_product_attention, scale
    1.0: scores, softmax and P@V in FP32), `allow` the keys each query may use, `bias` a float
    mask added to the scores."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.float().repeat_interleave(group, dim=1) for t in (k, v))
    attn_mask = allow if bias is None else bias.masked_fill(~allow, float("-inf"))
    return torch.nn.functional.scaled_dot_product_attention(q.float(), k, v, attn_mask=attn_mask,
                                                            scale=1.0)


class _upcast_products:
    """q k^T and p v in FP32 on FP32 copies of the operands (CPU, and any dtype)."""
    scores = staticmethod(lambda q, k: q.float() @ k.float().mT)
    weighted = staticmethod(lambda p, v: p @ v.float())


def split_bf16(x: torch.Tensor) -> torch.Tensor:
    """FP32 [..., M, N] -> BF16 [..., 3M, N]: three BF16 parts (8 significand bits each) whose
    FP32 sum is x exactly (24 bits; barring BF16 underflow below ~1e-38)."""
    hi = x.to(torch.bfloat16)
    rest = x - hi.float()
    mid = rest.to(torch.bfloat16)
    return torch.cat((hi, mid, (rest - mid.float()).to(torch.bfloat16)), dim=-2)


class _bf16_products:
    """The same products from BF16 operands with FP32 outputs: products of BF16 values are exact
    in FP32, so q k^T is an FP32 sum of exact terms; FP32 p is split into three exact BF16 parts
    (p v = the sum of the parts' products), so v is read once and never copied to FP32."""
    scores = staticmethod(lambda q, k: torch.bmm(q, k.mT, out_dtype=torch.float32))

    @staticmethod
    def weighted(p, v):
        parts, m = split_bf16(p), p.shape[-2]
        out = torch.bmm(parts, v, out_dtype=torch.float32)
        return out[..., :m, :] + out[..., m:2 * m, :] + out[..., 2 * m:, :]


def _has_fp32_bmm(device: torch.device) -> bool:
    """torch.bmm(..., out_dtype=float32) on BF16 CUDA operands (recent torch only)."""
    x = torch.zeros(1, 1, 1, dtype=torch.bfloat16, device=device)
    try:
        return torch.bmm(x, x, out_dtype=torch.float32).dtype == torch.float32
    except (TypeError, RuntimeError, NotImplementedError):
        return False


@lowering("ATTENTION_OUTPUT")
def _attention_output(layer, ctx):
    return lambda x: x
