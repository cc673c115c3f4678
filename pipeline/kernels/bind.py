"""Binding: load each manifest entry's DSO function and check it against its kernel slot.

Every check runs before anything is returned, so a bad manifest constructs nothing. The result is
read-only: a constructed pipeline cannot be rebound; open a new one with another manifest.
A bound function's parameters are its slot's call signature (pipeline/graph/abi.py: Signature):
boundary inputs, one uint8 workspace tensor when workspace_bytes > 0, boundary outputs, extra args
(int / float / None).
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import struct
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Mapping, Sequence

from pipeline.kernels.manifest import Binding, Manifest, load_manifest
from pipeline.errors import UserError
from pipeline.graph.abi import Signature
from pipeline.files import read_regular
from pipeline import isolation
from pipeline.log import get as log_topic

# Parameter types in TVM-FFI signature metadata that accept each kind of argument.
ACCEPTED_TYPES = {
    "tensor": {"DLTensor*", "ffi.Tensor", "Any"},
    "int": {"int", "Any"},
    "float": {"float", "Any"},
    "none": {"None", "Optional", "void*", "Any"},
    "ptr": {"void*", "Optional", "None", "Any"},
}


log = log_topic("bind")


def _frozen(value: Any) -> Any:
    if isinstance(value, Mapping):
        return MappingProxyType({k: _frozen(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    return value


@dataclass(frozen=True)
class BoundKernel:
    """One slot's kernel: calling it forwards to the TVM-FFI function (it writes its outputs)."""
    binding_id: str
    library: Path
    library_sha256: str  # of the bytes loaded (a private copy of `library`, read once)
    function: str
    abi: Mapping[str, Any]
    abi_sha256: str
    signature: str  # "checked" against the ABI, or "unknown" (the DSO carries no metadata)
    _fn: Callable = field(repr=False, compare=False)

    @functools.cached_property
    def label(self) -> str:
        return f"'{self.binding_id}' ({self.library.name}:{self.function})"

    def __call__(self, *args):
        heartbeat = isolation.HEARTBEAT  # in a worker: this call's time limit runs
        try:
            if heartbeat is None:
                return self._fn(*args)
            heartbeat.enter(self.label)
            try:
                return self._fn(*args)
            finally:
                heartbeat.leave()
        except Exception as e:  # TVM-FFI raises the kernel's error as a Python exception
            said = str(e).strip()[:MAX_KERNEL_ERROR] or type(e).__name__
            raise UserError(f"kernel '{self.binding_id}' ({self.library.name}:{self.function}) "
                            f"raised: {said}") from e


def _param_types(metadata: dict | None) -> list[str] | None:
    """Parameter type names from TVM-FFI signature metadata; None when absent or unreadable."""
    if metadata is None:
        return None
    try:
        schema = json.loads(metadata["type_schema"])
        return [p["type"] for p in schema["named_args"]["params"]]
    except (TypeError, KeyError, ValueError):
        return None


def _check_signature(manifest: Manifest, b: Binding, params: list[str], abi: Mapping) -> None:
    expected = Signature.of(abi).params
    ok = len(params) == len(expected) and all(
        t in ACCEPTED_TYPES[p.type] for t, p in zip(params, expected))
    if not ok:
        want = ", ".join(f"{p.label}: {p.type}" for p in expected)
        raise UserError(f"{manifest.path}: {b.where}: {b.library.name}:{b.function} takes "
                        f"({', '.join(params)}) per its signature metadata, but slot '{b.id}' "
                        f"calls it with {len(expected)} args ({want})")


# ELF e_machine of each architecture platform.machine() names (others are not checked)
_ELF_MACHINES = {"x86_64": 62, "aarch64": 183}
_ELF_HEADER = struct.Struct("<16sHHIQQQIHHHHHH")  # Elf64_Ehdr, little-endian
_ELF_PHDR = struct.Struct("<IIQQQQQQ")            # Elf64_Phdr
MAX_LIBRARY_BYTES = 1 << 30  # a kernel library is read whole, hashed and copied before dlopen
MAX_KERNEL_ERROR = 4000      # characters of a kernel's own error message kept in ours


