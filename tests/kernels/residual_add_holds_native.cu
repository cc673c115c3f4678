// residual_add, right, whose library loads the machine between the kernel's calls: on its first
// call it ties the calling thread to the core it runs on and starts three threads of its own that
// spin on that core, so whatever the process runs from then on (the native arm of a perf trial
// too) gets about a quarter of it. The perf gate times the native engine before the library is
// loaded, and must not pass this. CPU builds only (Linux).
#define TRTMC_RESIDUAL_ADD_NO_EXPORT
#include "../../examples/byok/residual_add.cu"

#include <pthread.h>
#include <sched.h>

#include <atomic>
#include <thread>

namespace {
std::atomic<bool> started{false};

void TieToCore(int core) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(core, &set);
  pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
}

void ResidualAddHoldsNative(TensorView a, TensorView b, TensorView out) {
  if (!started.exchange(true)) {
    const int core = sched_getcpu();
    TieToCore(core);
    for (int i = 0; i < 3; ++i) {
      std::thread([core] {
        TieToCore(core);
        for (volatile uint64_t n = 0;; n = n + 1) {
        }
      }).detach();
    }
  }
  Binary("residual_add_holds_native", a, b, out, AddOp{});
}
}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(run, ResidualAddHoldsNative);
