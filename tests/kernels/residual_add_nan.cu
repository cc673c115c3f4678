// Deliberately wrong: out = a + b, except one element (the middle one) written as NaN. The
// probe's finite_where_native_is check must refuse it.
#define TRTMC_RESIDUAL_ADD_NO_EXPORT
#include "../../examples/byok/residual_add.cu"

#include <cmath>

namespace {
struct NanOp {
  TRTMC_HD float operator()(float, float) const { return NAN; }
};

void ResidualAddNan(TensorView a, TensorView b, TensorView out) {
  const char* name = "residual_add_nan";
  Binary(name, a, b, out, AddOp{});
  if (a.numel() == 0) return;
  const int64_t i = a.numel() / 2;
  const trtmc_byok::DType dtype = trtmc_byok::CheckDType(name, "a", a, /*allow_int32=*/false);
  if (trtmc_byok::CheckBackend(name, a) == trtmc_byok::Backend::kCPU) {
    trtmc_byok::DispatchHostFloat(dtype, [&](auto tag) {
      using T = decltype(tag);
      BinaryHost(static_cast<const T*>(a.data_ptr()) + i, static_cast<const T*>(b.data_ptr()) + i,
                 static_cast<T*>(out.data_ptr()) + i, 1, NanOp{});
    });
    return;
  }
#ifdef __CUDACC__
  trtmc_byok::DispatchDeviceFloat(dtype, [&](auto tag) {
    using T = decltype(tag);
    BinaryKernel<T><<<1, 1, 0, trtmc_byok::EnvStream(a)>>>(
        static_cast<const T*>(a.data_ptr()) + i, static_cast<const T*>(b.data_ptr()) + i,
        static_cast<T*>(out.data_ptr()) + i, 1, /*aligned=*/false, NanOp{});
    trtmc_byok::CheckLaunch(name);
  });
#endif
}
}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(run, ResidualAddNan);
