// Deliberately wrong: out = a + b + 0.05 everywhere, inside a 1%-of-max|expected| tolerance but
// far outside atol + rtol * |expected|. The probe's within_tolerance check must refuse it.
#define TRTMC_RESIDUAL_ADD_NO_EXPORT
#include "../../examples/byok/residual_add.cu"

namespace {
struct OffOp {
  TRTMC_HD float operator()(float x, float y) const { return x + y + 0.05f; }
};

void ResidualAddOff(TensorView a, TensorView b, TensorView out) { Binary("residual_add_off", a, b, out, OffOp{}); }
}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(run, ResidualAddOff);
