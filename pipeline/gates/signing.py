"""Signed promotion receipts: a DSSE envelope over an in-toto Statement (v1) whose subjects are
the receipt and every file it rests on, signed with Ed25519.

A receipt pins its files by digest, but anyone who can write the files can write a consistent
receipt too. A signature made by a job that holds the key and never loads the kernel (a CI job
on another machine) ties the receipt to that job: `gate verify --trusted-key` refuses an unsigned
receipt, a signature by any other key, and any subject that changed since it was signed.

A receipt is signed only when it verifies (every digest and cross-reference; the environment
only as notes, since the signing job runs elsewhere: promotion.sign_receipt). The subjects are re-derived
at verification from the receipt as it is, so a subject left out of the envelope, or one added,
is a difference too.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from pipeline import jsonio
from pipeline.errors import UserError
from pipeline.files import atomic_write_bytes, read_regular, sha256_file, shown
from pipeline.gates.receipt_types import PromotionReceipt
from pipeline.gates.verification import Check, DigestCheck, Verification

PAYLOAD_TYPE = "application/vnd.in-toto+json"
STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "urn:trtmc:promotion-receipt:v1"
ENVELOPE_SUFFIX = ".dsse"  # beside the receipt: promotion.json.dsse
MAX_KEY_BYTES = 16 << 10
MAX_ENVELOPE_BYTES = 24 << 20  # the schema's payload limit, base64, with room for signatures

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

PathLike = str | os.PathLike[str]


def envelope_path(receipt: Path) -> Path:
    """Where `gate sign` writes a receipt's envelope, and where `gate verify` looks for it."""
    return receipt.with_name(receipt.name + ENVELOPE_SUFFIX)


def pae(payload_type: str, body: bytes) -> bytes:
    """DSSE's pre-authentication encoding: what is signed, so a payload is never read as
    another type."""
    kind = payload_type.encode()
    return b"DSSEv1 %d %s %d %s" % (len(kind), kind, len(body), body)


# -- keys ---------------------------------------------------------------------------------------
def _load(path: PathLike, load: Callable[[bytes], Any], kind: type, what: str,
          expected: str) -> Any:
    """The key in the PEM file at `path` as `load` reads it (`what` it must be), refused unless
    it is a `kind` (`expected` says which)."""
    data = read_regular(Path(path), MAX_KEY_BYTES, "pipeline.gates.signing.MAX_KEY_BYTES")
    try:
        key = load(data)
    except (ValueError, TypeError) as e:
        raise UserError(f"{shown(path)}: not {what} ({e})") from None
    if not isinstance(key, kind):
        raise UserError(f"{shown(path)}: a {type(key).__name__.removeprefix('_')}, expected an "
                        f"{expected}")
    return key


def private_key(path: PathLike) -> Ed25519PrivateKey:
    """An Ed25519 private key from a PEM file (PKCS#8, unencrypted: a CI secret)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    key: Ed25519PrivateKey = _load(
        path, lambda data: serialization.load_pem_private_key(data, password=None),
        Ed25519PrivateKey, "an unencrypted PEM private key",
        "Ed25519 private key (trtmc gate keygen writes one)")
    return key


def public_key(path: PathLike) -> Ed25519PublicKey:
    """An Ed25519 public key from a PEM file (SubjectPublicKeyInfo)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
    key: Ed25519PublicKey = _load(
        path, serialization.load_pem_public_key, Ed25519PublicKey, "a PEM public key",
        "Ed25519 public key (trtmc gate keygen writes one beside the private key)")
    return key


def key_id(public: Ed25519PublicKey) -> str:
    """sha256 of the public key's raw bytes: how an envelope names the key that signed it."""
    from cryptography.hazmat.primitives import serialization
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()


def keygen(path: PathLike) -> tuple[Path, Path]:
    """A new key pair: the private key at `path` (mode 0600) and its public key at `path`.pub;
    refused where either file exists."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    path = Path(path)
    public_path = path.with_name(path.name + ".pub")
    for p in (path, public_path):
        if os.path.lexists(p):
            raise UserError(f"{shown(p)}: exists; a key is never overwritten (choose another path)")
    key = Ed25519PrivateKey.generate()
    secret = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                               serialization.NoEncryption())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secret)
    atomic_write_bytes(public_path, key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    return path, public_path


# -- statements ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Subject:
    """One file a signature covers: its name relative to the receipt's spec folder."""
    name: str
    sha256: str

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "digest": {"sha256": self.sha256}}


