"""Open a bundle: manifest, per-role network exports, kernel slots, and weights.

Referenced (weight-stripped) bundles load each weight from the checkpoint and check its digest, so a
bundle never runs against a checkpoint that differs from the one it was built from.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from pipeline import jsonio
from pipeline.files import sha256_file
from pipeline.bundle import layout
from pipeline.errors import UserError
from pipeline.models.checkpoint import Checkpoint, load as load_checkpoint, tensor_digest

_VERIFIED_SUFFIXES = (".json",)  # small files re-hashed on open; weights are checked per tensor


@dataclass
class Bundle:
    path: Path
    manifest: dict

    @classmethod
    def open(cls, path) -> "Bundle":
        path = Path(path)
        if not path.is_dir():
            raise UserError(f"{path}: no such bundle directory")
        if not (path / layout.MANIFEST).is_file():
            raise UserError(f"{path}: incomplete bundle (no {layout.MANIFEST}); rebuild it")
        manifest = jsonio.read_json(path / layout.MANIFEST, "bundle_manifest")
        for rel, digest in manifest["content_digests"].items():
            if rel.endswith(_VERIFIED_SUFFIXES):
                f = path / rel
                if not f.is_file() or sha256_file(f) != digest:
                    raise UserError(f"{f}: missing or modified since the bundle was built; rebuild it")
        return cls(path, manifest)

    @property
    def roles(self) -> list[str]:
        return [r["role"] for r in self.manifest["roles"]]

    @property
    def family(self) -> str:
        return self.manifest["family"]

    def network(self, role: str) -> dict:
        entry = next((r for r in self.manifest["roles"] if r["role"] == role), None)
        if entry is None:
            raise UserError(f"{self.path}: no engine role '{role}' (roles: {', '.join(self.roles)})")
        return jsonio.read_json(self.path / entry["network"], "network")

    @property
    def slots(self) -> list[dict]:
        if not self.manifest["slot_ready"]:
            return []
        return jsonio.read_json(self.path / layout.SLOTS, "kernel_slots")["slots"]

    @functools.cached_property
    def config(self) -> dict:
        return jsonio.read_json(self.path / layout.CONFIG, None)

    def tokenizer(self):
        return Checkpoint(self.path / layout.TOKENIZER, self.manifest["model"],
                          self.manifest["revision"], self.config).tokenizer()

    def weights(self, checkpoint: str | Path | None = None) -> dict[str, torch.Tensor]:
        """Every weight key -> tensor (CPU, as stored). Referenced weights come from `checkpoint`
        (default: the path recorded at build time) and must match their recorded digest."""
        table = self.manifest["weights"]
        out = load_file(str(self.path / layout.WEIGHTS))
        referenced = {k: v for k, v in table.items() if v["storage"] == "referenced"}
        if referenced:
            where = checkpoint or self.manifest["checkpoint"]
            ck = load_checkpoint(str(where))
            if ck.revision != self.manifest["revision"]:
                raise UserError(f"{where}: checkpoint revision {ck.revision} differs from the "
                                f"bundle's {self.manifest['revision']}")
            for key, rec in referenced.items():
                tensor = ck.tensor(rec["tensor"])
                if tensor_digest(tensor) != rec["sha256"]:
                    raise UserError(f"{where}: tensor '{rec['tensor']}' does not match the digest "
                                    f"recorded in {self.path / layout.MANIFEST} (weights.{key}.sha256)")
                out[key] = tensor
        missing = table.keys() - out.keys()
        if missing:
            raise UserError(f"{self.path / layout.WEIGHTS}: missing weight '{sorted(missing)[0]}'")
        return out
