"""`trtmc gate verify | sign | keygen | history`: re-check a promotion receipt against the files
on disk (and its signature); sign one; make a signing key; the history of a spec's gate runs."""
from __future__ import annotations

import os

from pipeline.cli.args import add_json, example, print_json
from pipeline.errors import UserError
from pipeline.files import atomic_write_bytes, refuse_overwriting
from pipeline.gates import ledger
from pipeline.gates.policy import GatePolicy
from pipeline.gates.promotion import sign_receipt, verify
from pipeline.gates.signing import keygen
from pipeline.gates.verification import Check


def run_verify(args) -> int:
    policy = None if args.policy is None else GatePolicy.read(args.policy)
    result = verify(args.receipt, ignore_environment=args.ignore_environment, policy=policy,
                    trusted_key=args.trusted_key, envelope=args.envelope)
    if args.json:
        print_json(result.to_json())
        return 0 if result.ok else 1
    abi = result.abi
    got = "missing" if abi["actual"] is None else "got " + abi["actual"][:12]
    for c in [*result.checks, Check.of("abi sha256 (re-derived from the selection)", "",
                                       abi["match"], f"expected {abi['expected'][:12]}, {got}")]:
        why = "" if c.match else f"  {c.detail}"
        print(f"{'ok  ' if c.match else 'DIFF'}  {c.what}  {c.path}{why}")
    for tag, found in (("env ", result.environment_differences),
                       ("note", result.environment_notes)):
        for d in found:
            print(f"{tag}  {d['key']}: recorded {d['recorded']!r}, now {d['now']!r}")
    print(f"{'verified' if result.ok else 'NOT verified'}: {result.receipt} (spec folder "
          f"{result.spec_folder})")
    return 0 if result.ok else 1


def run_sign(args) -> int:
    print(f"signed: {sign_receipt(args.receipt, args.key, args.out)}")
    return 0


def run_keygen(args) -> int:
    secret, public = keygen(args.key)
    print(f"private key: {secret} (keep it secret: a CI secret)\npublic key: {public}")
    return 0


def run_history(args) -> int:
    if args.plot is not None:  # checked before the table is printed
        if not args.plot or os.path.isdir(args.plot):
            raise UserError(f"--plot {args.plot!r}: expected the path of a PNG file to write")
        refuse_overwriting(args.plot, [args.ledger], "--plot")
    rows = ledger.load(args.ledger)
    png = ledger.plot(rows) if args.plot else None  # before any output: a failed plot prints none
    if args.json:
        print_json([row.to_json() for row in rows])
    else:
        print(ledger.table(rows), end="")
    if png is not None:
        atomic_write_bytes(args.plot, png)
    return 1 if ledger.latest_regressions(rows) else 0


def register(sub) -> None:
    p = sub.add_parser("gate", help="promotion receipts and gate history")
    s = p.add_subparsers(dest="gate_command", required=True, metavar="SUBCOMMAND")
    v = s.add_parser("verify", help="re-check a promotion receipt against the files on disk",
                     description="Recompute every digest the receipt pins (paths relative to the "
                                 "spec folder it names; a file whose size differs from the pinned "
                                 "one is not hashed), every file of both bundles against its "
                                 "manifest, the ABI hash from the selection and the selection "
                                 "from the graph; check every cross-reference of the receipt "
                                 "(spec content, kernel-source pins, selection against its file "
                                 "and kernel_slots.json, report files, the ledger line); and "
                                 "compare the environment the verdicts were reached in with this "
                                 "machine's, for the device the spec's gates resolve to here: "
                                 "device kind, GPU, driver major version, CUDA, torch, Triton, "
                                 "tvm-ffi, engine mode (lines 'env'); other differences are notes "
                                 "(lines 'note'). One line per check ('DIFF' where it differs). "
                                 "Exit 0 when every check matches and the environment is the "
                                 "same, 1 otherwise.",
                     epilog=example("trtmc gate verify artifacts/pipelines/minilm_residual_add/promotion.json"))
    v.add_argument("receipt", metavar="PROMOTION.json", help="a promotion receipt written by the promote stage")
    v.add_argument("--ignore-environment", action="store_true",
                   help="check digests and the ABI only; environment differences become notes")
    v.add_argument("--policy", metavar="POLICY.json",
                   help="also hold the settings the verdicts were reached under to this gate "
                        "policy's floors (device, correctness tolerances, perf threshold, "
                        "confidence and trials): a laxer one is a difference")
    v.add_argument("--trusted-key", metavar="PUB.pem",
                   help="also require a signature by this Ed25519 public key (trtmc gate sign) "
                        "over exactly the files the receipt rests on now: an unsigned receipt, "
                        "another key's signature or any changed file is a difference")
    v.add_argument("--envelope", metavar="ENVELOPE",
                   help="with --trusted-key: the signature envelope (default: the receipt's "
                        "path + .dsse)")
    add_json(v, "the verification")
    v.set_defaults(func=run_verify)
    g = s.add_parser("sign", help="sign a promotion receipt (a DSSE envelope, in-toto Statement)",
                     description="Verify the receipt here (every digest and cross-reference; "
                                 "environment differences are notes, since a signing job runs "
                                 "elsewhere) and, when it verifies, write a DSSE envelope over an "
                                 "in-toto Statement whose subjects are the receipt and every "
                                 "file it rests on, signed with an Ed25519 key. Sign in a job that "
                                 "never loads the kernel.",
                     epilog=example("trtmc gate sign artifacts/pipelines/minilm_residual_add/"
                                    "promotion.json --key signing.pem"))
    g.add_argument("receipt", metavar="PROMOTION.json", help="a promotion receipt written by the promote stage")
    g.add_argument("--key", metavar="KEY.pem", required=True,
                   help="the Ed25519 private key (PEM, unencrypted: trtmc gate keygen)")
    g.add_argument("-o", "--out", metavar="ENVELOPE",
                   help="where to write the envelope (default: the receipt's path + .dsse)")
    g.set_defaults(func=run_sign)
    k = s.add_parser("keygen", help="a new Ed25519 key pair for gate sign and verify",
                     description="Write a new Ed25519 private key (PEM, mode 0600) at KEY.pem and "
                                 "its public key at KEY.pem.pub; an existing file is never "
                                 "overwritten.",
                     epilog=example("trtmc gate keygen signing.pem"))
    k.add_argument("key", metavar="KEY.pem", help="where to write the private key")
    k.set_defaults(func=run_keygen)
    h = s.add_parser("history", help="the gate runs of a ledger, regressions flagged",
                     description="One row per gate run and promotion; a run is flagged when its "
                                 "perf median ratio is lower than the last promoted one's by more "
                                 "than that interval's width, or correctness newly fails. Exit 1 "
                                 "when the latest run of a gate is flagged.",
                     epilog=example("trtmc gate history artifacts/pipelines/minilm_residual_add/"
                                    "ledger.jsonl --plot history.png"))
    h.add_argument("ledger", metavar="LEDGER.jsonl", help="a gate ledger (<spec output>/ledger.jsonl)")
    h.add_argument("--plot", metavar="OUT.png", help="also write the trend plot (PNG) here")
    add_json(h, "the rows")
    h.set_defaults(func=run_history)
