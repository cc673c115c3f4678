"""A kernel host confines itself before it loads a kernel author's native library (a DSO).

The library runs with the host's privileges. Confined, it can neither reach the process that
judges it (no signals to it, no ptrace, no reading its /proc entry, no TCP, no other process's
memory) nor tell from its surroundings that it is being judged (the environment is one
allow-list, descriptors are closed, other processes' /proc entries are unreadable), and a host run
as root keeps no capability. Four mechanisms, in order: descriptors closed, capabilities dropped,
Landlock (the files it may read, write and run), a seccomp filter (the calls that reach other
processes or the kernel's administration). Linux only, plain ctypes; each says in one line what
it did, or "not available: <why>" where the kernel lacks it.

Landlock (before ABI 8) and capabilities are per thread: they bind the calling thread and the
threads it starts later, not threads already running. So the host confines itself before
anything starts a thread (OPENBLAS_NUM_THREADS=1 keeps numpy's import from starting one); a
line names the threads it could not reach. The seccomp filter reaches every thread.
"""
from __future__ import annotations

import ctypes
import errno
import os
import platform
import stat
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Mapping

# names kept in a kernel host's environment; a trailing "*" keeps every name with that prefix
ENV_ALLOWED = (
    "PATH", "HOME", "LANG", "LC_*", "TZ", "USER", "LOGNAME",
    "CUDA_VISIBLE_DEVICES", "CUDA_HOME", "CUDA_PATH", "NVIDIA_*", "LD_LIBRARY_PATH",
    "PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "XDG_CACHE_HOME",
    "HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_*", "TORCHINDUCTOR_*", "TRITON_*",
    "TORCH_CUDA_ARCH_LIST", "TMPDIR", "PYTHONUNBUFFERED",
)


def env_allowed(name: str) -> bool:
    return any(name.startswith(a[:-1]) if a.endswith("*") else name == a for a in ENV_ALLOWED)


def scrubbed_environment(env: Mapping[str, str], set_: Mapping[str, str] = {}) -> dict[str, str]:
    """The allowed subset of `env`, then `set_` on top. An allow-list, not a deny-list: what a
    kernel can observe must not differ between a gate and a production run, and a deny-list
    misses the next name a runner (a CI, a test harness, this pipeline) adds."""
    return {**{k: v for k, v in env.items() if env_allowed(k)}, **set_}


def close_descriptors(keep: Iterable[int]) -> None:
    """Close every open descriptor not in `keep`: an inherited one could reach the judge (a pipe,
    a lock, a log) or show that a harness started the host."""
    _close(keep)


def _close(keep: Iterable[int]) -> int:
    """close_descriptors; how many it closed (-1 where /proc/self/fd could not be listed)."""
    keep = set(keep)
    try:
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:
        bounds = sorted(k for k in keep if k >= 0)
        for low, high in zip([-1] + bounds, bounds + [os.sysconf("SC_OPEN_MAX")]):
            if low + 1 < high:  # closerange(0, 0) closes every descriptor (CPython 3.11)
                os.closerange(low + 1, high)
        return -1
    closed = 0
    for fd in fds:
        if fd not in keep:
            try:
                os.close(fd)
                closed += 1
            except OSError:  # the listing's own descriptor, closed already
                pass
    return closed


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.prctl.restype = ctypes.c_int

PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
PR_GET_SECCOMP, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 21, 22, 2


def _prctl(option: int, *args: int) -> int:
    """prctl(option, *args), unnamed arguments 0; -1 raises OSError."""
    args = (option, *args) + (0,) * (4 - len(args))
    result = _libc.prctl(*(ctypes.c_ulong(a) for a in args))
    if result == -1:
        e = ctypes.get_errno()
        raise OSError(e, f"prctl({option}): {os.strerror(e)}")
    return result


def _syscall(nr: int, *args) -> int:
    """syscall(nr, *args): ints travel as longs (the call reads every argument as one); -1
    raises OSError."""
    ctypes.set_errno(0)
    result = _libc.syscall(ctypes.c_long(nr),
                           *(ctypes.c_long(a) if isinstance(a, int) else a for a in args))
    if result == -1:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return result


def _other_threads() -> int:
    try:
        return len(os.listdir("/proc/self/task")) - 1
    except OSError:
        return 0


def _listed(paths: list, most: int = 3) -> str:
    shown = ", ".join(str(p) for p in paths[:most]) or "nothing"
    return shown + (f" and {len(paths) - most} more" if len(paths) > most else "")


