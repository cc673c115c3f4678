// decode_attention_hopper: run(q, k_cache, v_cache, kv_len, out), a split-K ("flash decoding")
// kernel for Hopper (H100/H200, sm_90a) for the recipe `qwen.decode_attention_region@2`. Same ABI
// and semantics as decode_attention.cu (the reference kernel, included below for its CPU path):
//
//   q        [B, Hq, 1, D]    BF16/FP16, already scaled by D^-0.5 (softmax scale 1.0)
//   k_cache  [B, Hkv, C, D]   same dtype; Hq a multiple of Hkv (query head h uses KV head h / G,
//   v_cache  [B, Hkv, C, D]   G = Hq / Hkv)
//   kv_len   [B]              INT32 on the device: keys 0 .. kv_len[b]-1 are used; the rest of the
//                             cache is never read
//   out      [B, Hq, 1, D]    softmax(q k^T) v, no causal mask; FP32 scores, softmax and P@V,
//                             output rounded once
//
// CUDA fast path (D = 128, Sq = 1, BF16/FP16, G <= 8, contiguous 16-byte-aligned tensors):
// * grid (S splits, B*Hkv); S is fixed per call from the multiprocessor count and the kernel's
//   occupancy (about one wave: 16 splits for Hkv = 8 on 132 SMs, one CTA per SM). Inside the
//   kernel every CTA reads kv_len and derives its split from it: chunk = ceil(len / S) rounded up to 64 keys (at
//   least 128, so a context of up to 128 keys is one split per KV head and needs no merge); CTAs
//   whose split starts at or past len exit at once. The work follows the device-side length,
//   never the capacity.
// * one CTA (4 warps) serves all G query heads of its KV head from one read of its keys. Each
//   warp streams its own 16-key blocks of K and V global -> shared with 16-byte cp.async.cg (L2
//   only) through a private 4-stage ring (XOR-swizzled rows, zero-filled past the split end, no
//   global read there), so the main loop has no CTA-wide barrier.
// * tensor cores (mma.sync m16n8k16, FP32 accumulate): S = Q K^T with the G query heads as the
//   M rows (ldmatrix K fragments); online softmax in FP32 registers (exp2 of log2e-scaled
//   scores); P V with P split into three exact 16-bit parts (hi + mid + lo = the FP32 P, as the
//   native region's BF16 path does): hi and mid share one MMA (rows 0-7 and 8-15), lo a second.
// * warps merge in shared memory; split partials (unnormalized acc, max, sum) go to a static
//   __device__ buffer; the last CTA of each (batch, KV head), found with an atomic ticket, merges
//   them and resets the ticket to 0 (one launch; a single active split writes out directly).
// No allocation, no synchronization, no host read of kv_len; launched on the TVM-FFI environment
// stream, so it can be captured in a CUDA graph. The static buffer is shared by all calls of this
// library on one device: do not run two calls concurrently on different streams.
// Anything outside the fast path (CPU tensors, FP32, other head dims, Sq > 1, G > 8) goes to the
// reference kernel, which also raises the argument errors.
#include <algorithm>
#include <cmath>
#include <vector>

#include "trtmc_kernel.h"

// The reference kernel, reused (not copied): its CPU path, its argument checks and its generic CUDA
// path. Its own `run` export is suppressed; this file exports `run` below.
#pragma push_macro("TVM_FFI_DLL_EXPORT_TYPED_FUNC")
#undef TVM_FFI_DLL_EXPORT_TYPED_FUNC
#define TVM_FFI_DLL_EXPORT_TYPED_FUNC(ExportName, Function)
namespace trtmc_reference {
#include "decode_attention.cu"
}  // namespace trtmc_reference
#pragma pop_macro("TVM_FFI_DLL_EXPORT_TYPED_FUNC")

