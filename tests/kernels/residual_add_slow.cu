// residual_add that then waits 5 ms per call: a correct but slow kernel for perf-gate tests.
// CPU: sleeps on the calling thread. CUDA: one thread spins on the env stream for 5 ms of
// %globaltimer, so the delay lands on the stream like real work would.
#define TRTMC_RESIDUAL_ADD_NO_EXPORT
#include "../../examples/byok/residual_add.cu"

#include <chrono>
#include <thread>

namespace {
constexpr int64_t kDelayNs = 5'000'000;

#ifdef __CUDACC__
__global__ void SpinKernel(int64_t ns) {
  uint64_t start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    __nanosleep(100000);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < uint64_t(ns));
}
#endif

void ResidualAddSlow(TensorView a, TensorView b, TensorView out) {
  Binary("residual_add_slow", a, b, out, AddOp{});
  if (a.device().device_type == kDLCPU) {
    std::this_thread::sleep_for(std::chrono::nanoseconds(kDelayNs));
    return;
  }
#ifdef __CUDACC__
  SpinKernel<<<1, 1, 0, trtmc_byok::EnvStream(a)>>>(kDelayNs);
  trtmc_byok::CheckLaunch("residual_add_slow");
#endif
}
}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(run, ResidualAddSlow);
