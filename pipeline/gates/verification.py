"""What `trtmc gate verify` found (gates/promotion.py `verify`), as one typed result: the
signature checks (gates/signing.py) take it, and the command line prints it or its JSON."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

# one check: what, path, match, detail (and, for a file checked by digest, `expected`)
Check = dict[str, Any]


@dataclass(frozen=True)
class Verification:
    """What `verify` found. Each check is one JSON-shaped record (what, path, match, detail; a
    pinned file's also the digest `expected`), by kind; `abi` is the ABI hash expected and
    re-derived; the environment's differences decide the verdict, its notes do not."""
    receipt: str
    spec_folder: str
    files: tuple[Check, ...]
    report_files: tuple[Check, ...]
    bundle_files: tuple[Check, ...]
    references: tuple[Check, ...]
    policy: tuple[Check, ...]
    signature: tuple[Check, ...]
    abi: Mapping[str, Any]
    environment_differences: tuple[Check, ...]
    environment_notes: tuple[Check, ...]

    @property
    def digested(self) -> tuple[Check, ...]:
        """The checks of a file by its digest: the pins, the gates' other files, both bundles."""
        return self.files + self.report_files + self.bundle_files

    @property
    def checks(self) -> tuple[Check, ...]:
        return self.digested + self.references + self.policy + self.signature

    @property
    def ok(self) -> bool:
        return (bool(self.abi["match"]) and all(c["match"] for c in self.checks)
                and not self.environment_differences)

    def first_difference(self) -> str | None:
        """The first file or reference that differs, or the ABI hash, in one line; None when
        they all match (the policy, signature and environment are not asked)."""
        for c in self.digested + self.references:
            if not c["match"]:
                return f"{c['what']} ({c['path']}): {c['detail']}"
        return None if self.abi["match"] else "the ABI hash re-derived from the selection differs"

    def to_json(self) -> dict[str, Any]:
        kinds = ("files", "report_files", "bundle_files", "references", "policy", "signature",
                 "environment_differences", "environment_notes")
        return {"receipt": self.receipt, "spec_folder": self.spec_folder,
                **{k: list(getattr(self, k)) for k in kinds}, "abi": dict(self.abi), "ok": self.ok}
