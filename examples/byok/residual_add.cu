// residual_add: run(a, b, out) writes out = a + b, elementwise.
// FP32, FP16 or BF16; all three the same dtype and shape, contiguous. 16-bit inputs are added
// in float and rounded once (what torch does). CPU path always; CUDA path when built with nvcc,
// launched on the TVM-FFI environment stream, 16-byte vector loads when the pointers allow.
//
// `Binary` takes the operation as a parameter so that tests/kernels/ can derive deliberately
// broken variants from this file (define TRTMC_RESIDUAL_ADD_NO_EXPORT, export their own `run`).
#include "trtmc_kernel.h"

#include <type_traits>
#if defined(__x86_64__) && !defined(__CUDACC__)
#include <immintrin.h>
#endif

namespace {

using trtmc_byok::Convert;
using trtmc_byok::TensorView;

struct AddOp {
  TRTMC_HD float operator()(float x, float y) const { return x + y; }
};

template <typename T, typename Op>
void BinaryScalar(const T* a, const T* b, T* out, int64_t n, Op op) {
  for (int64_t i = 0; i < n; ++i) {
    out[i] = Convert<T>::Store(op(Convert<T>::Load(a[i]), Convert<T>::Load(b[i])));
  }
}

#if defined(__x86_64__) && !defined(__CUDACC__)
// FP16 on x86-64 CPUs with F16C: hardware conversions, 8 lanes at a time, round to nearest even
// like the scalar path (which is about 25x slower: its conversions are branchy bit arithmetic).
template <typename Op>
__attribute__((target("avx,f16c"))) void BinaryHalfF16C(const uint16_t* a, const uint16_t* b,
                                                        uint16_t* out, int64_t n, Op op) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    alignas(32) float fa[8], fb[8], fo[8];
    _mm256_store_ps(fa, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a + i))));
    _mm256_store_ps(fb, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + i))));
    for (int k = 0; k < 8; ++k) fo[k] = op(fa[k], fb[k]);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     _mm256_cvtps_ph(_mm256_load_ps(fo), _MM_FROUND_TO_NEAREST_INT));
  }
  using H = trtmc_byok::HostHalf;
  BinaryScalar(reinterpret_cast<const H*>(a + i), reinterpret_cast<const H*>(b + i),
               reinterpret_cast<H*>(out + i), n - i, op);
}
#endif

template <typename T, typename Op>
void BinaryHost(const T* a, const T* b, T* out, int64_t n, Op op) {
#if defined(__x86_64__) && !defined(__CUDACC__)
  if constexpr (std::is_same_v<T, trtmc_byok::HostHalf>) {
    if (__builtin_cpu_supports("f16c")) {
      BinaryHalfF16C(reinterpret_cast<const uint16_t*>(a), reinterpret_cast<const uint16_t*>(b),
                     reinterpret_cast<uint16_t*>(out), n, op);
      return;
    }
  }
#endif
  BinaryScalar(a, b, out, n, op);
}

#ifdef __CUDACC__
template <typename T, typename Op>
__global__ void BinaryKernel(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ out,
                             int64_t n, bool aligned, Op op) {
  constexpr int kVec = 16 / sizeof(T);
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t nvec = aligned ? n / kVec : 0;
  for (int64_t v = tid; v < nvec; v += stride) {
    const uint4 ra = reinterpret_cast<const uint4*>(a)[v];
    const uint4 rb = reinterpret_cast<const uint4*>(b)[v];
    uint4 ro;
    const T* ea = reinterpret_cast<const T*>(&ra);
    const T* eb = reinterpret_cast<const T*>(&rb);
    T* eo = reinterpret_cast<T*>(&ro);
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      eo[k] = Convert<T>::Store(op(Convert<T>::Load(ea[k]), Convert<T>::Load(eb[k])));
    }
    reinterpret_cast<uint4*>(out)[v] = ro;
  }
  for (int64_t i = nvec * kVec + tid; i < n; i += stride) {
    out[i] = Convert<T>::Store(op(Convert<T>::Load(a[i]), Convert<T>::Load(b[i])));
  }
}
#endif

// Checks the arguments, then applies op elementwise on the tensors' device.
template <typename Op>
void Binary(const char* name, TensorView a, TensorView b, TensorView out, Op op) {
  const trtmc_byok::DType dtype = trtmc_byok::CheckDType(name, "a", a, /*allow_int32=*/false);
  trtmc_byok::CheckLike(name, "b", b, "a", a);
  trtmc_byok::CheckLike(name, "out", out, "a", a);
  const int64_t n = a.numel();
  if (n == 0) return;
  if (trtmc_byok::CheckBackend(name, a) == trtmc_byok::Backend::kCPU) {
    trtmc_byok::DispatchHostFloat(dtype, [&](auto tag) {
      using T = decltype(tag);
      BinaryHost(static_cast<const T*>(a.data_ptr()), static_cast<const T*>(b.data_ptr()),
                 static_cast<T*>(out.data_ptr()), n, op);
    });
    return;
  }
#ifdef __CUDACC__
  const bool aligned = ((reinterpret_cast<uintptr_t>(a.data_ptr()) |
                         reinterpret_cast<uintptr_t>(b.data_ptr()) |
                         reinterpret_cast<uintptr_t>(out.data_ptr())) % 16) == 0;
  trtmc_byok::DispatchDeviceFloat(dtype, [&](auto tag) {
    using T = decltype(tag);
    constexpr unsigned kBlock = 256;
    const int64_t work = aligned ? (n + 16 / sizeof(T) - 1) / (16 / sizeof(T)) : n;
    BinaryKernel<T><<<trtmc_byok::GridFor(work, kBlock), kBlock, 0, trtmc_byok::EnvStream(a)>>>(
        static_cast<const T*>(a.data_ptr()), static_cast<const T*>(b.data_ptr()),
        static_cast<T*>(out.data_ptr()), n, aligned, op);
    trtmc_byok::CheckLaunch(name);
  });
#endif
}

}  // namespace

#ifndef TRTMC_RESIDUAL_ADD_NO_EXPORT
namespace {
void ResidualAdd(TensorView a, TensorView b, TensorView out) { Binary("residual_add", a, b, out, AddOp{}); }
}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(run, ResidualAdd);
#endif
