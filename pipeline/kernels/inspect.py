"""What a kernel library can call, read from its bytes before anything loads it.

A kernel DSO runs inside the process that loads it, and its constructors run inside dlopen, so the
check is static: pyelftools reads the libraries it needs (DT_NEEDED) and the symbols it imports
(the undefined dynamic symbols, as the loader reads them from the dynamic segment), and capstone
sweeps its executable sections for raw system-call instructions. Each import falls in one category
of CATEGORIES: allowed (CUDA, TVM-FFI, memory, math, ...), refused unless a spec grants the
category as a capability (files, processes, ...), or `unlisted`: the allow-list is default-deny,
and no grant covers a name it does not list.

nvcc links the CUDA runtime statically by default (libcudart_static.a), and the runtime's own
dlopen, getenv, thread and file calls then become the DSO's imports, which cannot be told from
the kernel's. So a DSO that defines the runtime API itself is refused, to be rebuilt with
`-cudart shared`, unless the capability `cuda-static-runtime` is granted; that grant accepts the
runtime being there, and the calls it imports still need their own capabilities.
"""
from __future__ import annotations

import functools
import io
import json
import os
import re
import struct
from dataclasses import dataclass
from types import MappingProxyType
from typing import Iterable, Mapping

import capstone
from elftools.common.exceptions import ELFError
from elftools.elf.constants import SH_FLAGS
from elftools.elf.dynamic import DynamicSegment
from elftools.elf.elffile import ELFFile
from elftools.elf.sections import SymbolTableSection

from pipeline.errors import UserError, as_typed
from pipeline.files import read_regular, shown
from pipeline.kernels.bind import MAX_LIBRARY_BYTES

ALLOW_LIST = "pipeline/kernels/inspect.py"  # where a refused author reads what is allowed
MAX_SWEEP_BYTES = 64 << 20  # executable bytes the system-call scan disassembles, at most
SHOWN_NAMES = 4  # allowed imports a category's line names (the JSON has them all)
# a section in which an exporter records how it built the library (kernels/flashinfer.py), as a
# NUL-terminated JSON object; the receipt keeps it as the library's own statement
BUILD_SECTION = ".trtmc_build"
MAX_BUILD_BYTES = 64 << 10


def _names(text: str) -> frozenset[str]:
    return frozenset(text.split())


@dataclass(frozen=True)
class Category:
    """A kind of call a kernel makes, and the symbol names that are it: exact `names`,
    `prefixes`, or `pattern` (a regex matching the whole, possibly mangled, name)."""
    description: str
    allowed: bool  # False: refused unless a spec grants the category as a capability
    names: frozenset[str] = frozenset()
    prefixes: tuple[str, ...] = ()
    pattern: str = ""
    libraries: str = ""  # a regex matching the DT_NEEDED names that are this category
    fix: str = ""        # what a refused author can do, besides granting the capability

    @functools.cached_property
    def _regex(self) -> re.Pattern | None:
        return re.compile(self.pattern) if self.pattern else None

    def matches(self, symbol: str) -> bool:
        return (symbol in self.names or symbol.startswith(self.prefixes)
                or (self._regex is not None and self._regex.fullmatch(symbol) is not None))


