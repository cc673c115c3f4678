"""Compile one kernel source into a TVM-FFI DSO (`trtmc kernel build`).

g++ compiles the source as C++ (its CPU path); nvcc compiles it as CUDA (CPU and CUDA paths).
Every build defines TVM_FFI_DLL_EXPORT_INCLUDE_METADATA so typed exports carry their signature,
which binding checks against the slot's ABI. The DSO is linked in a temp folder next to the output
and renamed into place, so a failed or interrupted build never leaves a half-written library.
"""
from __future__ import annotations

import ctypes
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from pipeline import progress
from pipeline.errors import UserError
from pipeline.isolation import die_with_parent, stop_signals_held
from pipeline.log import get as log_topic
from pipeline.files import file_problem, open_regular, refuse_overwriting, shown, staged_file

METADATA_FLAG = "-DTVM_FFI_DLL_EXPORT_INCLUDE_METADATA=1"
ERROR_TAIL_LINES = 25
# wall-clock limits: nvcc builds a large kernel for several architectures in a few minutes; an
# exporter (CuTe DSL, a JIT) compiles too. Past them the command and its children are killed.
COMPILE_TIMEOUT_S = 1200
EXPORT_TIMEOUT_S = 1800
VERSION_TIMEOUT_S = 30  # a compiler's `--version`


log = log_topic("kernel build")


def _nvcc() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and (Path(home) / "bin" / "nvcc").is_file():
        return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def compiler_version(path: str | None, marker: str) -> str | None:
    """The first line of `path --version` holding `marker` (its version), or None when it cannot
    run, fails or outlives VERSION_TIMEOUT_S."""
    try:
        done = run_limited([path, "--version"], VERSION_TIMEOUT_S, capture=True) if path else None
    except OSError:
        return None
    out = done.stdout if done is not None and done.returncode == 0 else ""
    lines = [line.strip() for line in out.splitlines() if marker in line]
    return lines[0] if lines else None


def nvcc_version() -> str | None:
    """The release line of the nvcc a CUDA build uses, or None."""
    return compiler_version(_nvcc(), "release")


