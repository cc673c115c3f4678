// decode_attention_hopper: a split-K ("flash decoding") kernel for Hopper (H100/H200, sm_90a) for
// the region of recipe `qwen.decode_attention_region@2`. Two exports, one kernel:
//
//   run(q, k_cache, v_cache, kv_len, out)                 the recipe's ABI (workspace 0): split
//       partials in a static __device__ buffer, merged by the last CTA of each KV head (a ticket)
//   run_workspace(q, k_cache, v_cache, kv_len, workspace, out)   a manual selection of the same
//       nodes with --workspace-bytes N: partials in the slot's workspace, merged by every CTA after
//       a grid-wide barrier (a cooperative launch; where the grid cannot be resident at once, as
//       under MPS, one split instead), so no state outlives a call and calls on different
//       streams, each with its own workspace, may overlap
//
// Same semantics as decode_attention.cu (the reference kernel, included below for its CPU path):
//   q        [B, Hq, 1, D]    BF16/FP16, already scaled by D^-0.5 (softmax scale 1.0)
//   k_cache  [B, Hkv, C, D]   same dtype; Hq a multiple of Hkv (query head h uses KV head h / G,
//   v_cache  [B, Hkv, C, D]   G = Hq / Hkv)
//   kv_len   [B]              INT32 on the device: keys 0 .. kv_len[b]-1 are used; the rest of the
//                             cache is never read
//   workspace [N]             UINT8 on the device, undefined at each call (it may be poisoned);
//                             workspace_bytes(...) says the N a shape needs for all its splits; a
//                             smaller one caps the splits (launch_plan says how many)
//   out      [B, Hq, 1, D]    softmax(q k^T) v, no causal mask; FP32 scores, softmax and P@V,
//                             output rounded once
//
// CUDA fast path (D = 128, Sq = 1, BF16/FP16, G <= 8, contiguous 16-byte-aligned tensors):
// * grid (S splits, B*Hkv); S is fixed per call from the multiprocessor count and the kernel's
//   occupancy (about one wave: 16 splits for Hkv = 8 on 132 SMs, one CTA per SM) and the partials'
//   room. Inside the kernel every CTA reads kv_len and derives its split from it: chunk =
//   ceil(len / S) rounded up to 64 keys (at least 128, so a context of up to 128 keys is one split
//   per KV head and needs no merge); CTAs whose split starts at or past len read no keys. The work
//   follows the device-side length, never the capacity.
// * one CTA (4 warps) serves all G query heads of its KV head from one read of its keys. Each
//   warp streams its own 16-key blocks of K and V global -> shared with 16-byte cp.async.cg (L2
//   only) through a private 4-stage ring (XOR-swizzled rows, zero-filled past the split end, no
//   global read there), so the main loop has no CTA-wide barrier. The group's q rows ride in the
//   first block's copy group.
// * tensor cores (mma.sync m16n8k16, FP32 accumulate): S = Q K^T with the G query heads as the
//   M rows (ldmatrix K fragments); online softmax in FP32 registers (exp2 of log2e-scaled
//   scores); then O^T = V^T P^T, whose B fragments are S's C fragments as they stand (ldmatrix.trans
//   V fragments), with P in two exact 16-bit parts (hi + mid: P to 16 significant bits). For
//   G <= 4 both parts share one MMA (hi in columns 0-3, mid in 4-7): 24 MMAs per 16 keys.
// * warps merge in shared memory; each split's partial (unnormalized acc, max, sum) goes to the
//   scratch; the merge over splits takes one round of loads per column (a single active split
//   writes out directly). `run`: the last CTA of each (batch, KV head), found with an atomic
//   ticket, merges them and resets the ticket to 0. `run_workspace`: after the barrier each of the
//   S CTAs of a KV head merges every S-th column. The barrier is taken only when some KV head has
//   more than one active split (with B > 1 every CTA reads all B lengths to agree on it).
// * launch_plan(device, batch, heads, kv_heads, capacity, workspace_bytes) says the split count a
//   call launches (benchmarks record it); TRTMC_ATTN_MARK marks its phases in a tracing build
//   (benchmarks/gpu_attention_trace.py).
// No allocation, no synchronization, no host read of kv_len; launched on the TVM-FFI environment
// stream, so it can be captured in a CUDA graph. `run`'s static buffer is shared by all its calls
// on one device: do not run two `run` calls concurrently on different streams.
// Anything outside the fast path (CPU tensors, FP32, other head dims, Sq > 1, G > 8) goes to the
// reference kernel, which also raises the argument errors (run_workspace ignores its workspace there).
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "trtmc_kernel.h"
#ifdef __CUDACC__
#include <cooperative_groups.h>
#endif

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
// Tuning knobs (compile-time; benchmarks/gpu_attention.py --define sweeps them), defaults as shipped.
#ifndef TRTMC_ATTN_STAGES
#define TRTMC_ATTN_STAGES 4
#endif
#ifndef TRTMC_ATTN_MIN_CHUNK_TILES
#define TRTMC_ATTN_MIN_CHUNK_TILES 2
#endif
// Phase marks for a tracing build (benchmarks/gpu_attention_trace.py); nothing in the shipped one.
#ifndef TRTMC_ATTN_MARK
#define TRTMC_ATTN_MARK(point)
#endif
constexpr int kStages = TRTMC_ATTN_STAGES;  // per-warp cp.async ring depth
constexpr int kAlign = kWarps * kBlock;  // split sizes are multiples of this (64 keys)
// and at least this: up to 128 keys (by default), one split, no merge
constexpr int kMinChunk = TRTMC_ATTN_MIN_CHUNK_TILES * kAlign;
constexpr int kMaxGroup = 8;           // query heads per KV head: the MMA's rows 0-7
constexpr int kMaxSplits = 128;
constexpr int kMaxPartialRows = 8192;  // (batch, query head, split) rows of `run`'s partials
constexpr int kMaxTickets = 4096;      // (batch, KV head) pairs with more than one split
// a partial row in the workspace: the head's D accumulators, then (max, sum) in a table after all rows
constexpr int64_t kPartialRowBytes = kHeadDim * sizeof(float) + sizeof(float2);
constexpr float kLog2e = 1.4426950408889634f;
constexpr size_t kStageElems = size_t(2) * kBlock * kHeadDim;        // K and V of one block
constexpr size_t kRingBytes = kWarps * kStages * kStageElems * 2;     // 128 KB at 4 stages: 1 CTA/SM
constexpr size_t kQBytes = kWarps * kMaxGroup * kHeadDim * 2;          // each warp's copy of q
constexpr size_t kSmemBytes = kRingBytes + kQBytes + 16;  // after the ring and q: the ticket's verdict

