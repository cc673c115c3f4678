"""`trtmc`: bring your own kernel to a TensorRT network, behind correctness and perf gates.

Commands parse, call the library, print: one module per command group, shared argument groups in
`args.py`."""
from __future__ import annotations

import argparse
import errno
import importlib
import importlib.metadata
import signal
import sys

from pipeline import log, progress
from pipeline.cli.args import FLAGS, Parser
from pipeline.errors import UserError

# Each module has register(subparsers); a subcommand sets `func(args) -> int | None`.
COMMAND_MODULES = [
    "pipeline.cli.graph",
    "pipeline.cli.model",
    "pipeline.cli.build",
    "pipeline.cli.kernel",
    "pipeline.cli.bind",
    "pipeline.cli.embed",
    "pipeline.cli.run",
    "pipeline.cli.gates",
    "pipeline.cli.completion",
]


def _sigterm(signum, frame):
    # Exit through Python so that finally-blocks and atomic writes clean up their temp files.
    raise SystemExit(128 + signum)


def _version() -> str:
    try:
        return importlib.metadata.version("trtmc")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="trtmc", description=__doc__.splitlines()[0],
               epilog="`trtmc COMMAND -h` shows a command's options and an example.")
    p.add_argument("--version", action="version", version=f"trtmc {_version()}")
    p.add_argument("-v", "--verbose", action="count", default=0,
                   help="more log lines on stderr (-vv: TensorRT's verbose log too; default: "
                        "info lines)")
    p.add_argument("-q", "--quiet", action="count", default=0,
                   help="warnings and errors only (default: info lines too)")
    p.add_argument("--progress", action="store_true",
                   help="progress lines on stderr even when it is not a terminal (default: only "
                        "on a terminal; TRTMC_PROGRESS=1 or 0 forces it on or off)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return p


# what writing stdout can meet (a full disk, a quota, a file size limit, an I/O error)
_OUTPUT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO}


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _sigterm)
    args = parser().parse_args(argv)
    log.configure(args.verbose - args.quiet)
    progress.ask(True if args.progress else None)
    try:
        rc = args.func(args) or 0
        if sys.stdout is not None:  # None when started with stdout closed (`>&-`)
            sys.stdout.flush()  # a full disk or closed pipe is met here, not at exit
        return rc
    except UserError as e:
        print(f"trtmc: error: {e.naming(FLAGS)}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `trtmc graph list ... | head`
        sys.stderr.close()
        return 0
    except OSError as e:
        if e.filename is not None or e.errno not in _OUTPUT_ERRNOS:  # not stdout's: a bug, shown
            raise
        print(f"trtmc: error: writing the output: {e.strerror}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
