"""Files that are never seen half-written: every artifact is staged beside its final path and
renamed into place (a rename within one folder is atomic), and a failed or killed write leaves
only a dot-named stage (`.NAME.PID.XXXX.tmp`) that the next write of NAME or `doit clean` removes
once process PID is gone. OS errors a user can fix come out as one-line UserErrors naming the file.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import importlib.util
import json
import os
import re
import shutil
import stat
import sys
import tempfile
from pathlib import Path
from typing import Iterator

from pipeline.errors import UserError

# errno values that are the user's to fix (a path, a permission, a full disk), not a bug
USER_ERRNOS = frozenset({errno.ENOENT, errno.EACCES, errno.EPERM, errno.EISDIR, errno.ENOTDIR,
                         errno.ELOOP, errno.ENAMETOOLONG, errno.ENOSPC, errno.EDQUOT, errno.EROFS,
                         errno.EEXIST, errno.ENOTEMPTY, errno.EBUSY, errno.ETXTBSY, errno.EXDEV,
                         errno.EFBIG})


# what str.splitlines breaks a line at, escaped as repr writes it
_LINE_BREAKS = {c: ascii(chr(c))[1:-1] for c in (0x0A, 0x0B, 0x0C, 0x0D, 0x1C, 0x1D, 0x1E, 0x85,
                                                 0x2028, 0x2029)}


def shown(path: str | os.PathLike) -> str:
    """A path (any name) for a one-line message: its line breaks escaped."""
    return os.fspath(path).translate(_LINE_BREAKS)


def os_error(path: str | os.PathLike, exc: OSError) -> UserError:
    """`exc` as a UserError naming `path`, e.g. "out/x.json: No space left on device"."""
    return UserError(f"{shown(path)}: {exc.strerror or exc}")


@contextlib.contextmanager
def user_os_errors(path: str | os.PathLike) -> Iterator[None]:
    """Turn a user-fixable OSError inside the block (a full disk, a file size limit, ...) into
    os_error: of the file it names, or of `path` when it names none, `path` itself or one of
    `path`'s stages."""
    try:
        yield
    except OSError as e:
        if e.errno not in USER_ERRNOS:
            raise
        named = e.filename if isinstance(e.filename, str) else None
        own = named in (None, os.fspath(path)) or \
            os.path.basename(named).startswith(f".{os.path.basename(path)}.")
        raise os_error(named if named is not None and not own else path, e) from None


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return True


def remove_stale_stages(path: str | os.PathLike) -> None:
    """Remove the stages of `path` whose writing process is gone (a SIGKILL leaves them)."""
    path = Path(path)
    own = re.compile(re.escape(f".{path.name}.") + r"([0-9]+)\.[a-z0-9_]+\.tmp")
    try:
        entries = list(os.scandir(path.parent))
    except FileNotFoundError:
        return
    for entry in entries:
        m = own.fullmatch(entry.name)
        if m and not _alive(int(m[1])):
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)


# kernel filesystems: a rename there would replace a device or a process's file descriptor link
_SYSTEM_FOLDERS = ("/dev", "/proc", "/sys")


def replaced(path: str | os.PathLike) -> str:
    """The path a rename onto `path` replaces: its folder resolved, its last part as given (a
    link there is replaced itself, not what it points to)."""
    absolute = os.path.abspath(path)
    return os.path.join(os.path.realpath(os.path.dirname(absolute)), os.path.basename(absolute))


def _system(path: str) -> bool:
    return any(path == d or path.startswith(d + os.sep) for d in _SYSTEM_FOLDERS) and \
        not path.startswith("/dev/shm" + os.sep)


def _prepare(path: Path, want_dir: bool) -> str:
    """The stage prefix for `path`, after refusing a target of the wrong kind and removing stale
    stages."""
    if _system(replaced(path)) or _system(os.path.realpath(path)):
        raise UserError(f"{shown(path)}: under {', '.join(_SYSTEM_FOLDERS)} (devices and process "
                        f"files are never replaced), expected the path of a file to write")
    if os.path.isdir(path) and not want_dir:
        raise UserError(f"{shown(path)}: is a directory, expected the path of a file to write")
    if os.path.exists(path) and not want_dir and not os.path.isfile(path):
        raise UserError(f"{shown(path)}: not a regular file (a FIFO, socket or device is never "
                        f"replaced), expected the path of a file to write")
    if os.path.lexists(path) and want_dir and (os.path.islink(path) or not os.path.isdir(path)):
        raise UserError(f"{shown(path)}: exists and is not a folder, expected a folder to write")
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_stages(path)
    return f".{path.name}.{os.getpid()}."