// `run`'s split-K scratch: a fixed-size static buffer (4.3 MB), not an allocation. Zero at module
// load; every launch leaves the tickets at zero again.
__device__ __align__(16) float g_partial_acc[size_t(kMaxPartialRows) * kHeadDim];
__device__ __align__(16) float2 g_partial_ml[kMaxPartialRows];  // (max in log2 units, sum)
__device__ unsigned g_tickets[kMaxTickets];

struct Params {
  const void* q;
  const void* k;
  const void* v;
  const int32_t* kv_len;
  void* out;
  float* acc;   // split partials: [rows][D] accumulators and [rows] (max in log2 units, sum), a
  float2* ml;   // row per (batch, query head, split); `run`: the static buffer
  int batch, heads, kv_heads, group;
  int64_t capacity;
};

__device__ __forceinline__ unsigned SharedAddress(const void* p) {
  return unsigned(__cvta_generic_to_shared(p));
}
// 16 bytes global -> shared (address `dst` in the shared window), L2 only
__device__ __forceinline__ void CpAsync16(unsigned dst, const void* gmem, bool valid) {
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
// Element offset of 16-byte chunk `c` (0..15) of row `r` in a [kBlock][kHeadDim] block: the chunk
// index XOR (r mod 8), so the 8 rows an ldmatrix reads at one logical chunk hit 8 bank groups.
__device__ __forceinline__ int Swz(int r, int c) { return r * kHeadDim + ((c ^ (r & 7)) << 3); }

// One CTA's share of the work: keys [start, end) of one (batch, KV head), for its G query heads.
struct Split {
  int index, count;    // this CTA's split, and the launch's splits per (batch, KV head)
  int active;          // splits that hold keys (1 .. count): ceil(len / chunk)
  int start, end;      // keys of this split (empty past len)
  int group;           // query heads per KV head
  int64_t head_row0;   // (batch, first query head of the group)
  int bh;              // batch * kv_heads + KV head
};

// Batch b's keys (kv_len clamped to [0, capacity]) and their split size over `count` splits.
struct Chunking {
  int len, chunk;
};
__device__ __forceinline__ Chunking ChunkingOf(const Params& p, int b, int count) {
  const int len = int(min(max(int64_t(p.kv_len[b]), int64_t(0)), p.capacity));
  const int chunk = max(kMinChunk, ((len + count - 1) / count + kAlign - 1) / kAlign * kAlign);
  return {len, chunk};
}
__device__ __forceinline__ int ActiveSplits(const Chunking& c) {
  return max(1, (c.len + c.chunk - 1) / c.chunk);
}

__device__ __forceinline__ Split SplitOf(const Params& p) {
  Split s;
  s.index = blockIdx.x;
  s.count = gridDim.x;
  s.bh = blockIdx.y;
  const int b = s.bh / p.kv_heads, kvh = s.bh % p.kv_heads;
  s.group = p.group;
  s.head_row0 = int64_t(b) * p.heads + int64_t(kvh) * p.group;
  const Chunking c = ChunkingOf(p, b, s.count);
  s.active = ActiveSplits(c);
  s.start = s.index * c.chunk;
  s.end = max(s.start, min(s.start + c.chunk, c.len));
  return s;
}

// Whether any (batch, KV head) of the launch has more than one active split: the same answer in
// every CTA, so all of them take the grid barrier or none does. Every thread must call it.
__device__ __forceinline__ bool AnyMerge(const Params& p, int count) {
  int any = 0;
  for (int b = threadIdx.x; b < p.batch && !any; b += blockDim.x) {
    any = ActiveSplits(ChunkingOf(p, b, count)) > 1;
  }
  return __syncthreads_or(any);
}

// MMA fragment layout (m16n8k16; lane = 4 * gid + tq): A rows gid / gid+8, columns 2*tq (+8);
// B column gid, rows 2*tq (+8); C rows gid / gid+8, columns 2*tq, 2*tq+1.
//
// S = Q K^T has the G query heads as rows (M) and 16 keys as columns; its C fragments are, as they
// stand, the B fragments of O^T = V^T P^T (M = 16 dims, N = the heads, K = the 16 keys), so P never
// leaves registers and a block of 16 keys costs 8 MMAs per part of P over the 128 dims. P is FP32;
// it is applied as two 16-bit parts, hi + mid (P to 16 significant bits: 2^-17 relative, far below
// the output's rounding). With G <= 4 the two parts share one MMA: hi in columns 0-3, mid in 4-7.
//
// The split's partial softmax(q k^T) v, unnormalized: emit(e, acc, (max in log2 units, sum)) for
// each element e = h * D + d of its G heads, straight from the warps' merge.
template <typename T, typename Emit>
__device__ __forceinline__ void SplitPartial(const Params& p, const Split& s, unsigned char* smem,
                                             Emit emit) {
  using M = Mma16<T>;
  constexpr int D = kHeadDim;
  constexpr unsigned kAll = 0xffffffffu;
  T* ring = reinterpret_cast<T*>(smem);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int gid = lane >> 2, tq = lane & 3;  // MMA row (query head) and column pair
  const int start = s.start, end = s.end, group = s.group;
  const bool packed = group <= 4;            // hi and mid of P in one MMA
  const int head_mask = packed ? 3 : 7;      // O^T column -> its head
  const int nblk = (end - start + kBlock - 1) / kBlock;  // 0 only when len == 0 (output NaN)
  const int my_nblk = warp < nblk ? (nblk - warp + kWarps - 1) / kWarps : 0;

  const T* kbase = static_cast<const T*>(p.k) + int64_t(s.bh) * p.capacity * D;
  const T* vbase = static_cast<const T*>(p.v) + int64_t(s.bh) * p.capacity * D;
  T* my_ring = ring + size_t(warp) * kStages * kStageElems;
  T* my_q = reinterpret_cast<T*>(smem + kRingBytes) + size_t(warp) * kMaxGroup * D;

  // this warp's i-th block: keys start + 16 * (warp + 4 i) .. +15, into stage i % kStages
  auto issue = [&](int i) {
    if (i < my_nblk) {
      const int kb = start + kBlock * (warp + kWarps * i), nv = min(kBlock, end - kb);
      T* sk = my_ring + size_t(i % kStages) * kStageElems;
      T* sv = sk + kBlock * D;
#pragma unroll
      for (int j = 0; j < kBlock * D / 8 / 32; ++j) {
        const int e = lane + 32 * j, r = e >> 4, c = e & 15;
        const bool valid = r < nv;  // rows past the split: zeros, nothing read
        const int64_t off = valid ? int64_t(kb + r) * D + c * 8 : 0;
        CpAsync16(SharedAddress(sk + Swz(r, c)), kbase + off, valid);
        CpAsync16(SharedAddress(sv + Swz(r, c)), vbase + off, valid);
      }
    }
    CpAsyncCommit();  // possibly empty: keeps one group per block
  };
  // the group's query rows (zero past G) ride in the first block's group, ahead of its keys: as
  // registers loaded at the start, the compiler would issue them after the whole prologue
#pragma unroll
  for (int j = 0; j < kMaxGroup * D / 8 / 32; ++j) {
    const int e = lane + 32 * j, r = e >> 4, c = e & 15;
    const bool valid = r < group;
    CpAsync16(SharedAddress(my_q + r * D + c * 8),
              static_cast<const T*>(p.q) + (valid ? (s.head_row0 + r) * D + c * 8 : 0), valid);
  }
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) issue(i);

  // O^T tiles: dims 16 t + gid (c0, c1) and 16 t + gid + 8 (c2, c3), columns 2 tq, 2 tq + 1
  float ot[D / 16][4];
#pragma unroll
  for (int t = 0; t < D / 16; ++t) ot[t][0] = ot[t][1] = ot[t][2] = ot[t][3] = 0.f;
  float m_run = -INFINITY, l_run = 0.f;  // row gid; l_run is this lane's partial sum
  // ldmatrix row of this lane in a 16 x 16 tile: K's B fragments and V^T's A fragments alike
  const int ld_row = ((lane >> 4) << 3) + (lane & 7), ld_chunk = (lane >> 3) & 1;

  CpAsyncWait<kStages - 2>();
  __syncwarp();  // q and block 0 visible to the warp
  TRTMC_ATTN_MARK(2);
  unsigned qa[D / 16][2];  // q as MMA A fragments: rows = heads (8-15 zero), 8 k-steps over D
#pragma unroll
  for (int j = 0; j < D / 16; ++j) {
    qa[j][0] = *reinterpret_cast<const unsigned*>(my_q + gid * D + 16 * j + 2 * tq);
    qa[j][1] = *reinterpret_cast<const unsigned*>(my_q + gid * D + 16 * j + 8 + 2 * tq);
  }

  for (int i = 0; i < my_nblk; ++i) {
    if (i > 0) {
      CpAsyncWait<kStages - 2>();
      __syncwarp();  // block i visible to the warp; the warp is done with block i-1's stage
    }
    issue(i + kStages - 1);
    const T* sk = my_ring + size_t(i % kStages) * kStageElems;
    const T* sv = sk + kBlock * D;
    const int kb = start + kBlock * (warp + kWarps * i);

    // S = Q K^T: two n-tiles (keys 0-7, 8-15), 8 k-steps
    float sc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
    for (int j = 0; j < D / 16; ++j) {
      unsigned bk[4];
      Ldsm4(bk, sk + Swz(ld_row, 2 * j + ld_chunk));
      const unsigned a[4] = {qa[j][0], 0u, qa[j][1], 0u};
      M::Run(sc[0], a, bk[0], bk[1]);
      M::Run(sc[1], a, bk[2], bk[3]);
    }
    // online softmax of row gid over keys 2tq, 2tq+1, 8+2tq, 9+2tq of the block
    float x[4] = {sc[0][0], sc[0][1], sc[1][0], sc[1][1]};
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
    if (!__all_sync(kAll, corr == 1.f)) {  // O^T column c belongs to head c & head_mask
      const float c0 = __shfl_sync(kAll, corr, 4 * ((2 * tq) & head_mask));
      const float c1 = __shfl_sync(kAll, corr, 4 * ((2 * tq + 1) & head_mask));
#pragma unroll
      for (int t = 0; t < D / 16; ++t) {
        ot[t][0] *= c0;
        ot[t][1] *= c1;
        ot[t][2] *= c0;
        ot[t][3] *= c1;
      }
    }
    // P^T as B fragments (keys 2tq.. of head gid), in two exact parts
    float hi[4], mid[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      hi[e] = M::Round(pr[e]);
      mid[e] = M::Round(pr[e] - hi[e]);
    }
    unsigned b_hi[2] = {M::Pack(hi[0], hi[1]), M::Pack(hi[2], hi[3])};
    const unsigned b_mid[2] = {M::Pack(mid[0], mid[1]), M::Pack(mid[2], mid[3])};
    if (packed) {  // columns 4-7 take the mid part of heads 0-3 (lanes gid ^ 4)
      const unsigned m0 = __shfl_xor_sync(kAll, b_mid[0], 16), m1 = __shfl_xor_sync(kAll, b_mid[1], 16);
      if (gid >= 4) {
        b_hi[0] = m0;
        b_hi[1] = m1;
      }
    }
    // O^T += V^T P^T: 8 m-tiles of 16 dims; ldmatrix.trans of V gives V^T's A fragments
#pragma unroll
    for (int t = 0; t < D / 16; ++t) {
      unsigned av[4];
      Ldsm4T(av, sv + Swz(ld_row, 2 * t + ld_chunk));
      M::Run(ot[t], av, b_hi[0], b_hi[1]);
      if (!packed) M::Run(ot[t], av, b_mid[0], b_mid[1]);
    }
  }

  // merge the 4 warps in shared memory (the ring is free once every warp is done)
  CpAsyncWait<0>();
  __syncthreads();
  TRTMC_ATTN_MARK(3);
  float* w_o = reinterpret_cast<float*>(smem);     // [kWarps][kMaxGroup][D]
  float* w_ml = w_o + kWarps * kMaxGroup * D;      // [kWarps][kMaxGroup][2]
  if (packed) {  // fold the mid columns (4-7) onto their heads' hi columns (0-3)
#pragma unroll
    for (int t = 0; t < D / 16; ++t) {
#pragma unroll
      for (int e = 0; e < 4; ++e) ot[t][e] += __shfl_xor_sync(kAll, ot[t][e], 2);
    }
  }
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    const int h = 2 * tq + c;
    if (h < group && (!packed || tq < 2)) {
      float* dst = w_o + (warp * kMaxGroup + h) * D + gid;
#pragma unroll
      for (int t = 0; t < D / 16; ++t) {
        dst[16 * t] = ot[t][c];
        dst[16 * t + 8] = ot[t][2 + c];
      }
    }
  }
  const float l_row = QuadSum(l_run);
  if (gid < group && tq == 0) {
    w_ml[(warp * kMaxGroup + gid) * 2] = m_run;
    w_ml[(warp * kMaxGroup + gid) * 2 + 1] = l_row;
  }
  __syncthreads();
  TRTMC_ATTN_MARK(7);
  // thread d merges dim d of every head; each thread weighs the warps itself (the same shared
  // words for all threads: broadcasts), which saves a pass and a barrier
  static_assert(kThreads == kHeadDim, "the warps' merge takes one thread per dim");
  for (int h = 0; h < group; ++h) {
    const float* ml = w_ml + h * 2;  // warp w's (max, sum) of head h at ml[w * kMaxGroup * 2]
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, ml[w * kMaxGroup * 2]);
    float a = 0.f, l = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float sc = exp2f(ml[w * kMaxGroup * 2] - mx);  // warps with no keys: 0
      l = fmaf(ml[w * kMaxGroup * 2 + 1], sc, l);
      a = fmaf(w_o[(w * kMaxGroup + h) * D + tid], sc, a);
    }
    emit(h * D + tid, a, make_float2(mx, l));
  }
  TRTMC_ATTN_MARK(4);
}

