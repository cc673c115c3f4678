// Deliberately hostile: right, but on its first call it writes to the kernel host's answer
// channel (descriptor 4): with TRTMC_CHANNEL_PARTIAL a frame head that promises a body it never
// sends, then it never returns; else bytes that are no frame. Needs the capability "files".
#define TRTMC_RESIDUAL_ADD_NO_EXPORT
#include "../../examples/byok/residual_add.cu"

#include <atomic>
#include <cstring>
#include <unistd.h>

namespace {
std::atomic<int> calls{0};

void ResidualBreaksChannel(TensorView a, TensorView b, TensorView out) {
  if (calls.fetch_add(1) == 0) {
#if defined(TRTMC_CHANNEL_PARTIAL)
    const unsigned char head[24] = {'T', 'R', 'T', 'H', 0, 0, 16, 0, 0, 0, 0, 0,
                                    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};  // 1 MiB of JSON to come
    (void)!write(4, head, sizeof head);
    (void)!write(4, "{\"kind\"", 7);
    for (volatile int spin = 0;; spin = spin + 1) {
    }
#else
    const char junk[] = "not a frame at all, and longer than a frame head";
    (void)!write(4, junk, std::strlen(junk));
#endif
  }
  Binary("residual_breaks_channel", a, b, out, AddOp{});
}
}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(run, ResidualBreaksChannel);