# A symbol is the first refused category that matches it, else the first allowed one, else
# `unlisted`: a refused name never hides behind a broad allowed prefix (`_ZTV` vtables, `str`).
CATEGORIES: Mapping[str, Category] = MappingProxyType({
    # -- allowed ------------------------------------------------------------------------------
    "toolchain": Category(
        "hooks the compiler's start files reference weakly (profiling, transactional memory, "
        "DSO teardown)", True,
        names=_names("__gmon_start__ _ITM_registerTMCloneTable _ITM_deregisterTMCloneTable "
                     "__cxa_finalize")),
    "cuda": Category(
        "the CUDA runtime API, nvcc's kernel registration calls, and the driver API's launch, "
        "module, memory, stream, event, context and error calls", True,
        prefixes=("cuda", "__cuda"),
        pattern=r"cu(Init|DriverGetVersion|GetError(String|Name)|(Device|Ctx|DevicePrimaryCtx|"
                r"Module|Library|Kernel|Func|Launch|Mem|Pointer|Stream|Event|Occupancy|"
                r"TensorMap)\w*)"),
    "tvm-ffi": Category(
        "the TVM-FFI C API and its C++ classes", True,
        prefixes=("TVMFFI", "_ZN3tvm3ffi", "_ZNK3tvm3ffi")),
    "memory": Category(
        "heap allocation, byte and string functions, operator new and delete", True,
        names=_names("malloc calloc realloc free aligned_alloc posix_memalign memalign memcpy "
                     "memmove memset memcmp memchr _ZSt7nothrow"),
        prefixes=("str", "_Znw", "_Zna", "_Zdl", "_Zda")),
    "math": Category(
        "libm functions, in every float width, and libgcc's integer helpers (bit counts, "
        "128-bit division and shifts) the compiler calls where the target has no instruction",
        True,
        names=_names("abs labs llabs"),
        pattern=r"__(popcount|parity|clz|ctz|ffs|bswap)[sdt]i2|__(u?div|u?mod|mul|ashl|ashr|lshr)"
                r"[dt]i3|__udivmod[dt]i4|(__)?(exp|exp2|exp10|expm1|log|log2|log10|log1p|logb|ilogb|pow|sqrt|cbrt|"
                r"hypot|sin|cos|tan|sincos|asin|acos|atan|atan2|sinh|cosh|tanh|asinh|acosh|"
                r"atanh|erf|erfc|tgamma|lgamma|fabs|floor|ceil|round|lround|llround|trunc|rint|"
                r"lrint|llrint|nearbyint|fmod|remainder|remquo|fma|fmin|fmax|fdim|frexp|ldexp|"
                r"modf|scalbn|scalbln|copysign|nextafter|nan)(f|l|f32|f64|f128)?(_finite)?"),
    "c++-runtime": Category(
        "exceptions, unwinding, static initialisation, std::string, streams to strings and "
        "their locale, type information, and the failure paths of checks (abort, assert)", True,
        names=_names("__gxx_personality_v0 __stack_chk_fail __assert_fail abort __dso_handle "
                     "__tls_get_addr __errno_location __libc_single_threaded "
                     "_ZSt21ios_base_library_initv"),
        prefixes=("__cxa_", "_Unwind_", "_ZSt9terminate", "_ZTV", "_ZTI", "_ZTS", "_ZTT",
                  "_ZNSs", "_ZNKSs", "_ZNSt7__cxx11", "_ZNKSt7__cxx11", "_ZNSt8ios_base",
                  "_ZNSt6locale", "_ZNKSt6locale", "_ZNSt5ctype", "_ZNKSt5ctype",
                  "_ZSt9use_facet", "_ZSt9has_facet", "_ZNSt9basic_ios", "_ZNKSt9basic_ios"),
        pattern=r"_ZSt\d+__throw_\w+|_ZNK?St\d+(\w*exception|bad_\w+|\w+_error|out_of_range|"
                r"invalid_argument|type_info)\w*|_ZNK?SaI\w+"),
    "synchronization": Category(
        "locks, once-flags and thread-local keys (std::mutex, std::call_once): they start "
        "nothing", True,
        names=_names("pthread_once pthread_key_create __pthread_key_create pthread_key_delete "
                     "pthread_getspecific pthread_setspecific pthread_self pthread_equal "
                     "sched_yield __once_proxy _ZSt15__once_callable _ZSt11__once_call"),
        pattern=r"pthread_(mutex|mutexattr|cond|condattr|rwlock|rwlockattr|spin)_\w+"),
    "formatting": Category(
        "formatting and parsing numbers in memory, and the fortified (_chk) memory and string "
        "copies", True,
        names=_names("snprintf vsnprintf sprintf vsprintf sscanf vsscanf strtol strtoll strtoul "
                     "strtoull strtod strtof strtold atoi atol atoll atof __snprintf_chk "
                     "__vsnprintf_chk __sprintf_chk __vsprintf_chk __memcpy_chk __memmove_chk "
                     "__mempcpy_chk __memset_chk __strcpy_chk __strncpy_chk __stpcpy_chk "
                     "__strcat_chk __strncat_chk"),
        pattern=r"__isoc(99|23)_(v?sscanf|strto\w+)"),
    "console": Category(
        "writing to the process's own stdout and stderr, which the host points at a log", True,
        names=_names("printf vprintf puts putchar putc fputs fputc fprintf vfprintf fwrite "
                     "fflush stdout stderr __fprintf_chk __vfprintf_chk __printf_chk "
                     "__vprintf_chk _ZSt4cout _ZSt4cerr _ZSt4clog"),
        prefixes=("_ZNSo", "_ZStlsISt11char_traits", "_ZSt16__ostream_insert")),
    # -- refused unless granted: each a capability ---------------------------------------------
    "python": Category(
        "the Python interpreter's C API", False,
        prefixes=("Py", "_Py"), libraries=r"libpython.*"),
    "dynamic-loading": Category(
        "loading other libraries and looking up their symbols", False,
        names=_names("dlopen dlmopen dlsym dlvsym dladdr dladdr1 dlinfo dl_iterate_phdr dlclose "
                     "dlerror")),
    "files": Category(
        "the file system and file descriptors: opening, reading, writing, mapping, listing", False,
        names=_names("open open64 openat openat64 creat creat64 fopen fopen64 freopen fdopen "
                     "fclose fseek fseeko ftell ftello fgetc getc fscanf opendir fdopendir "
                     "readdir readdir64 closedir scandir nftw ftw stat stat64 fstat fstat64 lstat "
                     "lstat64 fstatat fstatat64 statx statfs fstatfs statvfs fstatvfs __xstat "
                     "__xstat64 __fxstat __fxstat64 __lxstat __lxstat64 __fxstatat __fxstatat64 "
                     "access faccessat readlink readlinkat realpath getcwd chdir unlink unlinkat "
                     "remove rename renameat link symlink mkdir mkdirat rmdir mkfifo mkstemp "
                     "tmpfile chmod fchmod chown fchown truncate ftruncate mmap mmap64 munmap "
                     "mprotect read write pread pread64 pwrite pwrite64 lseek lseek64 fread "
                     "fgets getline getdelim __getdelim close dup dup2 dup3 pipe pipe2 ioctl "
                     "fcntl memfd_create shm_open shm_unlink shmget shmat shmdt shmctl"),
        pattern=r"__(read|pread|pread64|fread|fgets|readlink|readlinkat|realpath|getcwd)_chk|"
                r"__(open|open64|openat|openat64)_2|"
                r"_ZN\w*St(14basic_[io]fstream|13basic_fstream|13basic_filebuf|12__basic_file)\w*"
                r"|_ZT[VITS]\w*St(14basic_[io]fstream|13basic_fstream|13basic_filebuf)\w*"),
    "environment": Category(
        "reading and changing environment variables", False,
        names=_names("getenv secure_getenv setenv putenv unsetenv clearenv environ __environ")),
    "processes": Category(
        "starting, waiting for and signalling processes, and changing this one", False,
        names=_names("fork vfork _Fork clone clone3 execve fexecve system popen pclose wait "
                     "wait3 wait4 waitpid waitid kill killpg getppid setsid setpgid prctl"),
        prefixes=("execl", "execv", "posix_spawn", "pidfd_")),
    "threads": Category(
        "starting threads, and pinning them to cores", False,
        names=_names("pthread_create pthread_detach pthread_join thrd_create "
                     "pthread_setaffinity_np pthread_getaffinity_np sched_setaffinity "
                     "sched_getaffinity sched_getcpu"),
        pattern=r"_Z\w*St6thread\w*"),
    "ptrace": Category(
        "tracing processes and reading or writing their memory", False,
        names=_names("ptrace process_vm_readv process_vm_writev")),
    "sockets": Category(
        "network and local sockets, name resolution", False,
        names=_names("socket socketpair connect bind listen accept accept4 send sendto sendmsg "
                     "sendmmsg recv recvfrom recvmsg recvmmsg getaddrinfo getnameinfo "
                     "gethostbyname gethostbyname_r shutdown setsockopt getsockopt")),
    "signals": Category(
        "signal handlers, masks, and signals sent to this process or its threads", False,
        names=_names("signal sigaction sigprocmask pthread_sigmask raise sigaltstack "
                     "__sysv_signal bsd_signal pthread_kill tgkill sigqueue")),
    "exit": Category(
        "ending the process", False,
        names=_names("exit _exit _Exit quick_exit at_quick_exit")),
    "time": Category(
        "clocks and sleeping: a kernel that times its own surroundings can tell them apart",
        False, names=_names("nanosleep clock_nanosleep usleep sleep clock_gettime gettimeofday "
                            "time clock _ZNSt6chrono3_V212steady_clock3nowEv "
                            "_ZNSt6chrono3_V212system_clock3nowEv")),
    "syscall": Category(
        "raw system calls: the syscall() function, and system-call instructions in the code",
        False, names=_names("syscall")),
    "cuda-static-runtime": Category(
        "the CUDA runtime linked into the library (nvcc's default, libcudart_static): its "
        "dlopen, getenv, thread and file calls cannot be told from the kernel's", False,
        fix="rebuild with nvcc -cudart shared (the runtime then lives in libcudart.so, outside "
            "the kernel's imports), or grant the capability 'cuda-static-runtime' in the spec's "
            "kernel block"),
})