// One (head, 4 dims) column of a (batch, KV head), merged over its active splits once every
// split's partial is in the scratch, and written out: up to kMergeBatch splits' partials are
// loaded at once, so that 16 splits cost one L2 round trip.
template <typename T>
__device__ __forceinline__ void MergeColumn(const Params& p, const Split& s, int col) {
  using C = trtmc_byok::Convert<T>;
  constexpr int D = kHeadDim, kMergeBatch = 16;
  const int splits = s.count, active = s.active;
  const int h = col / (D / 4), d4 = col % (D / 4);
  const float2* hml = p.ml + (s.head_row0 + h) * splits;
  const float4* src = reinterpret_cast<const float4*>(p.acc + (s.head_row0 + h) * splits * D) + d4;
  float mx = -INFINITY, l = 0.f;
  float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int base = 0; base < active; base += kMergeBatch) {  // an online merge, batch by batch
    float2 v[kMergeBatch];
    float4 x[kMergeBatch];
    float bmx = mx;
#pragma unroll
    for (int j = 0; j < kMergeBatch; ++j) {
      const bool in = base + j < active;
      v[j] = in ? __ldcg(hml + base + j) : make_float2(-INFINITY, 0.f);
      x[j] = in ? __ldcg(src + int64_t(base + j) * (D / 4)) : make_float4(0.f, 0.f, 0.f, 0.f);
      bmx = fmaxf(bmx, v[j].x);
    }
    const float corr = exp2f(mx - bmx);  // 0 on the first batch
    l *= corr;
    a = make_float4(a.x * corr, a.y * corr, a.z * corr, a.w * corr);
#pragma unroll
    for (int j = 0; j < kMergeBatch; ++j) {
      const float w = exp2f(v[j].x - bmx);  // splits past `active`: 0
      l = fmaf(v[j].y, w, l);
      a = make_float4(fmaf(x[j].x, w, a.x), fmaf(x[j].y, w, a.y), fmaf(x[j].z, w, a.z),
                      fmaf(x[j].w, w, a.w));
    }
    mx = bmx;
  }
  const float inv = 1.f / l;
  T* dst = static_cast<T*>(p.out) + (s.head_row0 + h) * D + 4 * d4;
  dst[0] = C::Store(a.x * inv);
  dst[1] = C::Store(a.y * inv);
  dst[2] = C::Store(a.z * inv);
  dst[3] = C::Store(a.w * inv);
}

