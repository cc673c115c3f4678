"""The binding manifest: which function of which DSO fills each kernel slot.

`{"schema_version": 1, "bindings": [{"id", "abi_sha256", "library", "function"}]}`. A `library` is
relative to the manifest and must stay inside the manifest's folder after resolving `..` and
symlinks, so a manifest cannot make the pipeline load an arbitrary library from elsewhere.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from pipeline import jsonio
from pipeline.errors import UserError
from pipeline.files import file_problem, shown, staged_file
from pipeline.graph.bounds import read_counted
from pipeline.graph.receipt import SelectionReceipt


@dataclass(frozen=True)
class Binding:
    id: str
    abi_sha256: str
    library: Path   # resolved, an existing file inside the manifest's folder
    function: str
    where: str      # JSON path of this entry in the manifest, for messages


@dataclass(frozen=True)
class Manifest:
    path: Path
    bindings: tuple[Binding, ...]


def _library(manifest: Path, value: str, where: str) -> Path:
    folder = Path(os.path.realpath(manifest.parent))
    at = f"{shown(manifest)}: {where}.library"
    if Path(value).is_absolute():
        raise UserError(f"{at}: {value!r} is absolute; expected a path relative to the "
                        f"manifest's folder {shown(folder)}")
    resolved = Path(os.path.realpath(folder / value))  # a symlink loop stays unresolved: ELOOP
    if not resolved.is_relative_to(folder):
        raise UserError(f"{at}: {value!r} resolves to {shown(resolved)}, outside the manifest's "
                        f"folder {shown(folder)} (through '..' or a symlink)")
    problem = file_problem(resolved)
    if problem is not None:
        raise UserError(f"{at}: library file {shown(resolved)} {problem}")
    return resolved


def load_manifest(path: str | os.PathLike) -> Manifest:
    """Schema-checked manifest with unique ids and every library an existing file in its folder."""
    path = Path(path)
    raw = read_counted(path, "binding")
    seen: dict[str, str] = {}
    bindings = []
    for i, entry in enumerate(raw["bindings"]):
        where = f"$.bindings[{i}]"
        if entry["id"] in seen:
            raise UserError(f"{path}: {where}.id: slot '{entry['id']}' is bound twice (also at "
                            f"{seen[entry['id']]}); bind each slot exactly once")
        seen[entry["id"]] = where
        bindings.append(Binding(entry["id"], entry["abi_sha256"],
                                _library(path, entry["library"], where), entry["function"], where))
    return Manifest(path, tuple(bindings))


def write_manifest(path: str | os.PathLike, receipts: Sequence[SelectionReceipt], library: str | os.PathLike,
                   function: str = "run") -> Path:
    """A manifest binding every receipt's slot to `function` of `library`, which must lie in the
    manifest's folder (it is written relative to it); the result is checked by loading it."""
    path = Path(path)
    folder = Path(os.path.realpath(path.parent))
    lib = Path(os.path.realpath(library))
    problem = file_problem(lib)
    if problem is not None:
        raise UserError(f"library {library}: {problem}", param="library")
    ids = [r.binding_id for r in receipts]
    if len(set(ids)) != len(ids):
        twice = next(i for i in ids if ids.count(i) > 1)
        raise UserError(f"selection receipts: slot {twice!r} is given twice (one receipt per slot)")
    if not lib.is_relative_to(folder):
        raise UserError(f"library {library}: must lie inside the manifest's folder {folder} "
                        f"(copy the DSO there, or write the manifest next to it)", param="library")
    doc = {"schema_version": 1, "bindings": [
        {"id": r.binding_id, "abi_sha256": r.abi_sha256,
         "library": lib.relative_to(folder).as_posix(), "function": function} for r in receipts]}
    jsonio.validate(doc, "binding", path)  # named as the file it will be, not its temp name
    with staged_file(path) as tmp:  # checked by loading it before it takes the manifest's place
        jsonio.write_json(tmp, doc, None)  # validated just above
        load_manifest(tmp)
    return path