# Landlock: the syscalls are these numbers on x86-64 and aarch64 alike
LANDLOCK_CREATE_RULESET, LANDLOCK_ADD_RULE, LANDLOCK_RESTRICT_SELF = 444, 445, 446
LANDLOCK_CREATE_RULESET_VERSION = 1
LANDLOCK_RULE_PATH_BENEATH = 1
LANDLOCK_RESTRICT_SELF_TSYNC = 1 << 3  # ABI 8: every thread of the process
(FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR, FS_REMOVE_DIR, FS_REMOVE_FILE,
 FS_MAKE_CHAR, FS_MAKE_DIR, FS_MAKE_REG, FS_MAKE_SOCK, FS_MAKE_FIFO, FS_MAKE_BLOCK, FS_MAKE_SYM,
 FS_REFER, FS_TRUNCATE, FS_IOCTL_DEV) = (1 << i for i in range(16))
NET_BIND_TCP, NET_CONNECT_TCP = 1, 2
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1, 2
FS_FILE_RIGHTS = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE | FS_IOCTL_DEV
FS_READ = FS_READ_FILE | FS_READ_DIR
# what a runtime reads of /proc beside its own /proc/<pid>: none of it names another process
PROC_SHARED = ("cpuinfo", "meminfo", "stat", "sys", "driver", "devices", "filesystems",
               "version", "loadavg", "uptime")
DEVICES = ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random", "/dev/shm")
_PINNED: list[int] = []  # O_PATH descriptors of /proc rules, kept open (see _add_rule)


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1  # __attribute__((packed)): 12 bytes
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def landlock_abi() -> int:
    """The kernel's Landlock ABI version; OSError (ENOSYS, EOPNOTSUPP) where it has none."""
    return _syscall(LANDLOCK_CREATE_RULESET, None, 0, LANDLOCK_CREATE_RULESET_VERSION)


def _handled(abi: int) -> _RulesetAttr:
    fs = (1 << 13) - 1
    fs |= (FS_REFER if abi >= 2 else 0) | (FS_TRUNCATE if abi >= 3 else 0)
    fs |= FS_IOCTL_DEV if abi >= 5 else 0
    net = NET_BIND_TCP | NET_CONNECT_TCP if abi >= 4 else 0
    scoped = SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if abi >= 6 else 0
    return _RulesetAttr(fs, net, scoped)


def _add_rule(ruleset: int, path: str | Path, rights: int) -> bool:
    """Allow `rights` beneath `path` (file rights only where it is not a directory); False where
    it does not exist. A procfs inode is made afresh when its dentry is looked up again, so a
    /proc rule's descriptor stays open: the dentry, and the inode the rule names, stay."""
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return False
    try:
        if not stat.S_ISDIR(os.fstat(fd).st_mode):
            rights &= FS_FILE_RIGHTS
        rule = _PathBeneath(rights, fd)
        _syscall(LANDLOCK_ADD_RULE, ruleset, LANDLOCK_RULE_PATH_BENEATH, ctypes.byref(rule), 0)
    except OSError as e:
        os.close(fd)
        raise OSError(e.errno, f"Landlock rule for {path}: {e.strerror}") from None
    if str(path).startswith("/proc/"):
        _PINNED.append(fd)
    else:
        os.close(fd)
    return True


