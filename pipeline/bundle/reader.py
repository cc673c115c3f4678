"""Open a bundle: manifest, per-role network exports, kernel slots, and weights.

Nothing a bundle holds is used unverified: at open, every file in the bundle must be a regular
file listed in manifest.json's content_digests, every listed or referenced file must be there,
and each is read once and hashed as read (about 0.8 s per GiB here, docs/runtimes.md). What is
used later is what was hashed: the small files' bytes are kept, and the weights are loaded
through the descriptor that was hashed (/proc/self/fd), so a file replaced after open is never
read. Not detected: a write into the open weights file itself, after it was hashed.
kernel_slots.json must agree with the SLOT layers of the network exports. Referenced
(weight-stripped) bundles load each weight from the checkpoint and check its digest, so a bundle
never runs against a checkpoint that differs from the one it was built from.
"""
from __future__ import annotations

import functools
import hashlib
import os
import stat
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import BinaryIO

import torch
from safetensors.torch import load_file

from pipeline import dtypes, jsonio
from pipeline.bundle import layout
from pipeline.errors import UserError
from pipeline.files import open_regular, sha256_stream, shown, user_os_errors
from pipeline.graph.abi import abi_of, abi_sha256
from pipeline.graph.snapshot import check_structure
from pipeline.graph.bounds import parse_counted
from pipeline.graph.patch import slot_key
from pipeline.models.checkpoint import load as load_checkpoint, tensor_digest
from pipeline.models.checkpoint import safetensors_errors
from pipeline.models.tokenizer import Tokenizer, load_tokenizer

_REBUILD = "rebuild the bundle"


def _reraise(error: OSError):
    raise error  # os.walk would skip an unreadable folder silently


def _files(path: Path) -> set[str]:
    """Relative paths of the bundle's files; a symlink or anything but a regular file or folder
    is refused (only regular files are ever read)."""
    out = set()
    with user_os_errors(path):
        for folder, dirs, files in os.walk(path, onerror=_reraise):
            for name in dirs + files:
                p = Path(folder, name)
                mode = os.lstat(p).st_mode
                if stat.S_ISLNK(mode) or not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
                    kind = "a symlink" if stat.S_ISLNK(mode) else "not a regular file"
                    raise UserError(f"{shown(p)}: {kind}; a bundle holds only regular files "
                                    f"({_REBUILD})")
                if stat.S_ISREG(mode):
                    out.add(p.relative_to(path).as_posix())
    return out


def _verify(path: Path, manifest: dict) -> tuple[dict[str, bytes], BinaryIO]:
    """Listed == present, every file the manifest uses listed, then one read per file, hashed as
    read. Returns what the bundle then uses, so that what was hashed is what is used: the bytes
    of every small file, and the weights file held open (the same file, even if the path is
    replaced afterwards)."""
    where = f"{shown(path / layout.MANIFEST)}: $.content_digests"
    digests = manifest["content_digests"]
    present = _files(path) - {layout.MANIFEST}
    for rel in digests:
        pure = PurePosixPath(rel)
        if not rel or pure.is_absolute() or ".." in pure.parts or pure.as_posix() != rel:
            raise UserError(f"{where}: {jsonio.excerpt(repr(rel))} is not a plain relative path "
                            f"inside the bundle (absolute, '..' or not normalized)")
        if rel not in present:
            raise UserError(f"{shown(path / rel)}: listed in {layout.MANIFEST} but missing "
                            f"({_REBUILD})")
    unlisted = sorted(present - digests.keys())
    if unlisted:
        raise UserError(f"{shown(path / unlisted[0])}: not listed in {layout.MANIFEST} "
                        f"content_digests; a bundle holds only files it lists ({_REBUILD})")
    used = [layout.WEIGHTS, layout.CONFIG] + ([layout.SLOTS] if manifest["slot_ready"] else [])
    used += [r[k] for r in manifest["roles"] for k in ("network", "plan") if r[k] is not None]
    for rel in used:
        if rel not in digests:
            raise UserError(f"{where}: no entry for {jsonio.excerpt(shown(rel))}, which the "
                            f"bundle uses ({_REBUILD})")
    plans = {r["plan"] for r in manifest["roles"] if r["plan"] is not None}
    held: dict[str, bytes] = {}
    weights: BinaryIO | None = None
    for rel, digest in digests.items():
        with open_regular(path / rel) as f:
            if rel == layout.WEIGHTS or rel in plans:  # large: hashed as streamed, not held
                actual = sha256_stream(f)
                if rel == layout.WEIGHTS:
                    weights = os.fdopen(os.dup(f.fileno()), "rb")  # closed with its last owner
            else:
                held[rel] = f.read()
                actual = hashlib.sha256(held[rel]).hexdigest()
        if actual != digest:
            raise UserError(f"{shown(path / rel)}: modified since the bundle was built (its "
                            f"sha256 differs from {layout.MANIFEST}; {_REBUILD})")
    assert weights is not None  # the weights file is one the bundle uses: checked above
    return held, weights