namespace {

using trtmc_byok::TensorView;

#ifdef __CUDACC__
constexpr int kHeadDim = 128;          // the fast path's head dim (all Qwen3 sizes)
constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kBlock = 16;             // keys per warp step: one MMA k-step of P V
// Tuning knobs (compile-time; bench/gpu_attention.py --define sweeps them), defaults as shipped.
#ifndef TRTMC_ATTN_STAGES
#define TRTMC_ATTN_STAGES 4
#endif
#ifndef TRTMC_ATTN_MIN_CHUNK_TILES
#define TRTMC_ATTN_MIN_CHUNK_TILES 2
#endif
constexpr int kStages = TRTMC_ATTN_STAGES;  // per-warp cp.async ring depth
constexpr int kAlign = kWarps * kBlock;  // split sizes are multiples of this (64 keys)
// and at least this: up to 128 keys (by default), one split, no merge
constexpr int kMinChunk = TRTMC_ATTN_MIN_CHUNK_TILES * kAlign;
constexpr int kMaxGroup = 8;           // query heads per KV head: the MMA's rows 0-7
constexpr int kMaxSplits = 128;
constexpr int kMaxPartialRows = 8192;  // (batch, query head, split) rows of split partials
constexpr int kMaxTickets = 4096;      // (batch, KV head) pairs with more than one split
constexpr float kLog2e = 1.4426950408889634f;
constexpr size_t kStageElems = size_t(2) * kBlock * kHeadDim;        // K and V of one block
constexpr size_t kRingBytes = kWarps * kStages * kStageElems * 2;     // 128 KB at 4 stages: 1 CTA/SM
constexpr size_t kSmemBytes = kRingBytes + sizeof(float) * (kMaxGroup * kMaxSplits + kMaxGroup) + 16;

// Split-K scratch: a fixed-size static buffer (4.3 MB), not an allocation. Zero at module load;
// every launch leaves the tickets at zero again.
__device__ __align__(16) float g_partial_acc[size_t(kMaxPartialRows) * kHeadDim];
__device__ __align__(16) float2 g_partial_ml[kMaxPartialRows];  // (max in log2 units, sum)
__device__ unsigned g_tickets[kMaxTickets];

struct Params {
  const void* q;
  const void* k;
  const void* v;
  const int32_t* kv_len;
  void* out;
  int heads, kv_heads, group;
  int64_t capacity;
};

__device__ __forceinline__ void CpAsync16(void* smem, const void* gmem, bool valid) {
  const unsigned dst = unsigned(__cvta_generic_to_shared(smem));
  const int src_bytes = valid ? 16 : 0;  // 0: write 16 zero bytes, read nothing
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem),
               "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// atomicAdd(ticket, 1) with acquire-release semantics at GPU scope (no full fence.sc)
__device__ __forceinline__ unsigned TicketAcqRel(unsigned* ticket) {
  unsigned prev;
  asm volatile("atom.add.acq_rel.gpu.global.u32 %0, [%1], 1;\n" : "=r"(prev) : "l"(ticket) : "memory");
  return prev;
}

__device__ __forceinline__ void Ldsm4(unsigned (&r)[4], const void* p) {
  const unsigned a = unsigned(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a)
               : "memory");
}
__device__ __forceinline__ void Ldsm4T(unsigned (&r)[4], const void* p) {
  const unsigned a = unsigned(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a)
               : "memory");
}

