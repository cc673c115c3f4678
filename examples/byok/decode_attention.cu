// decode_attention: run(q, k_cache, v_cache, kv_len, out), the reference kernel for the recipe
// `qwen.decode_attention_region@2` (one Qwen3 layer's attention in the decode engine).
//
//   q        [B, Hq, Sq, D]   FP16/BF16/FP32, already scaled by D^-0.5 (softmax scale 1.0)
//   k_cache  [B, Hkv, C, D]   same dtype; Hq is a multiple of Hkv (grouped-query attention:
//   v_cache  [B, Hkv, C, D]   query head h reads key/value head h / (Hq / Hkv))
//   kv_len   [B]              INT32: keys 0 .. kv_len[b]-1 are used, the rest of the cache is padding
//   out      [B, Hq, Sq, D]   softmax(q k^T) v, no causal mask (decode: Sq = 1)
//
// Scores, softmax and the weighted sum accumulate in float; the output is rounded once.
// CPU path always; CUDA path when built with nvcc: one block of 4 warps per query row, keys
// striped over the warps with an online softmax, head dims over the lanes; launched on the
// TVM-FFI environment stream, never synchronizing (kv_len stays on the device).
#include <algorithm>
#include <cmath>
#include <vector>

#include "trtmc_kernel.h"