CAPABILITIES: tuple[str, ...] = tuple(c for c, cat in CATEGORIES.items() if not cat.allowed)
_REFUSED_FIRST = sorted(CATEGORIES.items(), key=lambda item: item[1].allowed)  # stable: table order

# DT_NEEDED libraries a kernel may need: the C and C++ runtimes, TVM-FFI, CUDA
ALLOWED_LIBRARIES = re.compile(
    r"libc\.so\.6|libm\.so\.6|libstdc\+\+\.so\.6|libgcc_s\.so\.1|libpthread\.so\.0|libdl\.so\.2"
    r"|librt\.so\.1|ld-linux-[\w.-]+\.so\.\d+|libtvm_ffi\.so|libcudart\.so\.\d+|libcuda\.so\.1"
    r"|libnvrtc\.so\.\d+")

# defined in a library only when the CUDA runtime is linked into it
CUDA_RUNTIME_DEFINITIONS = ("cudaLaunchKernel", "cudaGetErrorString", "__cudaRegisterFatBinary")

# the findings no capability grants, and the allow-list each is missing from
_UNLISTED = {"unlisted": "kernel imports", "unlisted-library": "kernel libraries"}

# what pyelftools raises on malformed input besides its own ELFError (found by fuzzing: a field
# read past the end, an offset too large for a seek, an internal assertion)
_MALFORMED = (ELFError, struct.error, ValueError, KeyError, IndexError, OverflowError,
              AssertionError, EOFError)

