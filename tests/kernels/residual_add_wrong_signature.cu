// Deliberately wrong: three arguments like residual_add, but the third is an int, not a tensor.
// Its signature metadata must make binding against a (tensor, tensor) -> tensor ABI fail.
#include "../../examples/byok/trtmc_kernel.h"

namespace {
using trtmc_byok::TensorView;

void WrongSignature(TensorView a, TensorView out, int64_t count) {
  TVM_FFI_THROW(RuntimeError) << "residual_add_wrong_signature must never be called (" << count << ")";
}
}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(run, WrongSignature);