def elf_problem(data: bytes) -> str | None:
    """Why `data` is not a complete 64-bit little-endian ELF shared object for this machine, or
    None. Checked before dlopen: a truncated library dies with SIGBUS once mapped, and a library's
    constructors run inside dlopen."""
    size = len(data)
    head = data[:_ELF_HEADER.size]
    if len(head) < _ELF_HEADER.size or head[:4] != b"\x7fELF":
        return "not an ELF file"
    if head[4] != 2 or head[5] != 1:
        return "not a 64-bit little-endian ELF file"
    (_, e_type, machine, _, _, phoff, shoff, _, _, phentsize, phnum, shentsize, shnum,
     _) = _ELF_HEADER.unpack(head)
    if e_type != 3:
        return f"ELF type {e_type}, not a shared object (3)"
    expected = _ELF_MACHINES.get(platform.machine())
    if expected is not None and machine != expected:
        return f"ELF machine {machine}, but this machine ({platform.machine()}) is {expected}"
    if phnum and phentsize != _ELF_PHDR.size or phoff + phnum * phentsize > size:
        return f"truncated: program headers end past the file's {size} bytes"
    if shnum and shoff + shnum * shentsize > size:
        return f"truncated: section headers end at byte {shoff + shnum * shentsize}, the " \
               f"file has {size}"
    table = data[phoff:phoff + phnum * phentsize]
    for i, (_, _, offset, _, _, filesz, _, _) in enumerate(_ELF_PHDR.iter_unpack(table)):
        if offset + filesz > size:
            return f"truncated: segment {i} ends at byte {offset + filesz}, the file has {size}"
    return None


class _LoadFailed(Exception):
    """dlopen's reason, one line, naming no private path."""


_LOADED: dict[str, Any] = {}  # sha256 of a library's bytes -> its module, loaded once per process


def _module(data: bytes, digest: str):
    """The module of these bytes: loaded once per process, from a private copy removed once
    loaded (a mapped library needs no file). The bytes checked are then the bytes loaded, and a
    library written where this process loaded another is loaded anew (the dynamic loader hands
    back what it first loaded from a path name). The same bytes, from any path, are one module,
    as dlopen makes one path: a library's constructors run once (TVM-FFI aborts on a global
    function registered twice), and its static state is shared. So a library that registers
    global functions at load can be bound at one version per process."""
    if digest not in _LOADED:
        import tvm_ffi
        with tempfile.TemporaryDirectory(prefix="trtmc-kernel-") as folder:
            copy = Path(folder) / f"{digest[:16]}.so"
            copy.write_bytes(data)
            try:
                # its constructors run here, inside a call's time limit
                with isolation.calling(f"loading a library ({digest[:12]})"):
                    _LOADED[digest] = tvm_ffi.load_module(str(copy))
            except Exception as e:  # tvm_ffi raises RuntimeError: the caller names the library
                reason = str(e).strip().splitlines()[-1].replace(str(copy), "it")
                raise _LoadFailed(reason) from None
    return _LOADED[digest]


# loader failures that come from loading a private copy, and what to do about them
_COPY_HINTS = {
    "cannot open shared object file": "; trtmc loads a private copy of the library, so a "
                                      "dependency found through $ORIGIN is not found: put it on "
                                      "LD_LIBRARY_PATH or link it by absolute path",
    "failed to map segment": "; the private copy lies under TMPDIR, which must allow execution",
}