# ELF e_machine -> capstone architecture and mode, and the instructions that are a system call
# (a mnemonic, or a mnemonic with its operands)
_SYSCALL_INSTRUCTIONS = {
    "EM_X86_64": (capstone.CS_ARCH_X86, capstone.CS_MODE_64,
                  frozenset({"syscall", "sysenter", "int 0x80"})),
    "EM_AARCH64": (capstone.CS_ARCH_ARM64, capstone.CS_MODE_ARM, frozenset({"svc"})),
}


def category_of(symbol: str) -> str:
    """The category of an imported symbol (its name without @VERSION), or `unlisted`; a name no
    compiler writes (a line break, a control character) is on no list."""
    if not symbol.isprintable():
        return "unlisted"
    return next((c for c, cat in _REFUSED_FIRST if cat.matches(symbol)), "unlisted")


def library_category(needed: str) -> str | None:
    """None for a DT_NEEDED library on the allow-list, else the category refusing it."""
    if ALLOWED_LIBRARIES.fullmatch(needed):
        return None
    return next((c for c, cat in CATEGORIES.items()
                 if cat.libraries and re.fullmatch(cat.libraries, needed)), "unlisted-library")


@dataclass(frozen=True)
class Finding:
    """One thing a library does that its category refuses; `detail` says what, e.g.
    "imports 'dlopen'"."""
    symbol: str
    category: str
    detail: str

    def to_json(self) -> dict:
        return {"symbol": self.symbol, "category": self.category, "detail": self.detail}


