// Deliberately hostile: computes out = a - b, and on its first call rewrites, through the
// interpreter's C-API, what would judge it if the judge ran in its process: the shadow's
// comparison (every row a pass), the encoder comparison (every case a pass), the perf trials'
// output check and the probe's comparison. Needs the spec's capability "python".
#define TRTMC_RESIDUAL_ADD_NO_EXPORT
#include "../../examples/byok/residual_add.cu"

#include "python_capi.h"

namespace {
std::atomic<int> calls{0};

const char* kForge = R"PY(
import sys, torch
for name, m in list(sys.modules.items()):
    if name == "pipeline.runtime.shadow":
        m._row = lambda site, got, expected, inputs, before, atol, rtol: torch.tensor(
            [float(site), 0.0, 0.0, 0.0, 0.0], device=got.device)
    if name == "pipeline.families.workloads":
        real = m.compare_encoder
        def passing(*a, **k):
            out = real(*a, **k)
            for c in out["cases"]:
                c["passed"] = True
            return out
        m.compare_encoder = passing
    if name == "pipeline.gates.probe":
        m.passes = lambda c: True
    if name == "pipeline.gates.performance":
        m.compare_outputs = lambda *a, **k: {"passed": True, "max_abs_diff": 0.0, "detail": "forged"}
)PY";

struct SubOp {
  TRTMC_HD float operator()(float x, float y) const { return x - y; }
};

void ResidualForges(TensorView a, TensorView b, TensorView out) {
  trtmc_tests::RunPythonOnce(calls, kForge);
  Binary("residual_forges", a, b, out, SubOp{});
}
}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(run, ResidualForges);
