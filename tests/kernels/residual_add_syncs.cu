// Deliberately wrong on CUDA: a right out = a + b on the caller's stream, then it waits for that
// stream on the host (cudaStreamSynchronize), which no CUDA graph can capture. The probe's
// graph_capturable check must refuse it. On a CPU it is a plain residual add.
#define TRTMC_RESIDUAL_ADD_NO_EXPORT
#include "../../examples/byok/residual_add.cu"

namespace {
void ResidualAddSyncs(TensorView a, TensorView b, TensorView out) {
  Binary("residual_add_syncs", a, b, out, AddOp{});
#ifdef __CUDACC__
  if (a.device().device_type == kDLCUDA) {
    const cudaError_t err = cudaStreamSynchronize(trtmc_byok::EnvStream(a));
    if (err != cudaSuccess) {
      TVM_FFI_THROW(RuntimeError) << "residual_add_syncs: " << cudaGetErrorString(err);
    }
  }
#endif
}
}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(run, ResidualAddSyncs);