@dataclass
class Bundle:
    path: Path
    manifest: dict
    _held: dict[str, bytes] = field(repr=False, compare=False)  # rel -> verified bytes
    _weights: BinaryIO = field(repr=False, compare=False)       # the verified weights file, open
    _networks: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def open(cls, path) -> "Bundle":
        path = Path(path)
        with user_os_errors(path):
            if not path.is_dir():
                raise UserError(f"{shown(path)}: " + ("not a directory; a bundle is a *.bundle "
                                                      "directory" if os.path.lexists(path)
                                                      else "no such bundle directory"))
            if not (path / layout.MANIFEST).is_file():
                raise UserError(f"{shown(path)}: incomplete bundle (no {layout.MANIFEST}); "
                                f"{_REBUILD}")
        manifest = jsonio.read_json(path / layout.MANIFEST, "bundle_manifest")
        bundle = cls(path, manifest, *_verify(path, manifest))
        slot_roles = [r["role"] for r in manifest["roles"] if r["slot_ready"]]
        if sorted(slot_roles) != sorted({s["engine_role"] for s in bundle.slots}) or \
                manifest["slot_ready"] != bool(slot_roles):
            raise UserError(f"{shown(path / layout.MANIFEST)}: $.roles: the slot-ready roles "
                            f"({shown(', '.join(slot_roles)) or 'none'}) are not the roles of "
                            f"the kernel slots in {layout.SLOTS} ({_REBUILD})")
        for role in slot_roles:
            bundle.network(role)  # checks its SLOT layers against the slots
        bundle.config  # noqa: B018 - parsed and checked before anything runs on the bundle
        return bundle

    @property
    def roles(self) -> list[str]:
        return [r["role"] for r in self.manifest["roles"]]

    @property
    def family(self) -> str:
        return self.manifest["family"]

    def network(self, role: str) -> dict:
        """The role's network export (read once; callers must not modify it)."""
        if role not in self._networks:
            entry = next((r for r in self.manifest["roles"] if r["role"] == role), None)
            if entry is None:
                raise UserError(f"{shown(self.path)}: no engine role {role!r} (roles: "
                                f"{shown(', '.join(self.roles))})")
            where = shown(self.path / entry["network"])
            export = self._json(entry["network"], "network")
            if export["engine_role"] != role:
                raise UserError(f"{where}: $.engine_role: {export['engine_role']!r}, but the "
                                f"manifest lists it as role {role!r}")
            check_structure(export, "layers", where)
            self._check_slot_layers(export, role, where)
            self._networks[role] = export
        return self._networks[role]

    def _check_slot_layers(self, export: dict, role: str, where: str) -> None:
        """The export's SLOT layers are exactly the role's kernel slots, each with the slot's ABI
        derived again from the layer's boundary tensors and attrs."""
        slots = {slot_key(s["binding_id"], s.get("instance_id")): s
                 for s in self.slots if s["engine_role"] == role}
        tensors = {t["id"]: t for t in export["tensors"]}
        seen = set()
        for layer in (x for x in export["layers"] if x["type"] == "SLOT"):
            a = layer["attrs"]
            bid, instance = a.get("binding_id"), a.get("instance_id")
            key = slot_key(bid, instance) if isinstance(bid, str) and \
                isinstance(instance, (str, type(None))) else None
            slot = None if key is None else slots.get(key)
            if slot is None or key in seen or layer["name"] != key:
                raise UserError(f"{where}: SLOT layer {layer['id']!r} is not one of the kernel "
                                f"slots of role {shown(role)} in {layout.SLOTS} (or repeats one)")
            seen.add(key)
            try:
                abi = abi_of([tensors[t] for t in layer["inputs"]],
                             [tensors[t] for t in layer["outputs"]], a["workspace_bytes"],
                             a["extra_args"], a["output_shape_like_input"])
            except (KeyError, TypeError, UserError) as e:
                raise UserError(f"{where}: SLOT layer {layer['id']!r}: malformed boundary or "
                                f"attrs ({jsonio.excerpt(str(e), 80)})") from None
            if abi != slot["abi"] or a.get("abi_sha256") != slot["abi_sha256"]:
                raise UserError(f"{where}: SLOT layer {layer['id']!r} does not match its entry "
                                f"in {layout.SLOTS} (ABI or abi_sha256 differ; {_REBUILD})")
        if seen != slots.keys():
            raise UserError(f"{shown(self.path / layout.SLOTS)}: slot "
                            f"{sorted(slots.keys() - seen)[0]!r} has no SLOT layer in {where} "
                            f"({_REBUILD})")

    @functools.cached_property
    def slots(self) -> list[dict]:
        if not self.manifest["slot_ready"]:
            return []
        slots = self._json(layout.SLOTS, "kernel_slots")["slots"]
        keys: set[str] = set()
        by_id: dict[str, dict] = {}
        for i, s in enumerate(slots):
            where = f"{shown(self.path / layout.SLOTS)}: $.slots[{i}]"
            if abi_sha256(s["abi"]) != s["abi_sha256"]:
                raise UserError(f"{where}.abi_sha256: not the sha256 of its abi "
                                f"(the file was edited; {_REBUILD})")
            key = slot_key(s["binding_id"], s.get("instance_id"))
            first = by_id.setdefault(s["binding_id"], s)
            if key in keys or first["abi_sha256"] != s["abi_sha256"] or \
                    ("instance_id" in first) != ("instance_id" in s):
                raise UserError(f"{where}: slot {key!r} repeats a slot, or shares binding id "
                                f"{s['binding_id']!r} with a slot of another ABI or without an "
                                f"instance id ({_REBUILD})")
            keys.add(key)
        return slots

    def _json(self, rel: str, schema: str | None):
        if rel not in self._held:  # the manifest names the weights or a plan as a JSON file
            raise UserError(f"{shown(self.path / layout.MANIFEST)}: {shown(rel)} is read as JSON "
                            f"({schema or 'config'}), but it is the bundle's weights or a plan "
                            f"({_REBUILD})")
        if schema is None:
            return jsonio.parse_json(self._held[rel], None, self.path / rel)
        return parse_counted(self._held[rel], schema, self.path / rel)

    @functools.cached_property
    def config(self) -> dict:
        """The model's config.json, bounded as a checkpoint's is (schema hf_config)."""
        return self._json(layout.CONFIG, "hf_config")

    def tokenizer(self) -> Tokenizer:
        """The bundle's tokenizer, from the bytes of its files it verified."""
        prefix = layout.TOKENIZER + "/"
        return load_tokenizer({rel[len(prefix):]: data for rel, data in self._held.items()
                               if rel.startswith(prefix)}, self.path / layout.TOKENIZER)

    def _check_stored(self, stored: dict[str, torch.Tensor]) -> None:
        """Each embedded tensor has the dtype and shape the manifest records: a weights file
        replaced (and its digest recorded again) cannot feed a layer tensors of another size."""
        table = self.manifest["weights"]
        for key, t in stored.items():
            rec = table.get(key)
            if rec is None or rec["storage"] != "embedded":
                raise UserError(f"{shown(self.path / layout.WEIGHTS)}: tensor "
                                f"{jsonio.excerpt(repr(key), 80)} is not an embedded weight of "
                                f"{layout.MANIFEST} ({_REBUILD})")
            stored_dtype = str(t.dtype).removeprefix("torch.")
            want = dtypes.BY_NAME.get(rec["dtype"])
            if want is None or stored_dtype != want.torch or list(t.shape) != rec["shape"]:
                raise UserError(f"{shown(self.path / layout.WEIGHTS)}: tensor "
                                f"{jsonio.excerpt(repr(key), 80)} is {stored_dtype} "
                                f"{list(t.shape)}, but {layout.MANIFEST} records {rec['dtype']} "
                                f"{rec['shape']} ({_REBUILD})")

    def weights(self, checkpoint: str | Path | None = None,
                keys: Collection[str] | None = None) -> dict[str, torch.Tensor]:
        """Every weight key -> tensor (CPU, as stored), or only `keys` (a region's: the judge of
        a kernel host need not hold the model). Referenced weights come from `checkpoint`
        (default: the path recorded at build time) and must match their recorded digest."""
        if checkpoint == "":
            raise UserError("checkpoint '': an empty path (leave it out to use the one recorded "
                            "at build time)", param="checkpoint")
        table = self.manifest["weights"]
        at = self.path / layout.WEIGHTS
        with user_os_errors(at), safetensors_errors(at, "not a readable safetensors file"):
            out = load_file(f"/proc/self/fd/{self._weights.fileno()}")  # the verified file
        self._check_stored(out)
        if keys is not None:
            unknown = set(keys) - table.keys()
            if unknown:
                raise UserError(f"{self.path / layout.MANIFEST}: no weight '{sorted(unknown)[0]}'")
            table = {k: table[k] for k in keys}
            out = {k: v for k, v in out.items() if k in table}
        referenced = {k: v for k, v in table.items() if v["storage"] == "referenced"}
        if referenced:
            where = checkpoint or self.manifest["checkpoint"]
            ck = load_checkpoint(str(where))
            if ck.revision != self.manifest["revision"]:
                raise UserError(f"{where}: checkpoint revision {ck.revision} differs from the "
                                f"bundle's {self.manifest['revision']}")

            def read(rec: dict) -> tuple[torch.Tensor, str]:
                tensor = ck.tensor(rec["tensor"])
                return tensor, tensor_digest(tensor)
            # reading and hashing release the GIL, so the tensors are checked side by side
            with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
                for (key, rec), (tensor, digest) in zip(referenced.items(),
                                                        pool.map(read, referenced.values())):
                    if digest != rec["sha256"]:
                        pool.shutdown(cancel_futures=True)
                        raise UserError(f"{where}: tensor '{rec['tensor']}' does not match the "
                                        f"digest recorded in {self.path / layout.MANIFEST} "
                                        f"(weights.{key}.sha256)")
                    out[key] = tensor
        missing = table.keys() - out.keys()
        if missing:
            raise UserError(f"{self.path / layout.WEIGHTS}: missing weight '{sorted(missing)[0]}'")
        return out