def apply_landlock(*, read: Iterable[str | Path], write: Iterable[str | Path],
                   execute: Iterable[str | Path],
                   proc_self: bool = True) -> str:
    """Restrict this thread (every thread from ABI 8) and what it starts to reading `read`,
    running `execute`, writing `write`, its own /proc/<pid> (`proc_self`) and the devices a
    runtime opens; no TCP, and (ABI 6) no signals to, or abstract sockets of, processes outside.
    /proc itself is not granted: no other process's cmdline, environ or memory."""
    try:
        abi = landlock_abi()
    except OSError as e:
        known = {errno.ENOSYS: "the kernel has no Landlock", errno.EOPNOTSUPP: "Landlock is disabled"}
        why = known.get(e.errno or 0, e.strerror or str(e))
        return f"not available: {why}"
    _prctl(PR_SET_NO_NEW_PRIVS, 1)
    attr = _handled(abi)
    size = 8 if abi < 4 else 16 if abi < 6 else 24
    ruleset = _syscall(LANDLOCK_CREATE_RULESET, ctypes.byref(attr), size, 0)
    try:
        every = attr.handled_access_fs
        granted = {"read": [p for p in read if _add_rule(ruleset, p, FS_READ)],
                   "execute": [p for p in execute if _add_rule(ruleset, p, FS_EXECUTE | FS_READ)],
                   "write": [p for p in write if _add_rule(ruleset, p, every)]}
        device = FS_FILE_RIGHTS & ~FS_EXECUTE & every | FS_READ_DIR  # files only, on a file
        devices = [p for p in DEVICES + _nvidia_devices()
                   if _add_rule(ruleset, p, every if p == "/dev/shm" else device)]
        if proc_self:  # written too: the CUDA driver fails to start on a read-only own /proc entry
            _add_rule(ruleset, f"/proc/{os.getpid()}", FS_READ | (FS_WRITE_FILE | FS_TRUNCATE) & every)
            for name in PROC_SHARED:
                _add_rule(ruleset, f"/proc/{name}", FS_READ)
        others = _other_threads()
        flags = LANDLOCK_RESTRICT_SELF_TSYNC if abi >= 8 else 0
        _syscall(LANDLOCK_RESTRICT_SELF, ruleset, flags)
    finally:
        os.close(ruleset)
    return _landlock_line(abi, granted, devices, proc_self, others if abi < 8 else 0)


def _nvidia_devices() -> tuple[str, ...]:
    try:
        return tuple(sorted(f"/dev/{n}" for n in os.listdir("/dev") if n.startswith("nvidia")))
    except OSError:
        return ()


def _landlock_line(abi: int, granted: dict, devices: list, proc_self: bool, others: int) -> str:
    line = (f"applied (ABI {abi}): read {_listed(granted['read'])}, execute "
            f"{_listed(granted['execute'])}, writable: {_listed(granted['write'])}; "
            f"{len(devices)} devices ({_listed([Path(d).name for d in devices], 8)})")
    line += f", own /proc/{os.getpid()}" if proc_self else ", no /proc"
    line += "; no TCP" if abi >= 4 else "; TCP not covered (ABI < 4)"
    line += "; signals and abstract sockets scoped" if abi >= 6 else ""
    if others:
        line += f"; {others} thread(s) running before it are not confined (ABI < 8)"
    return line


# seccomp: classic BPF over struct seccomp_data {int nr; u32 arch; u64 ip; u64 args[6];}
BPF_LD_W_ABS, BPF_JEQ_K, BPF_JGE_K, BPF_RET_K = 0x20, 0x15, 0x35, 0x06
SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO = 0x7FFF0000, 0x00050000
SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_TSYNC = 1, 1
X32_SYSCALL_BIT = 0x40000000
AF_UNIX = 1
# calls that reach another process, load code into the kernel or change what the process sees
REFUSED = ("ptrace", "process_vm_readv", "process_vm_writev", "pidfd_open", "pidfd_getfd",
           "pidfd_send_signal", "kcmp", "process_madvise", "mount", "umount2", "pivot_root",
           "chroot", "setns", "unshare", "bpf", "perf_event_open", "kexec_load", "kexec_file_load",
           "init_module", "finit_module", "delete_module", "reboot", "keyctl", "add_key",
           "request_key", "userfaultfd", "tkill",
           # the new mount API, and io_uring (its requests open sockets past the filter)
           "open_tree", "move_mount", "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr",
           "io_uring_setup", "io_uring_enter", "io_uring_register")
OWN_PID_ONLY = ("kill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo")  # arg0 is a pid
UNIX_ONLY = ("socket", "socketpair")  # arg0 is the family
EXEC = ("execve", "execveat")
_COMMON = {"pidfd_open": 434, "pidfd_getfd": 438, "pidfd_send_signal": 424, "process_madvise": 440,
           "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432,
           "fspick": 433, "mount_setattr": 442, "io_uring_setup": 425, "io_uring_enter": 426,
           "io_uring_register": 427}
