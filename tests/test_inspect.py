"""Kernel library inspection before loading (pipeline/kernels/inspect.py, `trtmc kernel inspect`)
on real DSOs: small C++ kernels compiled with g++ once per run, and, where nvcc is on PATH, one
CUDA kernel linked with the static and with the shared CUDA runtime."""
from __future__ import annotations

import contextlib
import io
import json
import platform
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from pipeline.cli import main
from pipeline.errors import UserError
from pipeline.kernels.build import _tvm_ffi_flags
from pipeline.kernels.inspect import (CAPABILITIES, category_of, inspect_file, inspect_library,
                                      library_category)

ROOT = Path(__file__).resolve().parent.parent

# kernel -> (the category it is refused for, one import it is refused for, its C++ source)
REFUSED = {
    "dlopen": ("dynamic-loading", "dlopen", """
        #include <dlfcn.h>
        extern "C" void* kernel_entry(const char* path) { return dlopen(path, RTLD_NOW); }"""),
    "getenv": ("environment", "getenv", """
        #include <cstdlib>
        extern "C" const char* kernel_entry(const char* name) { return std::getenv(name); }"""),
    "fopen": ("files", "fopen", """
        #include <cstdio>
        extern "C" void* kernel_entry(const char* path) { return std::fopen(path, "r"); }"""),
    "ifstream": ("files", "_ZTVSt14basic_ifstreamIcSt11char_traitsIcEE", """
        #include <fstream>
        extern "C" bool kernel_entry(const char* path) { std::ifstream f(path); return f.good(); }"""),
    "fork": ("processes", "fork", """
        #include <unistd.h>
        extern "C" int kernel_entry() { return fork(); }"""),
    "socket": ("sockets", "socket", """
        #include <sys/socket.h>
        extern "C" int kernel_entry() { return socket(AF_INET, SOCK_STREAM, 0); }"""),
    "ptrace": ("ptrace", "ptrace", """
        #include <sys/ptrace.h>
        extern "C" long kernel_entry(int pid) { return ptrace(PTRACE_ATTACH, pid, 0, 0); }"""),
    "signal": ("signals", "signal", """
        #include <csignal>
        extern "C" void* kernel_entry() { return (void*)std::signal(SIGINT, SIG_IGN); }"""),
    "exit": ("exit", "exit", """
        #include <cstdlib>
        extern "C" void kernel_entry(int status) { std::exit(status); }"""),
    "pthread_create": ("threads", "pthread_create", """
        #include <pthread.h>
        static void* body(void*) { return nullptr; }
        extern "C" int kernel_entry() { pthread_t t; return pthread_create(&t, nullptr, body, nullptr); }"""),
    "std_thread": ("threads", "_ZNSt6thread4joinEv", """
        #include <thread>
        extern "C" void kernel_entry() { std::thread t([] {}); t.join(); }"""),
    "python": ("python", "PyRun_SimpleString", """
        extern "C" int PyRun_SimpleString(const char*);
        extern "C" int kernel_entry() { return PyRun_SimpleString("print(1)"); }"""),
}

# a raw system call (getpid) in inline assembly, by machine
RAW_SYSCALL = {
    "x86_64": ("syscall", """
        extern "C" long kernel_entry() {
          long r; asm volatile("syscall" : "=a"(r) : "a"(39L) : "rcx", "r11", "memory"); return r; }"""),
    "aarch64": ("svc #0", """
        extern "C" long kernel_entry() {
          register long x8 asm("x8") = 172; register long x0 asm("x0");
          asm volatile("svc #0" : "=r"(x0) : "r"(x8) : "memory"); return x0; }"""),
}

OTHERS = {
    # what ordinary C++ kernels use: strings, streams to memory and stderr, exceptions, a mutex,
    # a shared_ptr, libm, snprintf, std::stoi
    "plain_cxx": """
        #include <cmath>
        #include <cstdio>
        #include <iostream>
        #include <memory>
        #include <mutex>
        #include <sstream>
        #include <stdexcept>
        #include <string>
        #include <vector>
        static std::mutex lock;
        extern "C" float kernel_entry(const char* text, float x) {
          std::lock_guard<std::mutex> held(lock);
          auto values = std::make_shared<std::vector<float>>(std::stoi(text), std::exp(x));
          std::ostringstream said; said << "n=" << values->size();
          char buffer[32]; std::snprintf(buffer, sizeof buffer, "%g", std::tanh(x));
          std::cerr << said.str() << buffer << std::endl;
          if (values->empty()) throw std::runtime_error("empty");
          return std::sqrt((*values)[0]) + std::pow(x, 3.0f);
        }""",
    "unlisted": """
        extern "C" int nowhere_on_the_allow_list(int);
        extern "C" int kernel_entry(int x) { return nowhere_on_the_allow_list(x); }""",
}

