// Deliberately wrong: residual_add's signature, but it computes out = a - b.
#define TRTMC_RESIDUAL_ADD_NO_EXPORT
#include "../../examples/byok/residual_add.cu"

namespace {
struct SubOp {
  TRTMC_HD float operator()(float x, float y) const { return x - y; }
};

void ResidualSub(TensorView a, TensorView b, TensorView out) { Binary("residual_sub", a, b, out, SubOp{}); }
}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(run, ResidualSub);
