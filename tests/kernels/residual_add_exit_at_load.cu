// Deliberately hostile: ends the process with exit(0) while the library loads (a constructor), so
// whoever loads it exits 0 with no output unless it loads it in a process of its own. CPU only.
#include "../../examples/byok/residual_add.cu"

#include <cstdlib>

namespace {
struct EndAtLoad {
  EndAtLoad() { std::exit(0); }
} end_at_load;
}  // namespace
