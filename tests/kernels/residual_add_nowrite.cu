// Deliberately wrong: residual_add's signature and checks, but it returns without writing `out`.
// A region probe must catch it (outputs are poisoned before the call).
#include "../../examples/byok/trtmc_kernel.h"

namespace {
using trtmc_byok::TensorView;

void NoWrite(TensorView a, TensorView b, TensorView out) {
  trtmc_byok::CheckDType("residual_add_nowrite", "a", a, /*allow_int32=*/false);
  trtmc_byok::CheckLike("residual_add_nowrite", "b", b, "a", a);
  trtmc_byok::CheckLike("residual_add_nowrite", "out", out, "a", a);
}
}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(run, NoWrite);