namespace {

using trtmc_byok::TensorView;


struct Dims {
  int64_t batch, heads, kv_heads, sq, capacity, head_dim;
};

template <typename T>
void AttendCPU(const Dims& d, const T* q, const T* k, const T* v, const int32_t* kv_len, T* out) {
  using C = trtmc_byok::Convert<T>;
  const int64_t group = d.heads / d.kv_heads;
  std::vector<float> scores(size_t(d.capacity)), acc(size_t(d.head_dim));
  for (int64_t b = 0; b < d.batch; ++b) {
    const int64_t len = std::min<int64_t>(kv_len[b], d.capacity);
    for (int64_t h = 0; h < d.heads; ++h) {
      const int64_t kv_base = ((b * d.kv_heads) + h / group) * d.capacity * d.head_dim;
      for (int64_t i = 0; i < d.sq; ++i) {
        const int64_t row = ((b * d.heads + h) * d.sq + i) * d.head_dim;
        float max_score = -INFINITY;
        for (int64_t j = 0; j < len; ++j) {
          float s = 0.f;
          for (int64_t x = 0; x < d.head_dim; ++x) {
            s += C::Load(q[row + x]) * C::Load(k[kv_base + j * d.head_dim + x]);
          }
          scores[size_t(j)] = s;
          max_score = std::max(max_score, s);
        }
        std::fill(acc.begin(), acc.end(), 0.f);
        float total = 0.f;
        for (int64_t j = 0; j < len; ++j) {
          const float p = std::exp(scores[size_t(j)] - max_score);
          total += p;
          for (int64_t x = 0; x < d.head_dim; ++x) acc[size_t(x)] += p * C::Load(v[kv_base + j * d.head_dim + x]);
        }
        for (int64_t x = 0; x < d.head_dim; ++x) out[row + x] = C::Store(acc[size_t(x)] / total);
      }
    }
  }
}

#ifdef __CUDACC__
constexpr int kMaxHeadDim = 256;
constexpr int kWarps = 4;
constexpr int kPerLane = kMaxHeadDim / 32;

template <typename T>
__global__ void AttendKernel(Dims d, const T* __restrict__ q, const T* __restrict__ k,
                             const T* __restrict__ v, const int32_t* __restrict__ kv_len,
                             T* __restrict__ out) {
  using C = trtmc_byok::Convert<T>;
  const int64_t row_index = blockIdx.x;  // (b, h, i)
  const int64_t i = row_index % d.sq, h = (row_index / d.sq) % d.heads, b = row_index / (d.sq * d.heads);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int per_lane = int(d.head_dim / 32);
  const int64_t kv_base = ((b * d.kv_heads) + h / (d.heads / d.kv_heads)) * d.capacity * d.head_dim;
  const int64_t row = row_index * d.head_dim;
  const int64_t len = min(int64_t(kv_len[b]), d.capacity);

  float qv[kPerLane], acc[kPerLane];
  for (int x = 0; x < per_lane; ++x) {
    qv[x] = C::Load(q[row + lane + 32 * x]);
    acc[x] = 0.f;
  }
  float m = -INFINITY, l = 0.f;
  for (int64_t j = warp; j < len; j += kWarps) {
    const T* kj = k + kv_base + j * d.head_dim;
    float s = 0.f;
    for (int x = 0; x < per_lane; ++x) s += qv[x] * C::Load(kj[lane + 32 * x]);
    for (int off = 16; off > 0; off /= 2) s += __shfl_xor_sync(0xffffffffu, s, off);
    const float m_new = fmaxf(m, s);
    const float correction = __expf(m - m_new), p = __expf(s - m_new);
    const T* vj = v + kv_base + j * d.head_dim;
    for (int x = 0; x < per_lane; ++x) acc[x] = acc[x] * correction + p * C::Load(vj[lane + 32 * x]);
    l = l * correction + p;
    m = m_new;
  }

  __shared__ float s_m[kWarps], s_l[kWarps], s_acc[kWarps][kMaxHeadDim];
  if (lane == 0) {
    s_m[warp] = m;
    s_l[warp] = l;
  }
  for (int x = 0; x < per_lane; ++x) s_acc[warp][lane + 32 * x] = acc[x];
  __syncthreads();
  float m_all = -INFINITY;
  for (int w = 0; w < kWarps; ++w) m_all = fmaxf(m_all, s_m[w]);
  for (int64_t x = threadIdx.x; x < d.head_dim; x += blockDim.x) {
    float num = 0.f, den = 0.f;
    for (int w = 0; w < kWarps; ++w) {
      const float scale = s_l[w] > 0.f ? __expf(s_m[w] - m_all) : 0.f;  // empty stripes add nothing
      num += s_acc[w][x] * scale;
      den += s_l[w] * scale;
    }
    out[row + x] = C::Store(num / den);
  }
}

template <typename T>
void LaunchAttend(const Dims& d, const TensorView& q, const TensorView& k, const TensorView& v,
                  const TensorView& kv_len, const TensorView& out) {
  const int64_t rows = d.batch * d.heads * d.sq;
  if (rows == 0) return;
  AttendKernel<T><<<unsigned(rows), kWarps * 32, 0, trtmc_byok::EnvStream(q)>>>(
      d, static_cast<const T*>(q.data_ptr()), static_cast<const T*>(k.data_ptr()),
      static_cast<const T*>(v.data_ptr()), static_cast<const int32_t*>(kv_len.data_ptr()),
      static_cast<T*>(out.data_ptr()));
  trtmc_byok::CheckLaunch("decode_attention");
}
#endif

void DecodeAttention(TensorView q, TensorView k_cache, TensorView v_cache, TensorView kv_len,
                     TensorView out) {
  constexpr const char* kName = "decode_attention";
  const trtmc_byok::DType dtype = trtmc_byok::CheckDType(kName, "q", q, /*allow_int32=*/false);
  trtmc_byok::CheckLike(kName, "out", out, "q", q);
  trtmc_byok::CheckLike(kName, "v_cache", v_cache, "k_cache", k_cache);
  trtmc_byok::CheckDType(kName, "k_cache", k_cache, /*allow_int32=*/false);
  if (q.ndim() != 4 || k_cache.ndim() != 4) {
    TVM_FFI_THROW(ValueError) << kName << ": q " << trtmc_byok::ShapeString(q) << " and k_cache "
                              << trtmc_byok::ShapeString(k_cache) << " must be rank 4 [B, H, S, D]";
  }
  const Dims d{q.size(0), q.size(1), k_cache.size(1), q.size(2), k_cache.size(2), q.size(3)};
  const DLDataType qd = q.dtype(), kd = k_cache.dtype(), ld = kv_len.dtype();
  if (qd.code != kd.code || qd.bits != kd.bits || k_cache.size(0) != d.batch ||
      k_cache.size(3) != d.head_dim || d.kv_heads == 0 || d.heads % d.kv_heads != 0) {
    TVM_FFI_THROW(ValueError) << kName << ": k_cache " << trtmc_byok::ShapeString(k_cache)
                              << " does not fit q " << trtmc_byok::ShapeString(q)
                              << " (same dtype, batch and head dim; query heads a multiple of "
                              << "key/value heads)";
  }
  if (ld.code != kDLInt || ld.bits != 32 || kv_len.ndim() != 1 || kv_len.size(0) != d.batch) {
    TVM_FFI_THROW(TypeError) << kName << ": kv_len must be int32 [" << d.batch << "], got " << ld
                             << " " << trtmc_byok::ShapeString(kv_len);
  }
  for (const TensorView* t : {&q, &k_cache, &kv_len}) {
    if (!t->IsContiguous()) TVM_FFI_THROW(ValueError) << kName << ": inputs must be contiguous";
    if (t->device().device_type != q.device().device_type) {
      TVM_FFI_THROW(ValueError) << kName << ": all arguments must be on one device";
    }
  }
  if (trtmc_byok::CheckBackend(kName, q) == trtmc_byok::Backend::kCPU) {
    const int32_t* lengths = static_cast<const int32_t*>(kv_len.data_ptr());
    for (int64_t b = 0; b < d.batch; ++b) {
      if (lengths[b] < 1 || lengths[b] > d.capacity) {
        TVM_FFI_THROW(ValueError) << kName << ": kv_len[" << b << "] = " << lengths[b]
                                  << ", expected 1.." << d.capacity;
      }
    }
    trtmc_byok::DispatchHostFloat(dtype, [&](auto tag) {
      using T = decltype(tag);
      AttendCPU<T>(d, static_cast<const T*>(q.data_ptr()), static_cast<const T*>(k_cache.data_ptr()),
                   static_cast<const T*>(v_cache.data_ptr()), lengths, static_cast<T*>(out.data_ptr()));
    });
    return;
  }
#ifdef __CUDACC__
  if (d.head_dim > kMaxHeadDim || d.head_dim % 32 != 0) {
    TVM_FFI_THROW(ValueError) << kName << ": head dim " << d.head_dim << " must be a multiple of "
                              << "32 and at most " << kMaxHeadDim << " on CUDA";
  }
  trtmc_byok::DispatchDeviceFloat(dtype, [&](auto tag) {
    LaunchAttend<decltype(tag)>(d, q, k_cache, v_cache, kv_len, out);
  });
#endif
}

}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(run, DecodeAttention);
