// decode_attention_zero: the reference decode-attention kernel, and run_zero, which writes zeros
// instead: a kernel wrong in every layer, for the correctness gate's bisection over instances.
#include "../../examples/byok/decode_attention.cu"

#include <cstring>

namespace {

void DecodeAttentionZero(TensorView q, TensorView k_cache, TensorView v_cache, TensorView kv_len,
                         TensorView out) {
  DecodeAttention(q, k_cache, v_cache, kv_len, out);  // every check of the real kernel
  if (trtmc_byok::CheckBackend("decode_attention_zero", out) == trtmc_byok::Backend::kCPU) {
    std::memset(out.data_ptr(), 0, size_t(out.numel()) * 2);  // BF16 or FP16
  }
}

}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(run_zero, DecodeAttentionZero);