def subjects(receipt: Path, result: Verification) -> list[Subject]:
    """The receipt and every file its verification (`result`, promotion.verify) checked by
    digest: the pins, the gates' other report files, and both bundles' files."""
    base = result.spec_folder
    def name(p: str | Path) -> str:
        return Path(os.path.relpath(p, base)).as_posix()
    pinned = [Subject(name(c.path), c.expected)
              for c in result.digested if isinstance(c, DigestCheck) and c.expected]
    return [Subject(name(receipt), sha256_file(receipt)), *pinned]


def statement(receipt: PromotionReceipt, listed: list[Subject]) -> dict[str, Any]:
    """The in-toto Statement over `listed`; the predicate says what was promoted, and where."""
    return {"_type": STATEMENT_TYPE, "subject": [s.to_json() for s in listed],
            "predicateType": PREDICATE_TYPE,
            "predicate": {"name": receipt.name, "binding_id": receipt.selection.binding_id,
                          "verdicts": {gate: pin.verdict.value
                                       for gate, pin in receipt.gates.by_gate().items()},
                          "device": receipt.gates.device,
                          "gpu": receipt.environment.get("gpu")}}


def sign(receipt: PathLike, key: PathLike, result: Verification, out: PathLike | None = None) -> Path:
    """Sign the receipt at `receipt` with the private key file `key`, given its verification
    `result` (promotion.verify, the environment ignored: promotion.sign_receipt): its envelope is
    written at `out` (default: `envelope_path`). Refused unless the receipt verified."""
    receipt = Path(receipt)
    secret = private_key(key)
    problem = result.first_difference()
    if problem is not None:
        raise UserError(f"{shown(receipt)}: does not verify, so it is not signed: {problem}")
    promoted = PromotionReceipt.read(receipt)
    body = jsonio.dumps(statement(promoted, subjects(receipt, result)), human=False)
    jsonio.validate(jsonio.parse_json(body, None, receipt), "intoto_statement", receipt)
    envelope = {"payloadType": PAYLOAD_TYPE, "payload": base64.b64encode(body).decode(),
                "signatures": [{"keyid": key_id(secret.public_key()),
                                "sig": base64.b64encode(secret.sign(pae(PAYLOAD_TYPE, body))).decode()}]}
    out = envelope_path(receipt) if out is None else Path(out)
    jsonio.validate(envelope, "dsse_envelope", out)
    return atomic_write_bytes(out, jsonio.dumps(envelope))


def signature_checks(receipt: PathLike, result: Verification, trusted_key: PathLike,
                     envelope: PathLike | None = None) -> list[Check]:
    """The checks `gate verify --trusted-key` adds to the verification `result` of `receipt`:
    an envelope signed by the trusted key, whose subjects are exactly the receipt's files as they
    are now."""
    from cryptography.exceptions import InvalidSignature
    receipt = Path(receipt)
    trusted = public_key(trusted_key)
    at = envelope_path(receipt) if envelope is None else Path(envelope)
    if not os.path.lexists(at):
        return [Check.of("signature", at, False, "no envelope: the receipt is not signed (trtmc "
                                                 "gate sign writes one)")]
    try:
        env = jsonio.read_json(at, "dsse_envelope")
    except UserError as e:
        return [Check.of("signature", at, False, str(e))]
    body = base64.b64decode(env["payload"])
    want = key_id(trusted)
    good = False
    for sig in env["signatures"]:
        if sig["keyid"] != want:
            continue
        try:
            trusted.verify(base64.b64decode(sig["sig"]), pae(env["payloadType"], body))
            good = True
        except (InvalidSignature, binascii.Error):
            pass
    if not good:
        return [Check.of("signature", at, False, f"no valid signature by the trusted key (keyid "
                                                 f"{want[:12]})")]
    checks = [Check.of("signature", at, True, "")]
    try:
        signed = jsonio.parse_json(body, "intoto_statement", f"{shown(at)} payload")
    except UserError as e:
        return checks + [Check.of("signed statement", at, False, str(e))]
    now = {s.name: s.sha256 for s in subjects(receipt, result)}
    then = {s["name"]: s["digest"]["sha256"] for s in signed["subject"]}
    for name in sorted(set(now) | set(then)):
        if now.get(name) != then.get(name):
            detail = ("not signed (added since)" if name not in then else
                      "signed, but the receipt no longer rests on it" if name not in now else
                      f"signed as {then[name][:12]}, now {now[name][:12]}")
            checks.append(Check.of(f"signed subject {name}", at, False, detail))
    if len(checks) == 1:
        checks.append(Check.of(f"signed subjects ({len(then)})", at, True, ""))
    return checks
