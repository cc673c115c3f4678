// Deliberately wrong: a right out = a + b, but it uses `b` as scratch (b = a + b, then out = b),
// so the caller's input is changed. The probe's inputs_unchanged check must refuse it.
#define TRTMC_RESIDUAL_ADD_NO_EXPORT
#include "../../examples/byok/residual_add.cu"

namespace {
struct FirstOp {
  TRTMC_HD float operator()(float x, float) const { return x; }
};

void ResidualAddWritesInput(TensorView a, TensorView b, TensorView out) {
  Binary("residual_add_writes_input", a, b, b, AddOp{});
  Binary("residual_add_writes_input", b, b, out, FirstOp{});
}
}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(run, ResidualAddWritesInput);
