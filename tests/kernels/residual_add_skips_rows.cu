// Deliberately wrong: writes nothing when its inputs have 20 to 100 rows (the leading dims'
// product), shapes a probe of the profile's min, opt and max alone never tries. CPU only.
#define TRTMC_RESIDUAL_ADD_NO_EXPORT
#include "../../examples/byok/residual_add.cu"

namespace {
void ResidualAddSkipsRows(TensorView a, TensorView b, TensorView out) {
  const int64_t rows = a.numel() / a.size(a.ndim() - 1);
  if (rows >= 20 && rows <= 100) return;
  Binary("residual_add_skips_rows", a, b, out, AddOp{});
}
}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(run, ResidualAddSkipsRows);
