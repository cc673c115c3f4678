// residual_add, right, whose library loads the machine between the kernel's calls: from its
// first call on, a thread of its own holds Python's GIL for 1 ms in every 1.25 ms, so whatever
// else the process runs (the native arm of a perf trial) waits on it. The perf gate times the
// native engine before the library is loaded, and must not pass this. CPU builds only.
#define TRTMC_RESIDUAL_ADD_NO_EXPORT
#include "../../examples/byok/residual_add.cu"

#include <dlfcn.h>

#include <atomic>
#include <chrono>
#include <thread>

namespace {
std::atomic<bool> started{false};

void HoldTheGil() {
  using Ensure = int (*)();
  using Release = void (*)(int);
  auto ensure = reinterpret_cast<Ensure>(dlsym(RTLD_DEFAULT, "PyGILState_Ensure"));
  auto release = reinterpret_cast<Release>(dlsym(RTLD_DEFAULT, "PyGILState_Release"));
  if (ensure == nullptr || release == nullptr) return;
  for (;;) {
    const int state = ensure();
    const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(1000);
    while (std::chrono::steady_clock::now() < until) {
    }
    release(state);
    std::this_thread::sleep_for(std::chrono::microseconds(250));
  }
}

void ResidualAddHoldsNative(TensorView a, TensorView b, TensorView out) {
  if (!started.exchange(true)) std::thread(HoldTheGil).detach();
  Binary("residual_add_holds_native", a, b, out, AddOp{});
}
}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(run, ResidualAddHoldsNative);
