"""`trtmc gate verify | history`: re-check a promotion receipt against the files on disk; the
history of a spec's gate runs."""
from __future__ import annotations

import os

from pipeline.cli.args import add_json, example, print_json
from pipeline.errors import UserError


def run_verify(args) -> int:
    from pipeline.gates.promotion import verify
    result = verify(args.receipt)
    if args.json:
        print_json(result)
        return 0 if result["ok"] else 1
    for f in [*result["files"], {"what": "abi sha256 (re-derived from the selection)",
                                 "path": "", **result["abi"]}]:
        why = "" if f["match"] else (f"  expected {f['expected'][:12]}, "
                                     f"{'missing' if f['actual'] is None else 'got ' + f['actual'][:12]}")
        print(f"{'ok  ' if f['match'] else 'DIFF'}  {f['what']}  {f['path']}{why}")
    for d in result["environment_differences"]:
        print(f"env   {d['key']}: recorded {d['recorded']!r}, now {d['now']!r}")
    print(f"{'verified' if result['ok'] else 'NOT verified'}: {result['receipt']} (spec folder "
          f"{result['spec_folder']})")
    return 0 if result["ok"] else 1


def run_history(args) -> int:
    from pipeline.files import refuse_overwriting
    from pipeline.gates import ledger
    if args.plot is not None:  # checked before the table is printed
        if not args.plot or os.path.isdir(args.plot):
            raise UserError(f"--plot {args.plot!r}: expected the path of a PNG file to write")
        refuse_overwriting(args.plot, [args.ledger], "--plot")
    rows = ledger.load(args.ledger)
    png = ledger.plot(rows) if args.plot else None  # before any output: a failed plot prints none
    if args.json:
        print_json(rows)
    else:
        print(ledger.table(rows), end="")
    if png is not None:
        from pipeline.files import atomic_write_bytes
        atomic_write_bytes(args.plot, png)
    return 1 if ledger.latest_regressions(rows) else 0


def register(sub) -> None:
    p = sub.add_parser("gate", help="promotion receipts and gate history")
    s = p.add_subparsers(dest="gate_command", required=True, metavar="SUBCOMMAND")
    v = s.add_parser("verify", help="re-check a promotion receipt against the files on disk",
                     description="Recompute every digest the receipt pins (paths relative to the "
                                 "spec folder it names) and the ABI hash from the selection, and "
                                 "state how the environment differs. Exit 0 when every digest and "
                                 "the ABI match, 1 otherwise.",
                     epilog=example("trtmc gate verify artifacts/pipelines/minilm_residual_add/promotion.json"))
    v.add_argument("receipt", metavar="PROMOTION.json", help="a promotion receipt written by the promote stage")
    add_json(v, "the verification")
    v.set_defaults(func=run_verify)
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