// 16-bit type traits: the MMA, packing two floats (round to nearest even; the first one in the
// low half, i.e. the lower column), and the exact split of a float into three parts.
template <typename T>
struct Mma16;
template <>
struct Mma16<__nv_bfloat16> {
  static __device__ __forceinline__ void Run(float (&c)[4], const unsigned (&a)[4], unsigned b0,
                                             unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  static __device__ __forceinline__ float Round(float x) {
    return __bfloat162float(__float2bfloat16_rn(x));
  }
  static __device__ __forceinline__ unsigned Pack(float lo, float hi) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    unsigned u;
    memcpy(&u, &h, sizeof u);
    return u;
  }
};
template <>
struct Mma16<__half> {
  static __device__ __forceinline__ void Run(float (&c)[4], const unsigned (&a)[4], unsigned b0,
                                             unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  static __device__ __forceinline__ float Round(float x) { return __half2float(__float2half_rn(x)); }
  static __device__ __forceinline__ unsigned Pack(float lo, float hi) {
    const __half2 h = __floats2half2_rn(lo, hi);
    unsigned u;
    memcpy(&u, &h, sizeof u);
    return u;
  }
};

__device__ __forceinline__ float QuadMax(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float QuadSum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}
__device__ __forceinline__ float WarpMax(float x) {
#pragma unroll
  for (int off = 16; off > 0; off /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, off));
  return x;
}
__device__ __forceinline__ float WarpSum(float x) {
#pragma unroll
  for (int off = 16; off > 0; off /= 2) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

// Element offset of 16-byte chunk `c` (0..15) of row `r` in a [kBlock][kHeadDim] block: the chunk
// index XOR (r mod 8), so the 8 rows an ldmatrix reads at one logical chunk hit 8 bank groups.
__device__ __forceinline__ int Swz(int r, int c) { return r * kHeadDim + ((c ^ (r & 7)) << 3); }

// MMA fragment layout (m16n8k16; lane = 4 * gid + tid): A rows gid / gid+8, columns 2*tid (+8);
// B column gid, rows 2*tid (+8); C rows gid / gid+8, columns 2*tid, 2*tid+1.
template <typename T>
__global__ void __launch_bounds__(kThreads) SplitDecodeKernel(Params p) {
  using C = trtmc_byok::Convert<T>;
  using M = Mma16<T>;
  constexpr int D = kHeadDim;
  extern __shared__ __align__(128) unsigned char smem[];
  T* ring = reinterpret_cast<T*>(smem);
  float* s_w = reinterpret_cast<float*>(smem + kRingBytes);  // [kMaxGroup][kMaxSplits]
  float* s_inv = s_w + kMaxGroup * kMaxSplits;                // [kMaxGroup]
  int* s_last = reinterpret_cast<int*>(s_inv + kMaxGroup);

  const int split = blockIdx.x, splits = gridDim.x, bh = blockIdx.y;
  const int b = bh / p.kv_heads, kvh = bh % p.kv_heads;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int gid = lane >> 2, tq = lane & 3;  // MMA row (query head) and column pair
  const int group = p.group, head0 = kvh * group;
  const int64_t head_row0 = int64_t(b) * p.heads + head0;  // (b, first query head of the group)

  // q as MMA A fragments (rows = heads, 8 k-steps over D); rows 8-15 and heads >= G are zero
  unsigned qa[D / 16][2];
  {
    const T* qrow = static_cast<const T*>(p.q) + (head_row0 + gid) * D + 2 * tq;
#pragma unroll
    for (int j = 0; j < D / 16; ++j) {
      qa[j][0] = gid < group ? *reinterpret_cast<const unsigned*>(qrow + 16 * j) : 0u;
      qa[j][1] = gid < group ? *reinterpret_cast<const unsigned*>(qrow + 16 * j + 8) : 0u;
    }
  }

  const int len = int(min(max(int64_t(p.kv_len[b]), int64_t(0)), p.capacity));
  int chunk = (len + splits - 1) / splits;
  chunk = max(kMinChunk, (chunk + kAlign - 1) / kAlign * kAlign);
  const int active = max(1, (len + chunk - 1) / chunk);
  if (split >= active) return;  // starts at or past len: nothing to read
  const int start = split * chunk, end = min(start + chunk, len);
  const int nblk = (end - start + kBlock - 1) / kBlock;  // 0 only when len == 0 (output NaN)
  const int my_nblk = warp < nblk ? (nblk - warp + kWarps - 1) / kWarps : 0;

  const T* kbase = static_cast<const T*>(p.k) + int64_t(bh) * p.capacity * D;
  const T* vbase = static_cast<const T*>(p.v) + int64_t(bh) * p.capacity * D;
  T* my_ring = ring + size_t(warp) * kStages * kStageElems;

  // this warp's i-th block: keys start + 16 * (warp + 4 i) .. +15, into stage i % kStages
  auto issue = [&](int i) {
    if (i < my_nblk) {
      const int kb = start + kBlock * (warp + kWarps * i), nv = min(kBlock, end - kb);
      T* sk = my_ring + size_t(i % kStages) * kStageElems;
      T* sv = sk + kBlock * D;
#pragma unroll
      for (int j = 0; j < kBlock * D / 8 / 32; ++j) {
        const int e = lane + 32 * j, r = e >> 4, c = e & 15;
        const bool valid = r < nv;
        const int64_t off = valid ? int64_t(kb + r) * D + c * 8 : 0;
        CpAsync16(sk + Swz(r, c), kbase + off, valid);
        CpAsync16(sv + Swz(r, c), vbase + off, valid);
      }
    }
    CpAsyncCommit();  // possibly empty: keeps one group per block
  };
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) issue(i);

  float o[D / 8][4];  // O tiles: rows gid (hi + lo parts) and gid+8 (mid part) of head gid
#pragma unroll
  for (int n = 0; n < D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  float m_run = -INFINITY, l_run = 0.f;  // row gid; l_run is this lane's partial sum

  for (int i = 0; i < my_nblk; ++i) {
    CpAsyncWait<kStages - 2>();
    __syncwarp();  // block i visible to the warp; the warp is done with block i-1's stage
    issue(i + kStages - 1);
    const T* sk = my_ring + size_t(i % kStages) * kStageElems;
    const T* sv = sk + kBlock * D;
    const int kb = start + kBlock * (warp + kWarps * i);

    // S = Q K^T: two n-tiles (keys 0-7, 8-15), 8 k-steps
    float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
    for (int j = 0; j < D / 16; ++j) {
      unsigned bk[4];
      const int r = ((lane >> 4) << 3) + (lane & 7), c = 2 * j + ((lane >> 3) & 1);
      Ldsm4(bk, sk + Swz(r, c));
      const unsigned a[4] = {qa[j][0], 0u, qa[j][1], 0u};
      M::Run(s[0], a, bk[0], bk[1]);
      M::Run(s[1], a, bk[2], bk[3]);
    }
    // online softmax of row gid over keys 2tq, 2tq+1, 8+2tq, 9+2tq of the block
    float x[4] = {s[0][0], s[0][1], s[1][0], s[1][1]};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int key = kb + (e >> 1) * 8 + 2 * tq + (e & 1);
      x[e] = key < end ? x[e] * kLog2e : -INFINITY;
    }
    const float m_new = fmaxf(m_run, QuadMax(fmaxf(fmaxf(x[0], x[1]), fmaxf(x[2], x[3]))));
    const float corr = exp2f(m_run - m_new);  // 0 on the first block; key kb is always valid
    float pr[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) pr[e] = exp2f(x[e] - m_new);
    l_run = l_run * corr + ((pr[0] + pr[1]) + (pr[2] + pr[3]));
    m_run = m_new;
    if (!__all_sync(0xffffffffu, corr == 1.f)) {
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        o[n][0] *= corr;
        o[n][1] *= corr;
        o[n][2] *= corr;
        o[n][3] *= corr;
      }
    }
    // P in three exact parts: A1 = (hi rows 0-7, mid rows 8-15), A2 = (lo rows 0-7, 0)
    float hi[4], mid[4], lo[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      hi[e] = M::Round(pr[e]);
      const float rest = pr[e] - hi[e];
      mid[e] = M::Round(rest);
      lo[e] = rest - mid[e];
    }
    const unsigned a1[4] = {M::Pack(hi[0], hi[1]), M::Pack(mid[0], mid[1]), M::Pack(hi[2], hi[3]),
                            M::Pack(mid[2], mid[3])};
    const unsigned a2[4] = {M::Pack(lo[0], lo[1]), 0u, M::Pack(lo[2], lo[3]), 0u};
    // O += P V: 16 n-tiles of 8 dims; ldmatrix.trans gives the V fragments (rows = keys)
#pragma unroll
    for (int j = 0; j < D / 16; ++j) {
      unsigned bv[4];
      const int r = (((lane >> 3) & 1) << 3) + (lane & 7), c = 2 * j + (lane >> 4);
      Ldsm4T(bv, sv + Swz(r, c));
      M::Run(o[2 * j], a1, bv[0], bv[1]);
      M::Run(o[2 * j], a2, bv[0], bv[1]);
      M::Run(o[2 * j + 1], a1, bv[2], bv[3]);
      M::Run(o[2 * j + 1], a2, bv[2], bv[3]);
    }
  }

  // merge the 4 warps in shared memory (the ring is free once every warp is done)
  CpAsyncWait<0>();
  __syncthreads();
  float* w_o = reinterpret_cast<float*>(smem);     // [kWarps][kMaxGroup][D]
  float* w_ml = w_o + kWarps * kMaxGroup * D;      // [kWarps][kMaxGroup][2]
  const float l_row = QuadSum(l_run);
  if (gid < group) {
    float* dst = w_o + (warp * kMaxGroup + gid) * D + 2 * tq;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      *reinterpret_cast<float2*>(dst + 8 * n) = make_float2(o[n][0] + o[n][2], o[n][1] + o[n][3]);
    }
    if (tq == 0) {
      w_ml[(warp * kMaxGroup + gid) * 2] = m_run;
      w_ml[(warp * kMaxGroup + gid) * 2 + 1] = l_row;
    }
  }
  __syncthreads();
  T* out = static_cast<T*>(p.out);
  for (int e = tid; e < group * D; e += kThreads) {
    const int h = e / D, d = e % D;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, w_ml[(w * kMaxGroup + h) * 2]);
    float a = 0.f, l = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float sc = exp2f(w_ml[(w * kMaxGroup + h) * 2] - mx);  // warps with no keys: 0
      a = fmaf(w_o[(w * kMaxGroup + h) * D + d], sc, a);
      l = fmaf(w_ml[(w * kMaxGroup + h) * 2 + 1], sc, l);
    }
    if (active == 1) {
      out[(head_row0 + h) * D + d] = C::Store(a / l);  // len 0: NaN
    } else {
      g_partial_acc[((head_row0 + h) * splits + split) * D + d] = a;
      if (d == 0) g_partial_ml[(head_row0 + h) * splits + split] = make_float2(mx, l);
    }
  }
  if (active == 1) return;

  // last CTA of this (batch, KV head) merges the splits: the barrier orders the CTA's partial
  // stores before thread 0's release; the winner's acquire comes before its barrier and reads
  __syncthreads();
  if (tid == 0) *s_last = TicketAcqRel(&g_tickets[bh]) == unsigned(active - 1);
  __syncthreads();
  if (!*s_last) return;
  for (int h = warp; h < group; h += kWarps) {  // weights of head h's splits, one load each
    const float2* ml = g_partial_ml + (head_row0 + h) * splits;
    float2 v[kMaxSplits / 32];
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < kMaxSplits / 32; ++j) {
      const int sidx = lane + 32 * j;
      v[j] = sidx < active ? __ldcg(ml + sidx) : make_float2(-INFINITY, 0.f);
      mx = fmaxf(mx, v[j].x);
    }
    mx = WarpMax(mx);
    float den = 0.f;
