"""The offline Hugging Face cache, through huggingface_hub's own cache API.

Hub ids resolve to a snapshot folder of the local cache (`HF_HOME`, `HF_HUB_CACHE`), never to the
network: a ref such as `main` resolves to its commit. `add_to_cache` files a local checkpoint into
the cache in the hub's own layout (blobs, a snapshot of symlinks, a ref), which is how a machine
without hub access gets a model the tutorial names by hub id.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
from pathlib import Path

from pipeline.errors import UserError
from pipeline.files import atomic_write_bytes, staged_dir, staged_file

# ORG/NAME; no '--' (the cache folder models--ORG--NAME could not be told apart) nor '..'
REPO_ID = re.compile(r"(?!.*--)(?!.*\.\.)[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
COMMIT = re.compile(r"[0-9a-f]{40}")
# a ref name: main, pr/1; no part starts with '.', so no '..'
REF = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(?:/[A-Za-z0-9][A-Za-z0-9._-]*)*")
# .../models--ORG--NAME/snapshots/<commit>: a cached revision named by its folder
SNAPSHOT_DIR = re.compile(r"models--(?P<org>[^/]+?)--(?P<name>[^/]+)/snapshots/(?P<commit>[0-9a-f]{40})")


def cache_dir() -> Path:
    from huggingface_hub import constants
    return Path(os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE)


def is_repo_id(text: str) -> bool:
    return REPO_ID.fullmatch(text) is not None


def snapshot_identity(path: Path) -> tuple[str, str] | None:
    """(repo id, commit) of a folder that is a cached hub snapshot, else None."""
    real = Path(os.path.realpath(path)).as_posix()
    m = SNAPSHOT_DIR.search(real)
    if m is None or not real.endswith(m.group(0)):
        return None
    return f"{m['org']}/{m['name']}", m["commit"]


def resolve(repo_id: str, revision: str) -> tuple[Path, str]:
    """-> (snapshot folder, commit) of repo_id@revision in the local cache; never downloads."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError
    try:
        folder = Path(snapshot_download(repo_id, revision=revision, local_files_only=True,
                                        cache_dir=cache_dir()))
    except (LocalEntryNotFoundError, FileNotFoundError, OSError):
        raise UserError(
            f"{repo_id}@{revision}: not in the local Hugging Face cache {cache_dir()} (nothing is "
            f"downloaded; fill it with `huggingface-cli download {repo_id} --revision {revision}` "
            f"where the hub is reachable, or `trtmc model cache DIR --repo-id {repo_id} "
            f"--revision COMMIT`)") from None
    if not (folder / "config.json").is_file():
        raise UserError(f"{folder}: cached snapshot of {repo_id} has no config.json")
    return folder, folder.name


def _git_blob_sha(data_path: Path) -> str:
    h = hashlib.sha1(f"blob {data_path.stat().st_size}\0".encode())
    with open(data_path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def add_to_cache(source: Path, repo_id: str, commit: str, ref: str | None = "main") -> Path:
    """Copy the files of `source` into the cache as repo_id@commit (and point `ref` at it)."""
    if not is_repo_id(repo_id):
        raise UserError(f"repo id {repo_id!r}: expected ORG/NAME")
    if not COMMIT.fullmatch(commit):
        raise UserError(f"revision {commit!r}: expected a 40-hex-digit commit hash")
    if ref is not None and not REF.fullmatch(ref):
        raise UserError(f"ref {ref!r}: expected a ref name such as main or pr/1 (letters, digits, "
                        f"'.', '_', '-', parts joined by '/', none starting with '.')", param="ref")
    source = Path(source)
    if not (source / "config.json").is_file():
        raise UserError(f"{source}: no config.json (expected a Hugging Face model directory)")
    repo = cache_dir() / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    if snapshot.exists():
        raise UserError(f"{snapshot}: already cached (the cache is never overwritten)")
    with staged_dir(snapshot) as staging:
        for f in sorted(source.iterdir()):
            if not f.is_file():
                continue
            blob = repo / "blobs" / _git_blob_sha(f)
            if not blob.exists():
                with staged_file(blob) as tmp:
                    shutil.copyfile(f, tmp)
            (staging / f.name).symlink_to(os.path.relpath(blob, snapshot))
    if ref:
        atomic_write_bytes(repo / "refs" / ref, commit.encode())
    return snapshot