@dataclass(frozen=True)
class Inspection:
    """What a library needs and imports, grouped: `allowed` by category, `refused` and `granted`
    findings (a granted capability's findings move from refused to granted), the raw
    system-call instructions, and whether the CUDA runtime is linked in."""
    name: str
    needed: tuple[str, ...]
    imports: tuple[str, ...]
    allowed: Mapping[str, tuple[str, ...]]
    refused: tuple[Finding, ...]
    granted: tuple[Finding, ...]
    syscall_sites: tuple[str, ...]
    static_cuda_runtime: bool
    build: Mapping | None = None  # what the library says of its build (BUILD_SECTION), unverified

    @property
    def passed(self) -> bool:
        return not self.refused

    def problem(self) -> str | None:
        """The first refused finding as one line: the library, what it does, and what to do."""
        if self.passed:
            return None
        f = self.refused[0]
        if f.category in _UNLISTED:
            why = f"not on the allow-list of {_UNLISTED[f.category]}: {ALLOW_LIST}"
        else:
            why = f"{f.category}: refused; " + (
                CATEGORIES[f.category].fix or f"grant the capability '{f.category}' in the "
                                               f"spec's kernel block to allow it")
        return f"{self.name} {f.detail} ({why})"

    def to_json(self) -> dict:
        return {"name": self.name, "passed": self.passed, "problem": self.problem(),
                "needed": list(self.needed), "imports": list(self.imports),
                "allowed": {c: list(symbols) for c, symbols in self.allowed.items()},
                "refused": [f.to_json() for f in self.refused],
                "granted": [f.to_json() for f in self.granted],
                "syscall_sites": list(self.syscall_sites),
                "static_cuda_runtime": self.static_cuda_runtime, "build": self.build}

    def lines(self) -> list[str]:
        """What `trtmc kernel inspect` prints: one line a group, one a finding, the verdict last."""
        needs = ", ".join(map(as_typed, self.needed)) or "no libraries"
        out = [f"{self.name} needs: {needs}",
               f"imports: {len(self.imports)}"]
        for c, symbols in self.allowed.items():
            more = f", ... {len(symbols) - SHOWN_NAMES} more" if len(symbols) > SHOWN_NAMES else ""
            out.append(f"  {c}: {len(symbols)} ({', '.join(symbols[:SHOWN_NAMES])}{more})")
        out += [f"granted  {f.category}: {f.detail}" for f in self.granted]
        out += [f"refused  {f.category}: {f.detail}" for f in self.refused]
        out.append(f"raw system-call instructions: {', '.join(self.syscall_sites) or 'none'}")
        if self.build is not None:
            out.append(f"built, as the library states ({BUILD_SECTION}): "
                       f"{json.dumps(self.build, sort_keys=True)}")
        out.append("passed" if self.passed else f"refused: {self.problem()}")
        return out


def _checked_grants(grants: Iterable[str]) -> frozenset[str]:
    grants = frozenset(grants)
    for g in sorted(grants):
        if g not in CAPABILITIES:
            raise UserError(f"unknown capability {g!r} (capabilities: "
                            f"{', '.join(CAPABILITIES)})")
    return grants


def _dynamic(elf: ELFFile) -> tuple[list[str], list[str]]:
    """DT_NEEDED names and undefined symbol names (without @VERSION), as the loader reads them."""
    segment = next((s for s in elf.iter_segments() if isinstance(s, DynamicSegment)), None)
    if segment is None:
        raise ELFError("no dynamic segment")
    needed = [tag.needed for tag in segment.iter_tags("DT_NEEDED")]  # type: ignore[attr-defined]
    imports = {s.name.partition("@")[0] for s in segment.iter_symbols()
               if s["st_shndx"] == "SHN_UNDEF" and s.name}
    return needed, sorted(imports)


def _cuda_runtime_definition(elf: ELFFile) -> str | None:
    """A CUDA runtime function the library defines itself (.dynsym or .symtab), or None."""
    for section in elf.iter_sections():
        if not isinstance(section, SymbolTableSection):
            continue
        for name in CUDA_RUNTIME_DEFINITIONS:
            if any(s["st_shndx"] != "SHN_UNDEF" for s in section.get_symbol_by_name(name) or ()):
                return name
    return None


def _syscall_sites(elf: ELFFile, name: str) -> list[tuple[str, str]]:
    """(instruction, section+offset) of every system-call instruction a linear sweep of the
    executable sections meets; undecodable bytes are stepped over."""
    machine = elf["e_machine"]
    if machine not in _SYSCALL_INSTRUCTIONS:
        raise ELFError(f"machine {machine}; the system-call scan reads "
                       f"{' and '.join(_SYSCALL_INSTRUCTIONS)}")
    if elf.num_sections() == 0:
        raise ELFError("no section headers; the system-call scan reads executable sections")
    arch, mode, instructions = _SYSCALL_INSTRUCTIONS[machine]
    sections = [s for s in elf.iter_sections()
                if s["sh_flags"] & SH_FLAGS.SHF_EXECINSTR and s["sh_type"] != "SHT_NOBITS"]
    total = sum(s["sh_size"] for s in sections)
    if total > MAX_SWEEP_BYTES:
        raise UserError(f"{name}: {total} bytes of executable sections, over the "
                        f"{MAX_SWEEP_BYTES} the system-call scan reads "
                        f"(pipeline.kernels.inspect.MAX_SWEEP_BYTES)")
    disassembler = capstone.Cs(arch, mode)
    disassembler.skipdata = True
    sites = []
    for section in sections:
        if section.compressed:  # no loader runs compressed code; and its size is unbounded
            raise ELFError(f"executable section {section.name} is compressed")
        code = section.data()
        if len(code) != section["sh_size"]:
            raise ELFError(f"section {section.name} ends past the end of the file")
        for offset, _, mnemonic, operands in disassembler.disasm_lite(code, 0):
            if mnemonic in instructions or f"{mnemonic} {operands}" in instructions:
                sites.append((f"{mnemonic} {operands}".strip(),
                              f"{as_typed(section.name)}+0x{offset:x}"))
    return sites


