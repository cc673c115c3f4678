// What the hostile test kernels use of the interpreter's C-API, declared here rather than by
// including Python.h (the kernel build has no Python include path): run Python source once, from
// whatever thread calls, holding the GIL. A library that imports these needs the spec's
// capability "python".
#pragma once

#include <atomic>

extern "C" {
typedef int PyGILState_STATE;
PyGILState_STATE PyGILState_Ensure(void);
void PyGILState_Release(PyGILState_STATE);
int PyRun_SimpleString(const char*);
}

namespace trtmc_tests {
// `source` run on the first call only; later calls do nothing
inline void RunPythonOnce(std::atomic<int>& calls, const char* source) {
  if (calls.fetch_add(1) != 0) return;
  PyGILState_STATE g = PyGILState_Ensure();
  PyRun_SimpleString(source);
  PyGILState_Release(g);
}
}  // namespace trtmc_tests