#pragma unroll
    for (int j = 0; j < kMaxSplits / 32; ++j) {
      const int sidx = lane + 32 * j;
      if (sidx < active) {
        const float w = exp2f(v[j].x - mx);
        s_w[h * kMaxSplits + sidx] = w;
        den = fmaf(w, v[j].y, den);
      }
    }
    den = WarpSum(den);
    if (lane == 0) s_inv[h] = 1.f / den;
  }
  __syncthreads();
  for (int col = tid; col < group * (D / 4); col += kThreads) {  // (head, 4 dims)
    const int h = col / (D / 4), d4 = col % (D / 4);
    const float4* src =
        reinterpret_cast<const float4*>(g_partial_acc + (head_row0 + h) * splits * D) + d4;
    const float* w = s_w + h * kMaxSplits;
    float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 8
    for (int sidx = 0; sidx < active; ++sidx) {
      const float4 x = __ldcg(src + int64_t(sidx) * (D / 4));
      const float ws = w[sidx];
      a.x = fmaf(x.x, ws, a.x);
      a.y = fmaf(x.y, ws, a.y);
      a.z = fmaf(x.z, ws, a.z);
      a.w = fmaf(x.w, ws, a.w);
    }
    const float inv = s_inv[h];
    T* dst = out + (head_row0 + h) * D + 4 * d4;
    dst[0] = C::Store(a.x * inv);
    dst[1] = C::Store(a.y * inv);
    dst[2] = C::Store(a.z * inv);
    dst[3] = C::Store(a.w * inv);
  }
  if (tid == 0) g_tickets[bh] = 0;  // ready for the next launch
}

