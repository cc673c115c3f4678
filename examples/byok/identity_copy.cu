// identity_copy: run(input, output) copies input into output.
// The smallest useful slot kernel: FP32, FP16, BF16 or INT32, same shape and dtype, contiguous.
// CPU path always; CUDA path when built with nvcc, launched on the TVM-FFI environment stream.
#include "trtmc_kernel.h"

namespace {

using trtmc_byok::TensorView;

#ifdef __CUDACC__
// Copies whole elements; T is any type of the element's width.
template <typename T>
__global__ void CopyKernel(const T* __restrict__ in, T* __restrict__ out, int64_t n) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) out[i] = in[i];
}

template <typename T>
void LaunchCopy(const TensorView& input, const TensorView& output) {
  const int64_t n = input.numel();
  constexpr unsigned kBlock = 256;
  CopyKernel<T><<<trtmc_byok::GridFor(n, kBlock), kBlock, 0, trtmc_byok::EnvStream(input)>>>(
      static_cast<const T*>(input.data_ptr()), static_cast<T*>(output.data_ptr()), n);
  trtmc_byok::CheckLaunch("identity_copy");
}
#endif

void IdentityCopy(TensorView input, TensorView output) {
  constexpr const char* kName = "identity_copy";
  const trtmc_byok::DType dtype = trtmc_byok::CheckDType(kName, "input", input, /*allow_int32=*/true);
  trtmc_byok::CheckLike(kName, "output", output, "input", input);
  const int64_t n = input.numel();
  if (n == 0) return;
  const bool wide = dtype == trtmc_byok::DType::kFP32 || dtype == trtmc_byok::DType::kINT32;
  if (trtmc_byok::CheckBackend(kName, input) == trtmc_byok::Backend::kCPU) {
    std::memcpy(output.data_ptr(), input.data_ptr(), size_t(n) * (wide ? 4 : 2));
    return;
  }
#ifdef __CUDACC__
  if (wide) {
    LaunchCopy<uint32_t>(input, output);
  } else {
    LaunchCopy<uint16_t>(input, output);
  }
#endif
}

}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(run, IdentityCopy);