# a TVM-FFI CUDA kernel, for nvcc's static and shared CUDA runtime
CUDA_SOURCE = """
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/function.h>
__global__ void add_one(float* x, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] += 1.0f;
}
void run(tvm::ffi::TensorView x) {
  int n = static_cast<int>(x.numel());
  add_one<<<(n + 255) / 256, 256>>>(static_cast<float*>(x.data_ptr()), n);
}
TVM_FFI_DLL_EXPORT_TYPED_FUNC(run, run);
"""


@pytest.fixture(scope="session")
def libraries(kernel_builds, tmp_path_factory) -> dict[str, Path]:
    """Every kernel above and the shipped CPU kernel, built with `build_kernel`, two at a time."""
    folder = tmp_path_factory.mktemp("inspect-sources")
    texts = {name: source for name, (_, _, source) in REFUSED.items()} | OTHERS
    if platform.machine() in RAW_SYSCALL:
        texts["raw_syscall"] = RAW_SYSCALL[platform.machine()][1]
    sources = {"residual_add": ROOT / "examples/byok/residual_add.cu"}
    for name, text in texts.items():
        sources[name] = folder / f"{name}.cc"
        sources[name].write_text(text)
    with ThreadPoolExecutor(2) as pool:
        return dict(zip(sources, pool.map(kernel_builds, sources.values())))