// `run`'s merge: the last CTA of the (batch, KV head), found with an atomic ticket, merges every
// column and resets the ticket to 0.
template <typename T>
__device__ __forceinline__ void TicketMerge(const Params& p, const Split& s, int* s_last) {
  // the barrier orders the CTA's partial stores before thread 0's release; the winner's acquire
  // comes before its barrier and reads
  __syncthreads();
  if (threadIdx.x == 0) *s_last = TicketAcqRel(&g_tickets[s.bh]) == unsigned(s.active - 1);
  __syncthreads();
  TRTMC_ATTN_MARK(5);
  if (!*s_last) return;
  for (int col = threadIdx.x; col < s.group * (kHeadDim / 4); col += kThreads) MergeColumn<T>(p, s, col);
  if (threadIdx.x == 0) g_tickets[s.bh] = 0;  // ready for the next launch
}

// `run_workspace`'s merge: after a grid-wide barrier (the launch is cooperative), the S CTAs of the
// (batch, KV head) merge every S-th column each; `barrier` is the same in every CTA.
template <typename T>
__device__ __forceinline__ void BarrierMerge(const Params& p, const Split& s, bool barrier) {
  if (!barrier) return;
  cooperative_groups::this_grid().sync();  // orders every CTA's partial stores before the loads
  TRTMC_ATTN_MARK(5);
  if (s.active == 1) return;  // written out by its only split
  for (int col = s.index + s.count * int(threadIdx.x); col < s.group * (kHeadDim / 4);
       col += s.count * kThreads) {
    MergeColumn<T>(p, s, col);
  }
}

