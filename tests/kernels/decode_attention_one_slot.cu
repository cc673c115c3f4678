// decode_attention_one_slot: the Hopper decode-attention kernel, right in every slot call of a
// decode step but one: in the K-th call of each step it reads the key cache as values. Bound to
// every layer, that is layer K's instance, so the correctness gate's bisection has one instance to
// find. Exports run_slot1 (K = 1) and run_slot20 (K = 20).
//
// A step calls the bound slots in graph order, each with its own key cache, and the next step
// starts again at the first: the call's ordinal in its step is the position of its cache pointer
// in the cycle. A pointer out of sequence, or a new pointer after a completed step, starts a new
// cycle (another pipeline, or a probe's fresh buffers); the kernel misbehaves only once a cycle
// has come round to its first cache again, so stray calls never count as layer K. Decided on the
// host, so a captured CUDA graph keeps the decision.
#include "../../examples/byok/decode_attention_hopper.cu"

#include <algorithm>
#include <vector>

namespace {

// The call's ordinal in its step, or -1 until the cycle has closed.
int StepOrdinal(const void* cache) {
  static std::vector<const void*> cycle;
  static int previous = -1;
  static bool closed = false;  // a step has wrapped around to the first cache again
  const auto found = std::find(cycle.begin(), cycle.end(), cache);
  const int at = int(found - cycle.begin());
  if (found != cycle.end() && (at == 0 || at == previous + 1)) {
    closed = closed || at == 0;
    previous = at;
  } else if (found == cycle.end() && !closed && previous == int(cycle.size()) - 1) {
    cycle.push_back(cache);
    previous = int(cycle.size()) - 1;
  } else {
    cycle.assign(1, cache);  // a new cycle
    closed = false;
    previous = 0;
  }
  return closed ? previous : -1;
}

template <int K>
void WrongInOneSlot(TensorView q, TensorView k_cache, TensorView v_cache, TensorView kv_len,
                    TensorView out) {
  if (StepOrdinal(k_cache.data_ptr()) == K) {
    return DecodeAttentionHopper(q, k_cache, k_cache, kv_len, out);
  }
  DecodeAttentionHopper(q, k_cache, v_cache, kv_len, out);
}

}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(run_slot1, WrongInOneSlot<1>);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(run_slot20, WrongInOneSlot<20>);