template <typename T>
void LaunchSplit(const Params& prm, int batch, int device, cudaStream_t stream) {
  constexpr const char* kName = "decode_attention_hopper";
  auto* kernel = &SplitDecodeKernel<T>;
  // once per device and type: raise the shared-memory limit, read the occupancy
  constexpr int kMaxDevices = 64;
  static int ctas_per_sm[kMaxDevices] = {}, sms[kMaxDevices] = {};
  if (device < 0 || device >= kMaxDevices) {
    TVM_FFI_THROW(ValueError) << kName << ": argument 'q' is on CUDA device " << device
                              << ", expected a device index below " << kMaxDevices;
  }
  if (ctas_per_sm[device] == 0) {
    cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSmemBytes));
    int n = 0, count = 0;
    if (err == cudaSuccess) {
      err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kThreads, kSmemBytes);
    }
    if (err == cudaSuccess) err = cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device);
    if (err != cudaSuccess || n < 1) {
      TVM_FFI_THROW(RuntimeError) << kName << ": cannot configure the kernel for " << kSmemBytes
                                  << " bytes of shared memory: " << cudaGetErrorString(err);
    }
    sms[device] = count;
    ctas_per_sm[device] = n;
  }
  const int pairs = batch * prm.kv_heads;
  int64_t splits = sms[device] * ctas_per_sm[device] / pairs;
  splits = std::min<int64_t>(splits, (prm.capacity + kAlign - 1) / kAlign);
  splits = std::min<int64_t>(splits, kMaxSplits);
  splits = std::min<int64_t>(splits, kMaxPartialRows / (int64_t(batch) * prm.heads));
  if (pairs > kMaxTickets) splits = 1;
  splits = std::max<int64_t>(splits, 1);
  SplitDecodeKernel<T><<<dim3(unsigned(splits), unsigned(pairs)), kThreads, kSmemBytes, stream>>>(prm);
  trtmc_byok::CheckLaunch(kName);
}

