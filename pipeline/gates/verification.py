"""What `trtmc gate verify` found (gates/promotion.py `verify`), as one typed result: the
signature checks (gates/signing.py) take it, and the command line prints it or its JSON."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping

# one environment field that differs: key, recorded, now (promotion._differences)
Difference = Mapping[str, Any]


@dataclass(frozen=True)
class Check:
    """One thing verify checked: what, the file it concerns (`path`), whether it matches, and,
    where it does not, how it differs in one line (`detail`, None where it matches)."""
    what: str
    path: str
    match: bool
    detail: str | None

    @staticmethod
    def of(what: str, where: str | os.PathLike[str], match: bool, detail: str) -> Check:
        """The check of `what` at `where`; `detail` is kept only where it does not match."""
        return Check(what, str(where), bool(match), None if match else detail)

    def to_json(self) -> dict[str, Any]:
        return {"what": self.what, "path": self.path, "match": self.match, "detail": self.detail}


@dataclass(frozen=True)
class DigestCheck(Check):
    """A file checked by its digest: the sha256 pinned (`expected`), the one on disk (`actual`,
    None where it was not hashed) and why it was not (`problem`: missing, another size...). A
    signature covers exactly the files checked so (signing.subjects)."""
    expected: str
    actual: str | None
    problem: str | None

    def to_json(self) -> dict[str, Any]:
        return {**super().to_json(), "expected": self.expected, "actual": self.actual,
                "problem": self.problem}


@dataclass(frozen=True)
class Verification:
    """What `verify` found: the checks by kind (`files`, `report_files` and `bundle_files` hold a
    `DigestCheck` for each file checked by its digest); `abi` is the ABI hash expected and
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
    environment_differences: tuple[Difference, ...]
    environment_notes: tuple[Difference, ...]

    @property
    def digested(self) -> tuple[Check, ...]:
        """The checks of a file by its digest: the pins, the gates' other files, both bundles."""
        return self.files + self.report_files + self.bundle_files

    @property
    def checks(self) -> tuple[Check, ...]:
        return self.digested + self.references + self.policy + self.signature

    @property
    def ok(self) -> bool:
        return (bool(self.abi["match"]) and all(c.match for c in self.checks)
                and not self.environment_differences)

    def first_difference(self) -> str | None:
        """The first file or reference that differs, or the ABI hash, in one line; None when
        they all match (the policy, signature and environment are not asked)."""
        for c in self.digested + self.references:
            if not c.match:
                return f"{c.what} ({c.path}): {c.detail}"
        return None if self.abi["match"] else "the ABI hash re-derived from the selection differs"

    def to_json(self) -> dict[str, Any]:
        checks = ("files", "report_files", "bundle_files", "references", "policy", "signature")
        differences = ("environment_differences", "environment_notes")
        return {"receipt": self.receipt, "spec_folder": self.spec_folder,
                **{k: [c.to_json() for c in getattr(self, k)] for k in checks},
                **{k: list(getattr(self, k)) for k in differences},
                "abi": dict(self.abi), "ok": self.ok}
