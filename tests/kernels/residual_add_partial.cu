// Deliberately wrong: out = a + b for the first half of the elements only; the rest is never
// written. The probe's output_fully_written check must refuse it.
#define TRTMC_RESIDUAL_ADD_NO_EXPORT
#include "../../examples/byok/residual_add.cu"

namespace {
void ResidualAddPartial(TensorView a, TensorView b, TensorView out) {
  const char* name = "residual_add_partial";
  const trtmc_byok::DType dtype = trtmc_byok::CheckDType(name, "a", a, /*allow_int32=*/false);
  trtmc_byok::CheckLike(name, "b", b, "a", a);
  trtmc_byok::CheckLike(name, "out", out, "a", a);
  const int64_t half = a.numel() / 2;
  if (trtmc_byok::CheckBackend(name, a) == trtmc_byok::Backend::kCPU) {
    trtmc_byok::DispatchHostFloat(dtype, [&](auto tag) {
      using T = decltype(tag);
      BinaryHost(static_cast<const T*>(a.data_ptr()), static_cast<const T*>(b.data_ptr()),
                 static_cast<T*>(out.data_ptr()), half, AddOp{});
    });
    return;
  }
#ifdef __CUDACC__
  trtmc_byok::DispatchDeviceFloat(dtype, [&](auto tag) {
    using T = decltype(tag);
    BinaryKernel<T><<<trtmc_byok::GridFor(half, 256), 256, 0, trtmc_byok::EnvStream(a)>>>(
        static_cast<const T*>(a.data_ptr()), static_cast<const T*>(b.data_ptr()),
        static_cast<T*>(out.data_ptr()), half, /*aligned=*/false, AddOp{});
    trtmc_byok::CheckLaunch(name);
  });
#endif
}
}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(run, ResidualAddPartial);