@pytest.fixture(scope="session")
def cuda_libraries(tmp_path_factory) -> dict[str, Path]:
    """The CUDA kernel for sm_90a, linked as nvcc does by default (static runtime) and with
    `-cudart shared`."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not on PATH")
    folder = tmp_path_factory.mktemp("inspect-cuda")
    (folder / "add_one.cu").write_text(CUDA_SOURCE)
    includes, link = _tvm_ffi_flags()
    runtimes = {"static": [], "shared": ["-cudart", "shared"]}

    def build(runtime: str) -> Path:
        out = folder / f"add_one_{runtime}.so"
        subprocess.run([nvcc, "-x", "cu", "-std=c++17", "-O2", "-Xcompiler", "-fPIC",
                        "-gencode=arch=compute_90a,code=sm_90a", *runtimes[runtime], *includes,
                        "-shared", str(folder / "add_one.cu"), "-o", str(out), *link],
                       check=True, capture_output=True, timeout=600)
        return out

    with ThreadPoolExecutor(2) as pool:
        return dict(zip(runtimes, pool.map(build, runtimes)))


def trtmc(*argv) -> tuple[int, str, str]:
    """`trtmc ARGV` in this process -> (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([str(a) for a in argv])
    return rc, out.getvalue(), err.getvalue()


@pytest.mark.slow
def test_the_shipped_cpu_kernel_passes(libraries):
    inspection = inspect_file(libraries["residual_add"])
    assert inspection.passed and inspection.problem() is None, inspection.problem()
    assert "libtvm_ffi.so" in inspection.needed and "TVMFFIErrorSetRaised" in inspection.allowed["tvm-ffi"]
    assert not inspection.syscall_sites and not inspection.static_cuda_runtime
    assert sorted(s for group in inspection.allowed.values() for s in group) == list(inspection.imports)


@pytest.mark.slow
def test_ordinary_cxx_passes(libraries):
    inspection = inspect_file(libraries["plain_cxx"])
    assert inspection.passed, inspection.problem()
    assert {"console", "c++-runtime", "math", "memory", "synchronization"} <= set(inspection.allowed)


@pytest.mark.slow
@pytest.mark.parametrize("kernel", REFUSED)
def test_each_capability_is_refused_and_can_be_granted(libraries, kernel):
    category, symbol, _ = REFUSED[kernel]
    inspection = inspect_file(libraries[kernel])
    assert not inspection.passed
    assert {f.category for f in inspection.refused} == {category}, inspection.refused
    assert symbol in {f.symbol for f in inspection.refused}
    assert f"({category}: refused; grant the capability '{category}' in the spec's kernel block " \
           f"to allow it)" in inspection.problem()
    granted = inspect_file(libraries[kernel], [category])
    assert granted.passed and granted.granted == inspection.refused


@pytest.mark.slow
def test_dlopen_is_refused_in_one_line(libraries):
    path = libraries["dlopen"]
    assert inspect_file(path).problem() == (
        f"{path} imports 'dlopen' (dynamic-loading: refused; grant the capability "
        f"'dynamic-loading' in the spec's kernel block to allow it)")


@pytest.mark.slow
def test_a_raw_system_call_instruction_is_found(libraries):
    if "raw_syscall" not in libraries:
        pytest.skip(f"no system-call assembly for {platform.machine()}")
    inspection = inspect_file(libraries["raw_syscall"])
    instruction = RAW_SYSCALL[platform.machine()][0]
    assert [(f.symbol, f.category) for f in inspection.refused] == [(instruction, "syscall")]
    [site] = inspection.syscall_sites
    assert site.startswith(".text+0x") and site.endswith(f": {instruction}")
    assert "syscall" not in inspection.imports
    assert inspect_file(libraries["raw_syscall"], ["syscall"]).passed


@pytest.mark.slow
def test_an_unlisted_import_is_refused_even_with_every_grant(libraries):
    inspection = inspect_file(libraries["unlisted"], CAPABILITIES)
    assert [(f.symbol, f.category) for f in inspection.refused] == \
        [("nowhere_on_the_allow_list", "unlisted")]
    assert inspection.problem() == (
        f"{libraries['unlisted']} imports 'nowhere_on_the_allow_list' (not on the allow-list of "
        f"kernel imports: pipeline/kernels/inspect.py)")


@pytest.mark.slow
@pytest.mark.parametrize("cut", [0, 10, 100, 0.5, -1])
def test_a_truncated_library_is_one_line(libraries, cut):
    data = libraries["residual_add"].read_bytes()
    end = int(len(data) * cut) if isinstance(cut, float) else cut % len(data)
    with pytest.raises(UserError) as e:
        inspect_library(data[:end], "cut.so")
    assert str(e.value).startswith("cut.so: not a shared library pyelftools can read (")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("symbol, category", [
    ("_ZTVSt14basic_ofstreamIcSt11char_traitsIcEE", "files"),  # before c++-runtime's _ZTV
    ("_ZTVSt9bad_alloc", "c++-runtime"),
    ("__read_chk", "files"),
    ("__isoc23_strtol", "formatting"),
    ("cuTensorMapEncodeTiled", "cuda"),
    ("cuGetProcAddress_v2", "unlisted"),
    ("expf", "math"),
    ("__popcountdi2", "math"),  # libgcc's, where the target has no popcount instruction
    ("__udivti3", "math"),
    ("__popcountdi2x", "unlisted"),
    ("_Py_Dealloc", "python"),
    ("dlopen\n", "unlisted"),
])
def test_categories_of_imports(symbol, category):
    assert category_of(symbol) == category


@pytest.mark.parametrize("needed, category", [
    ("libcudart.so.13", None), ("ld-linux-x86-64.so.2", None), ("libtvm_ffi.so", None),
    ("libpython3.11.so.1.0", "python"), ("libtorch.so", "unlisted-library"),
])
def test_categories_of_needed_libraries(needed, category):
    assert library_category(needed) == category


def test_an_unknown_capability_is_named_with_the_valid_ones():
    with pytest.raises(UserError) as e:
        inspect_library(b"", "k.so", ["files", "network"])
    assert "'network'" in str(e.value) and ", ".join(CAPABILITIES) in str(e.value)


@pytest.mark.slow
def test_the_command_exits_1_with_the_problem_and_0_when_it_passes(libraries):
    rc, out, _ = trtmc("kernel", "inspect", libraries["dlopen"])
    assert rc == 1
    assert out.splitlines()[-1] == f"refused: {inspect_file(libraries['dlopen']).problem()}"
    rc, out, _ = trtmc("kernel", "inspect", libraries["dlopen"], "--grant", "dynamic-loading")
    assert rc == 0 and out.splitlines()[-1] == "passed"
    assert "granted  dynamic-loading: imports 'dlopen'" in out
    rc, out, _ = trtmc("kernel", "inspect", libraries["residual_add"], "--json")
    assert rc == 0 and json.loads(out) == inspect_file(libraries["residual_add"]).to_json()


def test_the_command_says_why_a_file_is_no_library(tmp_path):
    (tmp_path / "k.so").write_bytes(b"\x7fELF" + bytes(12))
    rc, out, err = trtmc("kernel", "inspect", tmp_path / "k.so")
    assert rc == 2 and not out
    assert err.startswith(f"trtmc: error: {tmp_path / 'k.so'}: not a shared library pyelftools "
                          f"can read (") and err.count("\n") == 1


@pytest.mark.slow
def test_the_static_cuda_runtime_is_refused_with_the_rebuild_hint(cuda_libraries):
    static = inspect_file(cuda_libraries["static"])
    assert static.static_cuda_runtime and static.refused[0].category == "cuda-static-runtime"
    assert "rebuild with nvcc -cudart shared" in static.problem()
    # the grant accepts the runtime being there; its own imports still need their capabilities
    granted = inspect_file(cuda_libraries["static"], ["cuda-static-runtime"])
    assert granted.granted[0].category == "cuda-static-runtime"
    assert "dlopen" in {f.symbol for f in granted.refused}


@pytest.mark.slow
def test_the_shared_cuda_runtime_passes(cuda_libraries):
    shared = inspect_file(cuda_libraries["shared"])
    assert shared.passed, shared.problem()
    assert not shared.static_cuda_runtime
    assert any(n.startswith("libcudart.so.") for n in shared.needed)
    assert "__cudaRegisterFatBinary" in shared.allowed["cuda"]