def refuse_overwriting(output: str | os.PathLike, inputs, name: str) -> None:
    """Refuse an output that is one of `inputs` or lies inside one (a bundle, a model folder):
    writing it would destroy what is being read. Compared as a rename replaces (`replaced`), and
    against each input both as named and as resolved, so a link (a hub snapshot's files are links
    to blobs) is no way around it. `name`: the output's parameter (or flag)."""
    if not os.fspath(output):
        raise UserError(f"{name} '': an empty path, expected the path to write", param=name)
    out = replaced(output)
    for given in (i for i in inputs if i):
        for read in {replaced(given), os.path.realpath(given)}:
            if out == read or out.startswith(read.rstrip(os.sep) + os.sep):
                raise UserError(f"{name} {shown(output)}: {'is' if out == read else 'lies inside'} "
                                f"{shown(given)}, which is read here; expected a path of its own",
                                param=name)


@contextlib.contextmanager
def staged_file(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temp path beside `path`; when the block succeeds it replaces `path`."""
    path = Path(path)
    with user_os_errors(path):
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=_prepare(path, False), suffix=".tmp")
        os.close(fd)
    tmp = Path(name)
    try:
        with user_os_errors(path):
            yield tmp
            os.chmod(tmp, 0o777 & ~_umask() if os.access(tmp, os.X_OK) else 0o666 & ~_umask())
            os.replace(tmp, path)
    finally:  # the block may have put something else there (an exporter's folder)
        if tmp.is_dir() and not tmp.is_symlink():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def staged_dir(path: str | os.PathLike, *, replace: bool = False) -> Iterator[Path]:
    """Yield an empty temp folder beside `path`; when the block succeeds it becomes `path` (an
    existing `path` is removed first only when `replace`)."""
    path = Path(path)
    with user_os_errors(path):
        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=_prepare(path, True), suffix=".tmp"))
    try:
        with user_os_errors(path):
            tmp.chmod(0o777 & ~_umask())  # mkdtemp's 0700 would outlive the rename
            yield tmp
            if replace and path.exists():
                shutil.rmtree(path)
            tmp.rename(path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    with staged_file(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    return Path(path)


def _kind_problem(mode: int) -> str | None:
    """Why a file of this mode is not read as a file, or None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return "is a directory"
    return "not a regular file (a FIFO, socket or device is never read)"


def file_problem(path: str | os.PathLike) -> str | None:
    """Why `path` (links followed) is no regular file to read: 'not found', 'is a directory',
    'not a regular file (...)' or the OS's reason; None when it is one. Callers put it after what
    the file is, e.g. f"{shown(p)}: kernel source {problem}", so every such refusal reads alike."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "not found"
    except ValueError:  # os refuses the name itself
        return "cannot be a file name (it holds a NUL character)"
    except OSError as e:
        if e.errno not in USER_ERRNOS:
            raise
        return f"cannot be read: {e.strerror or e}"
    return _kind_problem(mode)


@contextlib.contextmanager
def open_regular(path: str | os.PathLike) -> Iterator:
    """A regular file opened for reading; a folder, FIFO or device is refused before anything is
    read (O_NONBLOCK: opening a FIFO never waits for a writer)."""
    with user_os_errors(path):
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    problem = _kind_problem(os.fstat(fd).st_mode)
    if problem is not None:
        os.close(fd)
        raise UserError(f"{shown(path)}: {problem}, expected a file")
    with os.fdopen(fd, "rb") as f, user_os_errors(path):
        yield f


def read_regular(path: str | os.PathLike, max_bytes: int, limit_name: str) -> bytes:
    """A regular file's bytes, refused above `max_bytes` (`limit_name` says which constant)."""
    with open_regular(path) as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise UserError(f"{shown(path)}: larger than the limit of {max_bytes} bytes "
                        f"({limit_name})")
    return data


def sha256_file(path: str | os.PathLike) -> str:
    """Digest of a regular file's bytes, in one streaming pass (bundles and DSOs can be large)."""
    with open_regular(path) as f:
        return sha256_stream(f)


def sha256_stream(f) -> str:
    """Digest of what is left to read in the binary file `f`, in 16 MiB reads."""
    h = hashlib.sha256()
    for chunk in iter(lambda: f.read(1 << 24), b""):
        h.update(chunk)
    return h.hexdigest()


DIGEST_CACHE = "digests.json"  # under `cache_home()`


def cache_home() -> Path:
    """trtmc's per-user cache folder: $XDG_CACHE_HOME/trtmc ($XDG_CACHE_HOME: ~/.cache unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "trtmc"


# the package whose bytecode beside its installed source says whether this Python's packages
# were installed with theirs (pip writes it at install time; some images strip it)
BYTECODE_PROBE = "torch"


def _installed_with_bytecode() -> bool:
    spec = importlib.util.find_spec(BYTECODE_PROBE)
    origin = spec.origin if spec is not None else None
    return origin is not None and origin.endswith(".py") and \
        os.path.isfile(importlib.util.cache_from_source(origin))


def keep_bytecode() -> None:
    """Where this Python writes no bytecode (PYTHONDONTWRITEBYTECODE, as many GPU containers set),
    names no folder for it (PYTHONPYCACHEPREFIX) and its packages were installed without theirs,
    write and read it under `cache_home()`/pycache from here on. The optimized mode's first call
    imports Dynamo, Inductor, sympy and Triton, thousands of modules; compiling them from source
    in every process was most of a warm first call (docs/performance.md). Packages installed with
    their bytecode keep using it (a prefix would hide it, and a first process would compile
    everything again). Nothing is written beside the installed sources, and stale bytecode is
    recompiled as Python always does (by the source's size and time). The processes this one
    starts (stages, kernel workers) inherit it through the environment."""
    if not sys.dont_write_bytecode or sys.pycache_prefix is not None or _installed_with_bytecode():
        return
    sys.pycache_prefix, sys.dont_write_bytecode = str(cache_home() / "pycache"), False
    os.environ["PYTHONPYCACHEPREFIX"] = sys.pycache_prefix
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


def _digest_cache_path() -> Path:
    return cache_home() / DIGEST_CACHE


def cached_sha256(paths: list[Path]) -> list[str]:
    """sha256 of each file's bytes, remembered per machine by (path, size, mtime, inode): a file
    is hashed once where it lives, yet identified by its content, so a folder copied to another
    machine (new mtimes) has the same identity there. A cache that cannot be read or written is
    only a slower run."""
    cache_path = _digest_cache_path()
    try:
        cache = json.loads(cache_path.read_bytes()) if cache_path.is_file() else {}
        cache = cache if isinstance(cache, dict) else {}
    except (OSError, ValueError):
        cache = {}
    out, changed = [], False
    for p in paths:
        st = os.stat(p)
        key = f"{os.path.realpath(p)}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}"
        if not isinstance(cache.get(key), str):
            cache[key], changed = sha256_file(p), True
        out.append(cache[key])
    if changed:
        with contextlib.suppress(OSError):
            cache_path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(cache_path, json.dumps(cache).encode())
    return out


_HELD: dict[str, int] = {}  # lock file -> open fd, held until the process exits


def release_inherited_locks() -> None:
    """In a child forked from a process holding locks (`hold_lock`): close the child's copies of
    their descriptors, so the locks stay the parent's alone and go when the parent ends."""
    for fd in _HELD.values():
        os.close(fd)
    _HELD.clear()


def hold_lock(path: str | os.PathLike, what: str) -> None:
    """Hold an exclusive flock on `path` for the rest of this process, or refuse at once (one
    line naming the holder's pid) when another process holds it. The kernel drops the lock when
    the process ends, however it ends."""
    path = Path(path)
    if str(path) in _HELD:
        return
    with user_os_errors(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise UserError(f"{shown(path.parent)}: {what} (pid {holder}) holds {path.name}; wait "
                        f"for it to finish or stop it") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    _HELD[str(path)] = fd