// kWorkspace: `run_workspace` (partials in p.acc / p.ml, the barrier merge, a cooperative launch
// when S > 1); otherwise `run` (the static buffer, the ticket merge).
template <typename T, bool kWorkspace>
__global__ void __launch_bounds__(kThreads) SplitDecodeKernel(Params p) {
  using C = trtmc_byok::Convert<T>;
  extern __shared__ __align__(128) unsigned char smem[];
  int* s_last = reinterpret_cast<int*>(smem + kRingBytes + kQBytes);
  T* out = static_cast<T*>(p.out);
  TRTMC_ATTN_MARK(0);
  if (!kWorkspace) {
    p.acc = g_partial_acc;
    p.ml = g_partial_ml;
  }
  const Split s = SplitOf(p);
  // with one sequence the CTA's own split count decides, without reading kv_len again
  const bool barrier = kWorkspace && s.count > 1 && (p.batch == 1 ? s.active > 1 : AnyMerge(p, s.count));
  TRTMC_ATTN_MARK(1);
  if (s.index < s.active) {  // else it starts at or past len: nothing to read
    SplitPartial<T>(p, s, smem, [&](int e, float acc, float2 head) {
      if (s.active == 1) {  // one split: normalized and written out (len 0: NaN)
        out[s.head_row0 * kHeadDim + e] = C::Store(acc / head.y);
        return;
      }
      const int64_t row = (s.head_row0 + e / kHeadDim) * s.count + s.index;
      p.acc[row * kHeadDim + e % kHeadDim] = acc;
      if (e % kHeadDim == 0) p.ml[row] = head;
    });
    if (!kWorkspace && s.active > 1) TicketMerge<T>(p, s, s_last);
  }
  if (kWorkspace) BarrierMerge<T>(p, s, barrier);
  TRTMC_ATTN_MARK(6);
}

