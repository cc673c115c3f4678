// Helpers shared by the BYOK example kernels, so each kernel file holds only its own math:
// argument checks that raise clear TVM-FFI errors, fp16/bf16 <-> float on the host, dtype
// dispatch, and the TVM-FFI environment stream for CUDA launches.
//
// Compiles as plain C++ (g++: CPU path only) or as CUDA (nvcc: CPU and CUDA paths).
#pragma once

#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/dtype.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>

#include <cstdint>
#include <cstring>
#include <sstream>
#include <string>

#ifdef __CUDACC__
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#define TRTMC_HD __host__ __device__
#else
#define TRTMC_HD
#endif

namespace trtmc_byok {

using tvm::ffi::TensorView;

enum class DType { kFP32, kFP16, kBF16, kINT32 };
enum class Backend { kCPU, kCUDA };

inline std::string ShapeString(const TensorView& t) {
  std::ostringstream os;
  os << "[";
  for (int32_t i = 0; i < t.ndim(); ++i) os << (i ? ", " : "") << t.size(i);
  os << "]";
  return os.str();
}

// The dtype of `t`, or a TypeError naming the kernel and argument.
inline DType CheckDType(const char* kernel, const char* arg, const TensorView& t, bool allow_int32) {
  const DLDataType d = t.dtype();
  if (d.lanes == 1) {
    if (d.code == kDLFloat && d.bits == 32) return DType::kFP32;
    if (d.code == kDLFloat && d.bits == 16) return DType::kFP16;
    if (d.code == kDLBfloat && d.bits == 16) return DType::kBF16;
    if (allow_int32 && d.code == kDLInt && d.bits == 32) return DType::kINT32;
  }
  TVM_FFI_THROW(TypeError) << kernel << ": argument '" << arg << "' has dtype " << d
                           << ", expected float32, float16, bfloat16"
                           << (allow_int32 ? " or int32" : "");
  return DType::kFP32;  // unreachable
}

// `t` must match `ref` in dtype, shape and device, and both must be contiguous.
inline void CheckLike(const char* kernel, const char* arg, const TensorView& t, const char* ref_name,
                      const TensorView& ref) {
  const DLDataType d = t.dtype(), rd = ref.dtype();
  if (d.code != rd.code || d.bits != rd.bits || d.lanes != rd.lanes) {
    TVM_FFI_THROW(TypeError) << kernel << ": argument '" << arg << "' has dtype " << d
                             << ", expected " << rd << " like '" << ref_name << "'";
  }
  bool same_shape = t.ndim() == ref.ndim();
  for (int32_t i = 0; same_shape && i < t.ndim(); ++i) same_shape = t.size(i) == ref.size(i);
  if (!same_shape) {
    TVM_FFI_THROW(ValueError) << kernel << ": argument '" << arg << "' has shape " << ShapeString(t)
                              << ", expected " << ShapeString(ref) << " like '" << ref_name << "'";
  }
  if (t.device().device_type != ref.device().device_type ||
      t.device().device_id != ref.device().device_id) {
    TVM_FFI_THROW(ValueError) << kernel << ": argument '" << arg << "' is on device ("
                              << t.device().device_type << ", " << t.device().device_id
                              << "), expected the device of '" << ref_name << "'";
  }
  for (const auto* v : {&t, &ref}) {
    if (!v->IsContiguous()) {
      TVM_FFI_THROW(ValueError) << kernel << ": argument '" << (v == &t ? arg : ref_name)
                                << "' is not contiguous";
    }
  }
}

// CPU or CUDA; CUDA tensors need a build with nvcc (`trtmc kernel build --cuda`).
inline Backend CheckBackend(const char* kernel, const TensorView& t) {
  switch (t.device().device_type) {
    case kDLCPU:
      return Backend::kCPU;
    case kDLCUDA:
#ifdef __CUDACC__
      return Backend::kCUDA;
#else
      TVM_FFI_THROW(RuntimeError) << kernel << ": got a CUDA tensor but this library was built "
                                  << "without CUDA (rebuild with `trtmc kernel build --cuda`)";
#endif
    default:
      TVM_FFI_THROW(ValueError) << kernel << ": unsupported device type " << t.device().device_type
                                << ", expected CPU or CUDA";
  }
  return Backend::kCPU;  // unreachable
}

// Host storage types for the 16-bit floats (the CUDA path uses __half / __nv_bfloat16).
struct HostHalf { uint16_t bits; };
struct HostBF16 { uint16_t bits; };

// Convert<T>::Load widens to float; Store rounds once, to nearest even.
template <typename T>
struct Convert;

template <>
struct Convert<float> {
  static TRTMC_HD float Load(float x) { return x; }
  static TRTMC_HD float Store(float x) { return x; }
};

template <>
struct Convert<HostBF16> {
  static float Load(HostBF16 x) {
    const uint32_t u = uint32_t(x.bits) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
  }
  static HostBF16 Store(float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return {uint16_t((u >> 16) | 0x40u)};  // quiet NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return {uint16_t(u >> 16)};
  }
};

template <>
struct Convert<HostHalf> {
  static float Load(HostHalf x) {
    const uint32_t sign = uint32_t(x.bits & 0x8000u) << 16;
    const uint32_t exp = (x.bits >> 10) & 0x1fu, mant = x.bits & 0x3ffu;
    uint32_t u;
    if (exp == 0x1f) {
      u = sign | 0x7f800000u | (mant << 13);
    } else if (exp != 0) {
      u = sign | ((exp + 112u) << 23) | (mant << 13);
    } else {  // zero or subnormal: mant * 2^-24, exact in float
      const float f = float(mant) * (1.0f / 16777216.0f);
      return sign ? -f : f;
    }
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
  }
  static HostHalf Store(float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    const uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t mant = u & 0x7fffffu;
    const int32_t exp = int32_t((u >> 23) & 0xffu);
    if (exp == 0xff) return {uint16_t(sign | 0x7c00u | (mant ? 0x200u | (mant >> 13) : 0u))};
    const int32_t e = exp - 127 + 15;
    if (e >= 0x1f) return {uint16_t(sign | 0x7c00u)};  // overflow to infinity
    if (e <= 0) {                                     // subnormal half (or zero)
      if (e < -10) return {uint16_t(sign)};
      mant |= 0x800000u;
      const int shift = 14 - e;
      uint32_t h = mant >> shift;
      const uint32_t rem = mant & ((1u << shift) - 1u), half = 1u << (shift - 1);
      if (rem > half || (rem == half && (h & 1u))) ++h;
      return {uint16_t(sign | h)};
    }
    uint32_t h = sign | (uint32_t(e) << 10) | (mant >> 13);
    const uint32_t rem = mant & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // a carry rolls into the exponent
    return {uint16_t(h)};
  }
};

// Calls f(T{}) with T the host storage type of a floating dtype.
template <typename F>
void DispatchHostFloat(DType d, F&& f) {
  switch (d) {
    case DType::kFP32: f(float{}); return;
    case DType::kFP16: f(HostHalf{}); return;
    case DType::kBF16: f(HostBF16{}); return;
    default: TVM_FFI_THROW(InternalError) << "not a floating dtype";
  }
}

#ifdef __CUDACC__
template <>
struct Convert<__half> {
  static __device__ float Load(__half x) { return __half2float(x); }
  static __device__ __half Store(float x) { return __float2half_rn(x); }
};

template <>
struct Convert<__nv_bfloat16> {
  static __device__ float Load(__nv_bfloat16 x) { return __bfloat162float(x); }
  static __device__ __nv_bfloat16 Store(float x) { return __float2bfloat16_rn(x); }
};

// Calls f(T{}) with T the device type of a floating dtype.
template <typename F>
void DispatchDeviceFloat(DType d, F&& f) {
  switch (d) {
    case DType::kFP32: f(float{}); return;
    case DType::kFP16: f(__half{}); return;
    case DType::kBF16: f(__nv_bfloat16{}); return;
    default: TVM_FFI_THROW(InternalError) << "not a floating dtype";
  }
}

// The stream the caller set for this device (torch's current stream when called from torch).
inline cudaStream_t EnvStream(const TensorView& t) {
  return static_cast<cudaStream_t>(TVMFFIEnvGetStream(t.device().device_type, t.device().device_id));
}

// A grid for a grid-stride loop over n items: enough blocks to fill the GPU, not one per item.
inline unsigned GridFor(int64_t n, unsigned block) {
  const int64_t blocks = (n + block - 1) / block;
  return unsigned(blocks < 4096 ? blocks : 4096);
}

inline void CheckLaunch(const char* kernel) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    TVM_FFI_THROW(RuntimeError) << kernel << ": CUDA launch failed: " << cudaGetErrorString(err);
  }
}
#endif

}  // namespace trtmc_byok