# (seccomp_data.arch, syscall numbers) per machine
SYSCALLS = {
    "x86_64": (0xC000003E, {
        **_COMMON, "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "kcmp": 312,
        "mount": 165, "umount2": 166, "pivot_root": 155, "chroot": 161, "setns": 308,
        "unshare": 272, "bpf": 321, "perf_event_open": 298, "kexec_load": 246,
        "kexec_file_load": 320, "init_module": 175, "finit_module": 313, "delete_module": 176,
        "reboot": 169, "keyctl": 250, "add_key": 248, "request_key": 249, "userfaultfd": 323,
        "tkill": 200, "kill": 62, "tgkill": 234, "rt_sigqueueinfo": 129,
        "rt_tgsigqueueinfo": 297, "socket": 41, "socketpair": 53, "execve": 59, "execveat": 322,
        "capset": 126, "seccomp": 317}),
    "aarch64": (0xC00000B7, {
        **_COMMON, "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271, "kcmp": 272,
        "mount": 40, "umount2": 39, "pivot_root": 41, "chroot": 51, "setns": 268, "unshare": 97,
        "bpf": 280, "perf_event_open": 241, "kexec_load": 104, "kexec_file_load": 294,
        "init_module": 105, "finit_module": 273, "delete_module": 106, "reboot": 142,
        "keyctl": 219, "add_key": 217, "request_key": 218, "userfaultfd": 282, "tkill": 130,
        "kill": 129, "tgkill": 131, "rt_sigqueueinfo": 138, "rt_tgsigqueueinfo": 240,
        "socket": 198, "socketpair": 199, "execve": 221, "execveat": 281, "capset": 91,
        "seccomp": 277}),
}


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8),
                ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(_SockFilter))]


def _arg(i: int, high: bool = False) -> int:
    """The offset of argument i's low (or high) 32 bits in seccomp_data."""
    return 16 + 8 * i + (4 if high == (sys.byteorder == "little") else 0)


def _program(machine: str, allow_exec: bool, pid: int) -> list[tuple[int, int, int, int]]:
    """The filter, as (code, jt, jf, k): jumps name labels ("deny", "allow", "unix", "own")
    resolved to offsets at the end."""
    arch, nr = SYSCALLS[machine]
    deny_nrs = [nr[n] for n in REFUSED + (() if allow_exec else EXEC)]
    prog: list = [(BPF_LD_W_ABS, 0, 0, 4), (BPF_JEQ_K, 0, "deny", arch), (BPF_LD_W_ABS, 0, 0, 0)]
    if machine == "x86_64":
        prog.append((BPF_JGE_K, "deny", 0, X32_SYSCALL_BIT))
    prog += [(BPF_JEQ_K, "deny", 0, n) for n in deny_nrs]
    prog += [(BPF_JEQ_K, "unix", 0, nr[n]) for n in UNIX_ONLY]
    prog += [(BPF_JEQ_K, "own", 0, nr[n]) for n in OWN_PID_ONLY]
    prog.append((BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW))
    prog += [("unix", None), (BPF_LD_W_ABS, 0, 0, _arg(0)), (BPF_JEQ_K, "allow", "deny", AF_UNIX)]
    prog += [("own", None), (BPF_LD_W_ABS, 0, 0, _arg(0, high=True)), (BPF_JEQ_K, 0, "deny", 0),
             (BPF_LD_W_ABS, 0, 0, _arg(0)), (BPF_JEQ_K, "allow", 0, pid)]
    prog += [("deny", SECCOMP_RET_ERRNO | errno.EPERM), ("allow", SECCOMP_RET_ALLOW)]
    return _resolved(prog)


def _resolved(prog: list) -> list[tuple[int, int, int, int]]:
    """Labels out: ("label", k) is a return of k (or, with k None, a mark) at that label."""
    at: dict[str, int] = {}
    out: list[tuple] = []
    for item in prog:
        if isinstance(item[0], str):
            at[item[0]] = len(out)
            if item[1] is not None:
                out.append((BPF_RET_K, 0, 0, item[1]))
        else:
            out.append(item)

    def offset(here: int, target) -> int:
        if not isinstance(target, str):
            return target
        step = at[target] - here - 1
        assert 0 <= step < 256, (target, step)
        return step
    return [(code, offset(i, jt), offset(i, jf), k) for i, (code, jt, jf, k) in enumerate(out)]


def _machine() -> str:
    machine = platform.machine()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(machine.lower(), machine)


