// Deliberately wrong: right for its first 8 calls (per loaded library), then it returns without
// writing `out`. A reused output buffer would still hold call 8's result; the probe's
// stable_across_calls check and gates over re-poisoned slot outputs must refuse it.
#define TRTMC_RESIDUAL_ADD_NO_EXPORT
#include "../../examples/byok/residual_add.cu"

#include <atomic>

namespace {
std::atomic<int> calls{0};

void ResidualAddFirstN(TensorView a, TensorView b, TensorView out) {
  if (calls.fetch_add(1) >= 8) return;
  Binary("residual_add_first_n", a, b, out, AddOp{});
}
}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(run, ResidualAddFirstN);