// Per device and type: the shared-memory limit raised, and the occupancy.
struct KernelFit {
  int sms = 0, ctas_per_sm = 0;
};

// `device` current for the guard's scope (the caller's device back after it, on throws too).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    cudaGetDevice(&previous_);
    if (previous_ != device) cudaSetDevice(device);
  }
  ~DeviceGuard() {
    int now = -1;
    cudaGetDevice(&now);
    if (previous_ >= 0 && now != previous_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

// The attribute and the occupancy are per device: queried with `device` current.
template <typename T, bool kWorkspace>
const KernelFit& FitOf(int device) {
  constexpr const char* kName = "decode_attention_hopper";
  constexpr int kMaxDevices = 64;
  static KernelFit fits[kMaxDevices];
  if (device < 0 || device >= kMaxDevices) {
    TVM_FFI_THROW(ValueError) << kName << ": argument 'q' is on CUDA device " << device
                              << ", expected a device index below " << kMaxDevices;
  }
  KernelFit& fit = fits[device];
  if (fit.ctas_per_sm > 0) return fit;
  const DeviceGuard on(device);
  auto* kernel = &SplitDecodeKernel<T, kWorkspace>;
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSmemBytes));
  int n = 0, count = 0;
  if (err == cudaSuccess) err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kThreads, kSmemBytes);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess || n < 1) {
    TVM_FFI_THROW(RuntimeError) << kName << ": cannot configure the kernel for " << kSmemBytes
                                << " bytes of shared memory: " << cudaGetErrorString(err);
  }
  fit.sms = count;
  fit.ctas_per_sm = n;
  return fit;
}