def apply_seccomp(*, allow_exec: bool) -> str:
    """Refuse (EPERM, so a runtime that probes a call goes on) the calls that reach another
    process or the kernel's administration, sockets other than AF_UNIX, signals to any process
    but this one, and, unless `allow_exec`, exec. Every thread gets the filter where the kernel
    can (SECCOMP_FILTER_FLAG_TSYNC)."""
    machine = _machine()
    if machine not in SYSCALLS:
        return f"not available: no syscall table for {machine}"
    pid = os.getpid()
    program = _program(machine, allow_exec, pid)
    filters = (_SockFilter * len(program))(*(_SockFilter(*i) for i in program))
    fprog = _SockFprog(len(program), filters)
    try:
        _prctl(PR_GET_SECCOMP)
    except OSError:
        return "not available: the kernel has no seccomp"
    _prctl(PR_SET_NO_NEW_PRIVS, 1)
    scope = _install(SYSCALLS[machine][1]["seccomp"], fprog)
    return (f"applied ({machine}, {len(program)} instructions, {scope}): EPERM for "
            f"{len(REFUSED)} calls ({_listed(list(REFUSED), 4)}), sockets but AF_UNIX, "
            f"signals but to pid {pid}, " + ("" if allow_exec else "exec, ")
            + ("x32, " if machine == "x86_64" else "") + "other architectures"
            + ("; exec allowed" if allow_exec else ""))


def _install(seccomp_nr: int, fprog: _SockFprog) -> str:
    """The filter on every thread (SECCOMP_FILTER_FLAG_TSYNC), or through prctl on this one where
    the kernel has no seccomp call; says which."""
    try:
        tid = _syscall(seccomp_nr, SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_TSYNC,
                       ctypes.byref(fprog))
    except OSError as e:
        if e.errno != errno.ENOSYS:
            raise OSError(e.errno, f"seccomp: {e.strerror}") from None
        _prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(fprog))
        others = _other_threads()
        return "this thread" + (f", {others} running before it not" if others else "")
    if tid:
        raise OSError(errno.EBUSY, f"seccomp: thread {tid} could not take the filter")
    return "every thread"


_LINUX_CAPABILITY_VERSION_3 = 0x20080522


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


def drop_capabilities() -> str:
    """Empty the bounding, ambient, effective, permitted and inheritable sets: a host run as root
    keeps no privilege (no CAP_SYS_PTRACE, CAP_DAC_OVERRIDE, CAP_SYS_ADMIN), and nothing it runs
    gets one back. Per thread: threads already running keep theirs."""
    dropped, bounding = 0, "dropped from the bounding set"
    for cap in range(64):
        try:
            _prctl(PR_CAPBSET_DROP, cap)
        except OSError as e:
            if e.errno == errno.EPERM:  # no CAP_SETPCAP: nothing to drop it with
                bounding = "bounding set kept (no CAP_SETPCAP)"
            elif e.errno != errno.EINVAL:  # EINVAL: past the last capability the kernel knows
                raise
            break
        dropped += 1
    try:
        _prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
    except OSError as e:
        if e.errno != errno.EINVAL:  # a kernel before ambient capabilities
            raise
    _capset_none()
    others = _other_threads()
    return (f"applied: {dropped} {bounding}; effective, permitted, inheritable and ambient "
            f"cleared" + (f"; {others} thread(s) running before it keep theirs" if others else ""))


def _capset_none() -> None:
    header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    machine = _machine()
    if machine in SYSCALLS:
        _syscall(SYSCALLS[machine][1]["capset"], ctypes.byref(header), data)
    elif _libc.capset(ctypes.byref(header), data) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"capset: {os.strerror(e)}")


@dataclass(frozen=True)
class Confinement:
    """What `confine` did, one line per mechanism, for a report."""
    descriptors: str
    environment: str
    capabilities: str
    landlock: str
    seccomp: str

    def as_dict(self) -> dict[str, str]:
        return asdict(self)


def confine(*, read: Iterable[str | Path], write: Iterable[str | Path],
            execute: Iterable[str | Path],
            allow_exec: bool, keep_fds: Iterable[int]) -> Confinement:
    """Confine this process before it loads a kernel's library: descriptors but `keep_fds`
    closed, capabilities dropped, Landlock, then the seccomp filter. The environment is scrubbed
    by whoever starts the process (it is read at startup); this records whether it was."""
    keep = sorted(set(keep_fds))
    closed = _close(keep)
    descriptors = (f"applied: {closed if closed >= 0 else 'all others'} closed, kept "
                   f"{', '.join(map(str, keep)) or 'none'}")
    extra = sorted(k for k in os.environ if not env_allowed(k))
    environment = ("scrubbed to pipeline.confine.ENV_ALLOWED" if not extra else
                   f"not scrubbed: {len(extra)} names outside pipeline.confine.ENV_ALLOWED: "
                   + ", ".join(extra))
    capabilities = drop_capabilities()
    landlock = apply_landlock(read=read, write=write, execute=execute)
    seccomp = apply_seccomp(allow_exec=allow_exec)
    return Confinement(descriptors, environment, capabilities, landlock, seccomp)
