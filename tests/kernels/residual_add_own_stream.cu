// Deliberately wrong on CUDA: out = a + b launched on a private non-blocking stream, never ordered
// on the caller's (TVM-FFI environment) stream. The probe's ordered_on_stream and
// graph_capturable checks must refuse it. On a CPU it is a plain residual add.
#define TRTMC_RESIDUAL_ADD_NO_EXPORT
#include "../../examples/byok/residual_add.cu"

namespace {
void ResidualAddOwnStream(TensorView a, TensorView b, TensorView out) {
  const char* name = "residual_add_own_stream";
  if (trtmc_byok::CheckBackend(name, a) == trtmc_byok::Backend::kCPU) {
    Binary(name, a, b, out, AddOp{});
    return;
  }
#ifdef __CUDACC__
  const trtmc_byok::DType dtype = trtmc_byok::CheckDType(name, "a", a, /*allow_int32=*/false);
  static cudaStream_t own = [] {
    cudaStream_t s;
    cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    return s;
  }();
  trtmc_byok::DispatchDeviceFloat(dtype, [&](auto tag) {
    using T = decltype(tag);
    BinaryKernel<T><<<trtmc_byok::GridFor(a.numel(), 256), 256, 0, own>>>(
        static_cast<const T*>(a.data_ptr()), static_cast<const T*>(b.data_ptr()),
        static_cast<T*>(out.data_ptr()), a.numel(), /*aligned=*/false, AddOp{});
    trtmc_byok::CheckLaunch(name);
  });
#endif
}
}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(run, ResidualAddOwnStream);