// Splits per (batch, KV head): about one wave of CTAs (all co-resident, as the barrier needs),
// within `rows` partial rows of scratch (fewer than 2 per query head: one split, no partials).
int64_t SplitsOf(const KernelFit& fit, int64_t batch, int64_t heads, int64_t kv_heads, int64_t capacity,
                 int64_t rows) {
  int64_t splits = fit.sms * fit.ctas_per_sm / (batch * kv_heads);
  splits = std::min<int64_t>(splits, (capacity + kAlign - 1) / kAlign);
  splits = std::min<int64_t>(splits, kMaxSplits);
  splits = std::min<int64_t>(splits, rows / (batch * heads));
  return std::max<int64_t>(splits, 1);
}

// `run`'s scratch: the static buffer, or none past the tickets' table.
int64_t StaticRows(int64_t batch, int64_t kv_heads) {
  return batch * kv_heads > kMaxTickets ? 0 : kMaxPartialRows;
}

// One call: its parameters, device, and the bytes of run_workspace's workspace (at prm.acc).
struct Call {
  Params prm;
  int device;
  int64_t workspace_bytes;  // `run_workspace` only
};

template <typename T, bool kWorkspace>
int64_t SplitsOfCall(const Call& c) {
  const Params& p = c.prm;
  const int64_t rows = kWorkspace ? c.workspace_bytes / kPartialRowBytes : StaticRows(p.batch, p.kv_heads);
  return SplitsOf(FitOf<T, kWorkspace>(c.device), p.batch, p.heads, p.kv_heads, p.capacity, rows);
}

