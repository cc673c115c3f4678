"""Files that are never seen half-written: every artifact is staged beside its final path and
renamed into place (a rename within one folder is atomic), and a failed or killed write leaves
only a dot-named stage that the next write or `doit clean` removes."""
from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def staged_file(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temp path beside `path`; when the block succeeds it replaces `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(tmp)
    try:
        yield tmp
        os.chmod(tmp, 0o777 & ~_umask() if os.access(tmp, os.X_OK) else 0o666 & ~_umask())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def staged_dir(path: str | os.PathLike, *, replace: bool = False) -> Iterator[Path]:
    """Yield an empty temp folder beside `path`; when the block succeeds it becomes `path` (an
    existing `path` is removed first only when `replace`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    try:
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


def sha256_file(path: str | os.PathLike) -> str:
    """Digest of a file's bytes, read in chunks (bundles and DSOs can be large)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()