def _load(manifest: Manifest, b: Binding, abi: Mapping) -> BoundKernel:
    data = read_regular(b.library, MAX_LIBRARY_BYTES, "pipeline.kernels.bind.MAX_LIBRARY_BYTES")
    problem = elf_problem(data)
    if problem is not None:
        raise UserError(f"{manifest.path}: {b.where}.library: {b.library} failed to load: "
                        f"{problem} (checked before loading it)")
    digest = hashlib.sha256(data).hexdigest()
    try:
        module = _module(data, digest)
    except _LoadFailed as e:
        why = str(e)
        hint = next((h for needle, h in _COPY_HINTS.items() if needle in why), "")
        raise UserError(f"{manifest.path}: {b.where}.library: {b.library} failed to load "
                        f"({why}){hint}") from None
    if not module.implements_function(b.function):
        raise UserError(f"{manifest.path}: {b.where}.function: {b.library.name} has no TVM-FFI "
                        f"function '{b.function}' (expected a TVM_FFI_DLL_EXPORT_TYPED_FUNC export "
                        f"of that name)")
    params = _param_types(module.get_function_metadata(b.function))
    if params is None:
        log.info(f"{b.id}: {b.library.name}:{b.function} has no signature metadata; "
             f"argument kinds unchecked (signature unknown)")
    else:
        _check_signature(manifest, b, params, abi)
    return BoundKernel(b.id, b.library, digest, b.function, _frozen(abi), b.abi_sha256,
                       "unknown" if params is None else "checked", module.get_function(b.function))


def bind(manifest_path: str | os.PathLike,
         slots: Sequence[Mapping]) -> Mapping[str, BoundKernel]:
    """Bind every binding id of the slots (kernel_slots.json entries) exactly once, or raise and
    bind nothing; the slots of one id (many instances of a recipe) share its ABI and its kernel."""
    manifest = load_manifest(manifest_path)
    by_slot: dict[str, Mapping] = {}
    for slot in slots:
        first = by_slot.setdefault(slot["binding_id"], slot)
        if first is not slot and ("instance_id" not in slot or first["abi_sha256"] !=
                                  slot["abi_sha256"] or first["engine_role"] != slot["engine_role"]):
            raise UserError(f"kernel slots: slot '{slot['binding_id']}' appears twice (roles "
                            f"{first['engine_role']} and {slot['engine_role']}); one binding id "
                            f"is one slot, or many instances of one recipe with one ABI and role")
    bound_ids = {b.id for b in manifest.bindings}
    for b in manifest.bindings:
        if b.id not in by_slot:
            raise UserError(f"{manifest.path}: {b.where}.id: binding '{b.id}' matches no kernel "
                            f"slot (slots: {', '.join(sorted(by_slot)) or 'none'})")
    for slot_id, slot in by_slot.items():
        if slot_id not in bound_ids:
            raise UserError(f"{manifest.path}: slot '{slot_id}' (engine role "
                            f"{slot['engine_role']}) is left unbound; add a binding with this id")
    for b in manifest.bindings:
        expected = by_slot[b.id]["abi_sha256"]
        if b.abi_sha256 != expected:
            raise UserError(f"{manifest.path}: {b.where}.abi_sha256: ABI mismatch for '{b.id}': "
                            f"the manifest has {b.abi_sha256}, the slot expects {expected} "
                            f"(re-export the kernel for the current selection)")
    return MappingProxyType({b.id: _load(manifest, b, by_slot[b.id]["abi"])
                             for b in manifest.bindings})


def bind_slots(slots: Sequence[Mapping], kernel_bindings, where: str) -> Mapping[str, BoundKernel]:
    """Every slot of a bundle (`where`) bound exactly once from the manifest `kernel_bindings`,
    or a UserError and nothing bound; a native bundle (no slots) takes no manifest."""
    if not slots:
        if kernel_bindings is not None:
            raise UserError(f"kernel_bindings {kernel_bindings}: {where} has no kernel slots (a "
                            f"native bundle); the manifest binds nothing", param="kernel_bindings")
        return MappingProxyType({})
    if kernel_bindings is None:
        ids = ", ".join(dict.fromkeys(s["binding_id"] for s in slots))
        raise UserError(f"kernel_bindings: {where} is slot-ready and needs a binding manifest "
                        f"(unbound slots: {ids})", param="kernel_bindings")
    return bind(kernel_bindings, slots)