template <typename T, bool kWorkspace>
void LaunchSplit(Call c, cudaStream_t stream, int64_t splits) {
  if (kWorkspace) {  // rows of S partials per query head, then their (max, sum) table
    const int64_t rows = int64_t(c.prm.batch) * c.prm.heads * splits;
    c.prm.ml = reinterpret_cast<float2*>(c.prm.acc + rows * kHeadDim);
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(unsigned(splits), unsigned(c.prm.batch * c.prm.kv_heads));
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = kSmemBytes;
  cfg.stream = stream;
  cudaLaunchAttribute cooperative = {};
  cooperative.id = cudaLaunchAttributeCooperative;
  cooperative.val.cooperative = 1;
  if (kWorkspace && splits > 1) {  // the barrier merge needs every CTA resident at once
    cfg.attrs = &cooperative;
    cfg.numAttrs = 1;
  }
  const cudaError_t err = cudaLaunchKernelEx(&cfg, SplitDecodeKernel<T, kWorkspace>, c.prm);
  if (err == cudaSuccess) return;
  cudaGetLastError();  // not left for the next launch's check to report
  if (err == cudaErrorCooperativeLaunchTooLarge) {  // fewer SMs than the device reports (MPS, a
    return LaunchSplit<T, kWorkspace>(c, stream, 1);  // green context): one split, no barrier
  }
  TVM_FFI_THROW(RuntimeError) << "decode_attention_hopper: CUDA launch failed: " << cudaGetErrorString(err);
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
  if (batch * kv_heads > 65535 || k.size(2) > (int64_t(1) << 30)) {
    return false;
  }
  for (const TensorView* t : {&q, &k, &v, &kv_len, &out}) {
    if (!t->IsContiguous()) return false;
  }
  return Aligned16(q) && Aligned16(k) && Aligned16(v) && Aligned16(out) &&
         reinterpret_cast<uintptr_t>(Data(kv_len)) % 4 == 0;
}

// The workspace `run_workspace` can use: a contiguous UINT8 vector on q's device, 16-byte aligned.
bool UsableWorkspace(const TensorView& w, const DLDevice& dev) {
  const DLDataType d = w.dtype();
  return OnDevice(w, dev) && d.code == kDLUInt && d.bits == 8 && d.lanes == 1 && w.ndim() == 1 &&
         w.IsContiguous() && Aligned16(w);
}

// A fast-path call on q's device and the environment stream; `workspace`: run_workspace's.
template <bool kWorkspace>
void Launch(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& kv_len,
            const TensorView* workspace, const TensorView& out) {
  Call c{{Data(q), Data(k), Data(v), static_cast<const int32_t*>(Data(kv_len)),
          const_cast<void*>(Data(out)), nullptr, nullptr, int(q.size(0)), int(q.size(1)),
          int(k.size(1)), int(q.size(1) / k.size(1)), k.size(2)},
         q.device().device_id, 0};
  if (workspace != nullptr) {
    c.prm.acc = static_cast<float*>(const_cast<void*>(Data(*workspace)));
    c.workspace_bytes = workspace->size(0);
  }
  const DeviceGuard on(c.device);
  const cudaStream_t stream = trtmc_byok::EnvStream(q);
  if (q.dtype().code == kDLBfloat) {
    LaunchSplit<__nv_bfloat16, kWorkspace>(c, stream, SplitsOfCall<__nv_bfloat16, kWorkspace>(c));
  } else {
    LaunchSplit<__half, kWorkspace>(c, stream, SplitsOfCall<__half, kWorkspace>(c));
  }
}

// launch_plan's and workspace_bytes' arguments, checked.
void CheckSizes(const char* what, int64_t batch, int64_t heads, int64_t kv_heads, int64_t capacity) {
  if (batch < 1 || kv_heads < 1 || heads < kv_heads || capacity < 1) {
    TVM_FFI_THROW(ValueError) << "decode_attention_hopper: " << what
                              << " needs batch, kv_heads, capacity >= 1 and heads >= kv_heads";
  }
}
#endif

void DecodeAttentionHopper(TensorView q, TensorView k_cache, TensorView v_cache, TensorView kv_len,
                           TensorView out) {
#ifdef __CUDACC__
  if (FastPath(q, k_cache, v_cache, kv_len, out)) {
    return Launch<false>(q, k_cache, v_cache, kv_len, nullptr, out);
  }
#endif
  trtmc_reference::DecodeAttention(q, k_cache, v_cache, kv_len, out);
}

void DecodeAttentionHopperWorkspace(TensorView q, TensorView k_cache, TensorView v_cache,
                                    TensorView kv_len, TensorView workspace, TensorView out) {
#ifdef __CUDACC__
  if (FastPath(q, k_cache, v_cache, kv_len, out) && UsableWorkspace(workspace, q.device())) {
    return Launch<true>(q, k_cache, v_cache, kv_len, &workspace, out);
  }
#endif
  trtmc_reference::DecodeAttention(q, k_cache, v_cache, kv_len, out);
}

// The splits per (batch, KV head) a CUDA call of these sizes launches on `device`, and the
// figures they follow from, e.g. "splits=16 sms=132 ctas_per_sm=1" (for benchmarks and reports):
// of run_workspace with a workspace of `workspace_bytes`, or of `run` when that is 0.
tvm::ffi::String LaunchPlan(int64_t device, int64_t batch, int64_t heads, int64_t kv_heads,
                            int64_t capacity, int64_t workspace_bytes) {
#ifdef __CUDACC__
  CheckSizes("launch_plan", batch, heads, kv_heads, capacity);
  const bool ws = workspace_bytes > 0;
  const KernelFit& fit = ws ? FitOf<__nv_bfloat16, true>(int(device)) : FitOf<__nv_bfloat16, false>(int(device));
  const int64_t rows = ws ? workspace_bytes / kPartialRowBytes : StaticRows(batch, kv_heads);
  std::ostringstream os;
  os << "splits=" << SplitsOf(fit, batch, heads, kv_heads, capacity, rows) << " sms=" << fit.sms
     << " ctas_per_sm=" << fit.ctas_per_sm;
  return os.str();
#else
  TVM_FFI_THROW(RuntimeError) << "decode_attention_hopper: launch_plan needs the CUDA build";
  return "";
#endif
}

// The workspace run_workspace needs on `device` for all the splits of a call of these sizes (a
// selection's --workspace-bytes); more is unused, less caps the splits.
int64_t WorkspaceBytes(int64_t device, int64_t batch, int64_t heads, int64_t kv_heads, int64_t capacity) {
#ifdef __CUDACC__
  CheckSizes("workspace_bytes", batch, heads, kv_heads, capacity);
  const KernelFit& fit = FitOf<__nv_bfloat16, true>(int(device));
  const int64_t unbounded = std::numeric_limits<int64_t>::max();
  return SplitsOf(fit, batch, heads, kv_heads, capacity, unbounded) * batch * heads * kPartialRowBytes;
#else
  TVM_FFI_THROW(RuntimeError) << "decode_attention_hopper: workspace_bytes needs the CUDA build";
  return 0;
#endif
}

}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(run, DecodeAttentionHopper);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(run_workspace, DecodeAttentionHopperWorkspace);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(launch_plan, LaunchPlan);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(workspace_bytes, WorkspaceBytes);
