// Deliberately hostile: on CUDA its first call launches a kernel that never finishes (the host call
// itself returns at once); later calls add. CPU calls add.
#define TRTMC_RESIDUAL_ADD_NO_EXPORT
#include "../../examples/byok/residual_add.cu"

namespace {
#ifdef __CUDACC__
__device__ int g_never;  // stays 0

__global__ void Spin(volatile int* never) {
  while (*never == 0) {
  }
}

bool first_call = true;
#endif

void ResidualAddGpuHang(TensorView a, TensorView b, TensorView out) {
#ifdef __CUDACC__
  if (first_call && trtmc_byok::CheckBackend("residual_add_gpu_hang", out) ==
                        trtmc_byok::Backend::kCUDA) {
    first_call = false;
    int* never = nullptr;
    cudaGetSymbolAddress(reinterpret_cast<void**>(&never), g_never);
    Spin<<<1, 1, 0, trtmc_byok::EnvStream(out)>>>(never);
  }
#endif
  Binary("residual_add_gpu_hang", a, b, out, AddOp{});
}
}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(run, ResidualAddGpuHang);
