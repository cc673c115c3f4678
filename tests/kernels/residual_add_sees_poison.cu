// Deliberately wrong: recognises a gate by its poisoned output. It adds a + b when the output's
// first element holds a NaN (what a probe or a poisoning pipeline fills outputs with) and
// a + b + 1 otherwise. On CUDA a one-thread kernel looks at the element first, on the same stream,
// so the trick survives CUDA-graph replays.
#define TRTMC_RESIDUAL_ADD_NO_EXPORT
#include "../../examples/byok/residual_add.cu"

#include <cstring>

namespace {
struct FlaggedOp {  // a + b where the flag says NaN was seen, a + b + 1 elsewhere
  const int* saw_nan;
  TRTMC_HD float operator()(float x, float y) const { return x + y + (*saw_nan ? 0.0f : 1.0f); }
};

TRTMC_HD int IsNan(const void* first, int bytes, bool bf16) {
  uint32_t bits = 0;
  memcpy(&bits, first, bytes);
  if (bytes == 4) return (bits & 0x7F800000u) == 0x7F800000u && (bits & 0x007FFFFFu);
  if (bf16) return (bits & 0x7F80u) == 0x7F80u && (bits & 0x7Fu);
  return (bits & 0x7C00u) == 0x7C00u && (bits & 0x3FFu);
}

#ifdef __CUDACC__
__device__ int g_saw_nan;

__global__ void LookAtFirst(const void* out, int bytes, bool bf16, int* flag) {
  *flag = IsNan(out, bytes, bf16);
}
#endif

void ResidualAddSeesPoison(TensorView a, TensorView b, TensorView out) {
  const char* name = "residual_add_sees_poison";
  const int bytes = out.dtype().bits / 8;
  const bool bf16 = out.dtype().code == kDLBfloat;
  if (trtmc_byok::CheckBackend(name, out) == trtmc_byok::Backend::kCPU) {
    static int saw_nan;
    saw_nan = IsNan(out.data_ptr(), bytes, bf16);
    Binary(name, a, b, out, FlaggedOp{&saw_nan});
    return;
  }
#ifdef __CUDACC__
  int* flag = nullptr;
  cudaGetSymbolAddress(reinterpret_cast<void**>(&flag), g_saw_nan);
  LookAtFirst<<<1, 1, 0, trtmc_byok::EnvStream(out)>>>(out.data_ptr(), bytes, bf16, flag);
  Binary(name, a, b, out, FlaggedOp{flag});
#endif
}
}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(run, ResidualAddSeesPoison);