def cuda_gpu_present() -> bool:
    """Whether the CUDA driver sees a device (as torch.cuda.is_available() decides, from the
    driver's own count), asked through libcuda: no torch import (a CPU-only build never pays
    it). It initialises the driver, so only on use, never at import."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    count = ctypes.c_int(0)
    return (driver.cuInit(0) == 0 and driver.cuDeviceGetCount(ctypes.byref(count)) == 0
            and count.value > 0)


def arch_list(cuda_arch: str | None) -> list[str]:
    """`cuda_arch` (or TVM_FFI_CUDA_ARCH_LIST, or the visible GPU) as ["90a", ...]."""
    source = "cuda_arch"
    if cuda_arch is None and os.environ.get("TVM_FFI_CUDA_ARCH_LIST"):
        cuda_arch, source = os.environ["TVM_FFI_CUDA_ARCH_LIST"], "TVM_FFI_CUDA_ARCH_LIST"
    if cuda_arch is None:
        if not cuda_gpu_present():
            raise UserError("cuda: a CUDA build needs cuda_arch (e.g. 90a): no GPU to query and "
                            "TVM_FFI_CUDA_ARCH_LIST is not set", param="cuda",
                            mentions=("cuda_arch",))
        import torch
        major, minor = torch.cuda.get_device_capability()
        return [f"{major}{minor}"]
    arches = []
    for item in re.split(r"[\s,;]+", cuda_arch.strip()):
        arch = item.removeprefix("sm_").removeprefix("compute_").replace(".", "")
        if not re.fullmatch(r"\d{2,3}[af]?", arch):
            raise UserError(f"{source} {cuda_arch!r}: '{item}' is not a CUDA architecture "
                            f"(expected e.g. 90a, 9.0a, sm_90a or 80,90a)", param=source)
        arches.append(arch)
    return arches


def _tvm_ffi_libinfo():
    """apache-tvm-ffi's `libinfo` (paths only, the standard library only), loaded from the
    installed package on its own when the package is not imported yet: the package's
    `__init__` imports torch, over a second that a build does not need."""
    if "tvm_ffi" in sys.modules:
        from tvm_ffi import libinfo
        return libinfo
    spec = importlib.util.find_spec("tvm_ffi")
    if spec is None or spec.origin is None:
        raise UserError("apache-tvm-ffi is not installed: pip install 'apache-tvm-ffi>=0.1.15,<0.2'")
    where = importlib.util.spec_from_file_location("trtmc_tvm_ffi_libinfo",
                                                   Path(spec.origin).parent / "libinfo.py")
    libinfo = importlib.util.module_from_spec(where)
    where.loader.exec_module(libinfo)
    return libinfo


def _tvm_ffi_flags() -> tuple[list[str], list[str]]:
    """Include and link flags of the installed apache-tvm-ffi (what `tvm-ffi-config` prints)."""
    libinfo = _tvm_ffi_libinfo()
    includes = [f"-I{p}" for p in dict.fromkeys(libinfo.include_paths())]
    libdir = Path(libinfo.find_libtvm_ffi()).parent
    return includes, [f"-L{libdir}", "-ltvm_ffi"]


def _command(compiler: str, cuda: bool, arches: list[str], source: Path, output: Path,
             extra_flags: Sequence[str] = ()) -> list[str]:
    includes, link = _tvm_ffi_flags()
    if cuda:
        gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in arches]
        # the CUDA runtime as a shared library: its own dlopen, getenv and threads then stay
        # outside the kernel's imports, which inspect.py holds to an allow-list
        head = [compiler, "-x", "cu", "-std=c++17", "-O2", "-Xcompiler", "-fPIC", "-cudart",
                "shared", *gencode]
    else:
        head = [compiler, "-x", "c++", "-std=c++17", "-O2", "-fPIC"]
    return [*head, METADATA_FLAG, *extra_flags, *includes, "-shared", str(source), "-o", str(output),
            *link]


# C-family sources whose quoted includes a DSO depends on (an exporter's Python sources are listed
# by the spec itself)
C_SOURCES = (".c", ".cc", ".cpp", ".cxx", ".cu", ".cuh", ".h", ".hh", ".hpp", ".inl")
_QUOTED_INCLUDE = re.compile(rb'^[ \t]*#[ \t]*include[ \t]*"([^"\n]+)"', re.M)
# an absolute path in angle brackets names one file wherever the include path points
_ABSOLUTE_INCLUDE = re.compile(rb'^[ \t]*#[ \t]*include[ \t]*<(/[^>\n]+)>', re.M)


def run_limited(cmd: list[str], timeout_s: float, *, cwd=None,
                capture: bool = False) -> subprocess.CompletedProcess | None:
    """Run `cmd` in a process group of its own; None when it is still running after `timeout_s`
    seconds. The group (the command and whatever it started) is killed then, and also when this
    process is interrupted while waiting. `capture`: stdout and stderr together, as text."""
    pipe = subprocess.PIPE if capture else None
    # the command dies with this process too (a SIGKILL leaves no time to kill its group)
    with subprocess.Popen(cmd, cwd=cwd, start_new_session=True, stdout=pipe,
                          stderr=subprocess.STDOUT if capture else None, text=True,
                          preexec_fn=die_with_parent) as proc:
        try:
            out, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None
        finally:
            with stop_signals_held():  # a second stop signal must not cut this short
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        return subprocess.CompletedProcess(cmd, proc.returncode, out)


def local_includes(sources: list[Path]) -> list[Path]:
    """Every file the C-family `sources` include with quotes, found from the including file's
    folder (as the compiler looks first), or by an absolute path in angle brackets, and what
    those include, recursively; sorted, without
    the sources themselves. A DSO depends on these as on its source, so a header's change must
    rebuild it; headers on the include path (tvm-ffi's) come with the tvm-ffi version. An include
    that exists but is no regular file (a FIFO would block the compiler, /dev/zero fill its
    memory; a folder) is refused."""
    roots = {Path(os.path.realpath(s)) for s in sources}
    found: set[Path] = set()
    todo = [r for r in roots if r.suffix in C_SOURCES and file_problem(r) is None]  # doit says why
    while todo:
        including = todo.pop()
        with open_regular(including) as f:
            text = f.read()
        named = [(n, '"', '"') for n in _QUOTED_INCLUDE.findall(text)]
        named += [(n, "<", ">") for n in _ABSOLUTE_INCLUDE.findall(text)]
        for name, opening, closing in named:
            dep = including.parent / os.fsdecode(name)  # an absolute name stays itself
            problem = file_problem(dep)
            if problem is not None and os.path.exists(dep):
                raise UserError(f"{shown(including)}: #include {opening}"
                                f"{shown(os.fsdecode(name))}{closing}: {shown(dep)} {problem}, "
                                f"expected a header file")
            if problem is not None:  # none, or a name no file can have (too long, a NUL, a
                continue             # link loop): the compiler says so
            dep = Path(os.path.realpath(dep))
            if dep not in found | roots:
                found.add(dep)
                todo.append(dep)
    return sorted(found)


def build_kernel(source: Path, output: Path, *, cuda: bool | None = None,
                 cuda_arch: str | None = None, extra_flags: Sequence[str] = ()) -> Path:
    """Compile `source` into the DSO `output`; CUDA when asked, or by default when a GPU and nvcc
    are both present, else CPU only; `extra_flags` (include folders, defines) come before the
    tvm-ffi includes. Returns `output`."""
    source, output = Path(source), Path(output)
    problem = file_problem(source)
    if problem is not None:
        raise UserError(f"{shown(source)}: kernel source {problem}")
    if output.is_dir():
        raise UserError(f"output {output}: is a directory, expected the path of the .so to write",
                        param="output")
    refuse_overwriting(output, [source, *local_includes([source])], "output")
    nvcc = _nvcc()
    if cuda is None:
        cuda = nvcc is not None and cuda_gpu_present()
    if not cuda and cuda_arch is not None:
        raise UserError(f"cuda_arch {cuda_arch}: only meaningful for a CUDA build", param="cuda_arch")
    arches = arch_list(cuda_arch) if cuda else []
    if cuda and nvcc is None:
        raise UserError("cuda: nvcc not found (set CUDA_HOME or put nvcc on PATH), "
                        "or build for the CPU only", param="cuda")
    compiler = nvcc if cuda else (os.environ.get("CXX") or shutil.which("g++"))
    if compiler is None:
        raise UserError("no C++ compiler: install g++ or set CXX")
    target = f"CUDA sm_{','.join(arches)} + CPU" if cuda else "CPU only"
    output.parent.mkdir(parents=True, exist_ok=True)
    with staged_file(output) as built:
        cmd = _command(compiler, cuda, arches, source, built, extra_flags)
        log.info(f"compiling {source} ({target}) with {Path(compiler).name}")
        with progress.spinner(f"compiling {source.name}"):
            proc = run_limited(cmd, COMPILE_TIMEOUT_S, capture=True)
        if proc is None:
            raise UserError(f"{source}: {Path(compiler).name} still running after "
                            f"{COMPILE_TIMEOUT_S} s (the limit, "
                            f"pipeline.kernels.build.COMPILE_TIMEOUT_S); it was stopped")
        if proc.returncode != 0:
            tail = "\n".join(proc.stdout.rstrip().splitlines()[-ERROR_TAIL_LINES:])
            raise UserError(f"{source}: {Path(compiler).name} failed with exit code "
                            f"{proc.returncode}; compiler output (last lines):\n{tail}")
    log.info(f"wrote {output} ({output.stat().st_size // 1024} KiB, {target})")
    return output