// Tensor data pointer (DLPack byte offset included).
inline const void* Data(const TensorView& t) {
  return static_cast<const char*>(t.data_ptr()) + t.byte_offset();
}

bool Aligned16(const TensorView& t) { return reinterpret_cast<uintptr_t>(Data(t)) % 16 == 0; }

bool SameDType(const TensorView& a, const TensorView& b) {
  const DLDataType x = a.dtype(), y = b.dtype();
  return x.code == y.code && x.bits == y.bits && x.lanes == y.lanes;
}

bool OnDevice(const TensorView& t, const DLDevice& dev) {
  return t.device().device_type == dev.device_type && t.device().device_id == dev.device_id;
}

// Whether the fast path takes this call: otherwise the reference kernel handles (or refuses) it.
bool FastPath(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& kv_len,
              const TensorView& out) {
  const DLDevice dev = q.device();
  if (dev.device_type != kDLCUDA) return false;
  for (const TensorView* t : {&k, &v, &kv_len, &out}) {
    if (!OnDevice(*t, dev)) return false;
  }
  const DLDataType qd = q.dtype(), ld = kv_len.dtype();
  const bool half = qd.lanes == 1 && qd.bits == 16 && (qd.code == kDLBfloat || qd.code == kDLFloat);
  if (!half || !SameDType(q, k) || !SameDType(q, v) || !SameDType(q, out)) return false;
  if (ld.code != kDLInt || ld.bits != 32 || ld.lanes != 1) return false;
  if (q.ndim() != 4 || k.ndim() != 4 || v.ndim() != 4 || out.ndim() != 4 || kv_len.ndim() != 1) {
    return false;
  }
  const int64_t batch = q.size(0), heads = q.size(1), kv_heads = k.size(1);
  if (batch < 1 || q.size(2) != 1 || q.size(3) != kHeadDim || kv_len.size(0) != batch) return false;
  for (int i = 0; i < 4; ++i) {
    if (k.size(i) != v.size(i) || out.size(i) != q.size(i)) return false;
  }
  if (k.size(0) != batch || k.size(3) != kHeadDim || k.size(2) < 1 || kv_heads < 1 ||
      heads % kv_heads != 0 || heads / kv_heads > kMaxGroup) {
    return false;
  }
  if (batch * kv_heads > 65535 || k.size(2) > (int64_t(1) << 30) || batch * heads > kMaxPartialRows) {
    return false;
  }
  for (const TensorView* t : {&q, &k, &v, &kv_len, &out}) {
    if (!t->IsContiguous()) return false;
  }
  return Aligned16(q) && Aligned16(k) && Aligned16(v) && Aligned16(out) &&
         reinterpret_cast<uintptr_t>(Data(kv_len)) % 4 == 0;
}

#endif

void DecodeAttentionHopper(TensorView q, TensorView k_cache, TensorView v_cache, TensorView kv_len,
                           TensorView out) {
#ifdef __CUDACC__
  if (FastPath(q, k_cache, v_cache, kv_len, out)) {
    const int device = q.device().device_id;
    Params prm{Data(q), Data(k_cache), Data(v_cache), static_cast<const int32_t*>(Data(kv_len)),
               const_cast<void*>(Data(out)), int(q.size(1)), int(k_cache.size(1)),
               int(q.size(1) / k_cache.size(1)), k_cache.size(2)};
    int current = -1;
    cudaGetDevice(&current);
    if (current != device) cudaSetDevice(device);
    const cudaStream_t stream = trtmc_byok::EnvStream(q);
    const int batch = int(q.size(0));
    if (q.dtype().code == kDLBfloat) {
      LaunchSplit<__nv_bfloat16>(prm, batch, device, stream);
    } else {
      LaunchSplit<__half>(prm, batch, device, stream);
    }
    if (current != device && current >= 0) cudaSetDevice(current);
    return;
  }
#endif
  trtmc_reference::DecodeAttention(q, k_cache, v_cache, kv_len, out);
}

}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(run, DecodeAttentionHopper);
