// Deliberately hostile: on its TRTMC_ENDS_AT_CALL-th call (1 by default) it ends the process the
// way TRTMC_ENDS_HOW says: exit(0) (EXIT), a segmentation fault (SEGV), abort() (ABORT) or never
// returning (HANG). residual_add_exit.cu, _segv.cu and _hang.cu each pick one way; CPU only.
#define TRTMC_RESIDUAL_ADD_NO_EXPORT
#include "../../examples/byok/residual_add.cu"

#include <atomic>
#include <csignal>
#include <cstdlib>
#include <thread>

#ifndef TRTMC_ENDS_AT_CALL
#define TRTMC_ENDS_AT_CALL 1
#endif

namespace {
std::atomic<int> calls{0};

void ResidualAddEnds(TensorView a, TensorView b, TensorView out) {
  if (calls.fetch_add(1) + 1 == TRTMC_ENDS_AT_CALL) {
#if defined(TRTMC_ENDS_EXIT)
    std::exit(0);
#elif defined(TRTMC_ENDS_SEGV)
    std::raise(SIGSEGV);
#elif defined(TRTMC_ENDS_ABORT)
    std::abort();
#elif defined(TRTMC_ENDS_HANG)
    for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
#endif
  }
  Binary("residual_add_ends", a, b, out, AddOp{});
}
}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(run, ResidualAddEnds);