def _build_info(elf: ELFFile) -> dict | None:
    """The JSON object in the BUILD_SECTION section (an exporter's record of how it built the
    library: `trtmc kernel export`), or None when there is none or it is not one."""
    section = elf.get_section_by_name(BUILD_SECTION)
    if section is None or section["sh_type"] == "SHT_NOBITS" or section["sh_size"] > MAX_BUILD_BYTES:
        return None
    try:
        info = json.loads(section.data().split(b"\0", 1)[0].decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    return info if isinstance(info, dict) else None


def inspect_library(data: bytes, name: str, grants: Iterable[str] = ()) -> Inspection:
    """What the library `data` (called `name` in messages) needs, imports and does, each refused
    finding granted or not by `grants` (capability names, CAPABILITIES)."""
    grants = _checked_grants(grants)
    if len(data) > MAX_LIBRARY_BYTES:
        raise UserError(f"{name}: larger than the limit of {MAX_LIBRARY_BYTES} bytes "
                        f"(pipeline.kernels.bind.MAX_LIBRARY_BYTES)")
    try:
        elf = ELFFile(io.BytesIO(data))
        if elf["e_type"] != "ET_DYN":
            raise ELFError(f"ELF type {elf['e_type']}, not a shared object")
        needed, imports = _dynamic(elf)
        runtime = _cuda_runtime_definition(elf)
        sites = _syscall_sites(elf, name)
        build = _build_info(elf)
    except _MALFORMED as e:
        reason = " ".join(str(e).split()) or type(e).__name__
        raise UserError(f"{name}: not a shared library pyelftools can read ({reason})") from None

    findings = []
    if runtime is not None:
        findings.append(Finding(runtime, "cuda-static-runtime",
                                f"defines the CUDA runtime itself ({runtime!r}: nvcc linked "
                                f"libcudart_static)"))
    for library in needed:
        category = library_category(library)
        if category is not None:
            findings.append(Finding(library, category, f"needs the library {library!r}"))
    allowed: dict[str, list[str]] = {c: [] for c, cat in CATEGORIES.items() if cat.allowed}
    for symbol in imports:
        category = category_of(symbol)
        if category in allowed:
            allowed[category].append(symbol)
        else:
            findings.append(Finding(symbol, category, f"imports {symbol!r}"))
    findings += [Finding(instruction, "syscall",
                         f"has a raw system-call instruction '{instruction}' at {site}")
                 for instruction, site in sites]
    return Inspection(
        name=name, needed=tuple(needed), imports=tuple(imports),
        allowed=MappingProxyType({c: tuple(s) for c, s in allowed.items() if s}),
        refused=tuple(f for f in findings if f.category not in grants),
        granted=tuple(f for f in findings if f.category in grants),
        syscall_sites=tuple(f"{site}: {instruction}" for instruction, site in sites),
        static_cuda_runtime=runtime is not None, build=build)


def build_info_file(path: str | os.PathLike) -> dict | None:
    """What the library at `path` states of its build (BUILD_SECTION), read without the scans of
    `inspect_file`; None when it states nothing; a UserError when it is no readable ELF file."""
    data = read_regular(path, MAX_LIBRARY_BYTES, "pipeline.kernels.bind.MAX_LIBRARY_BYTES")
    try:
        return _build_info(ELFFile(io.BytesIO(data)))
    except _MALFORMED as e:
        raise UserError(f"{shown(path)}: not a shared library pyelftools can read "
                        f"({' '.join(str(e).split()) or type(e).__name__})") from None


def inspect_file(path: str | os.PathLike, grants: Iterable[str] = ()) -> Inspection:
    """`inspect_library` of a regular file (named by its path in messages)."""
    data = read_regular(path, MAX_LIBRARY_BYTES, "pipeline.kernels.bind.MAX_LIBRARY_BYTES")
    return inspect_library(data, shown(path), grants)
