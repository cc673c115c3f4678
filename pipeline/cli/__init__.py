"""`trtmc`: bring your own kernel to a TensorRT network, behind correctness and perf gates.

Commands parse, call the library, print: one module per command group, shared argument groups in
`args.py`."""
from __future__ import annotations

import argparse
import errno
import importlib
import importlib.metadata
import io
import os
import signal
import sys
import traceback

from pipeline import log, progress
from pipeline.cli.args import FLAGS, Parser
from pipeline.errors import UserError
from pipeline.files import keep_bytecode
from pipeline.isolation import run_isolated

# Each module has register(subparsers); a subcommand sets `func(args) -> int | None`.
COMMAND_MODULES = [
    "pipeline.cli.graph",
    "pipeline.cli.model",
    "pipeline.cli.build",
    "pipeline.cli.kernel",
    "pipeline.cli.bind",
    "pipeline.cli.embed",
    "pipeline.cli.run",
    "pipeline.cli.bench",
    "pipeline.cli.gates",
    "pipeline.cli.pipeline",
    "pipeline.cli.matrix",
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
    p.add_argument("--debug", action="store_true",
                   help="after a one-line error, the traceback behind it (also TRTMC_DEBUG=1)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return p


# what writing stdout can meet (a full disk, a quota, a file size limit, an I/O error)
_OUTPUT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO}


def _command(args) -> int:
    """The command itself: in this process, or in a worker when it calls a bound kernel."""
    log.configure(args.verbose - args.quiet)
    progress.ask(True if args.progress else None)
    rc = args.func(args) or 0
    if sys.stdout is not None:  # None when started with stdout closed (`>&-`)
        sys.stdout.flush()  # a full disk or closed pipe is met here, not at exit
    return rc


def _command_in_worker(args) -> tuple[int, str]:
    """The command in the worker, its stdout kept and handed back (its bytes as Latin-1 text, one
    character a byte, as the worker's result is JSON): the caller prints it once the command has
    ended well, so a kernel that ends the worker leaves no half-written output."""
    kept = io.BytesIO()
    sys.stdout = io.TextIOWrapper(kept, encoding="utf-8", write_through=True)
    rc = _command(args)
    return rc, kept.getvalue().decode("latin-1")


def _calls_kernels(args) -> bool:
    """`trtmc bench` loads a kernel library into its own process, so it runs in a worker
    (pipeline/isolation.py): a kernel that exits, crashes or hangs is then one line and exit
    status 1, never a silent 0. Every other command runs a bound kernel in a kernel host
    (pipeline/host), which does the same."""
    return args.command == "bench" and bool(getattr(args, "kernel_bindings", None))


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _sigterm)
    keep_bytecode()
    args = parser().parse_args(argv)
    debug = args.debug or os.environ.get("TRTMC_DEBUG") == "1"
    try:
        if _calls_kernels(args):
            rc, out = run_isolated(_command_in_worker, args, what=f"trtmc {args.command}")
            if sys.stdout is not None:
                sys.stdout.buffer.write(out.encode("latin-1"))
                sys.stdout.flush()
            return rc
        return _command(args)
    except UserError as e:
        print(f"trtmc: error: {e.naming(FLAGS)}", file=sys.stderr)
        if debug:
            traceback.print_exc()
        return getattr(e, "exit_status", 2)
    except BrokenPipeError:  # `trtmc graph list ... | head`
        sys.stderr.close()
        return 0
    except OSError as e:
        if e.filename is not None or e.errno not in _OUTPUT_ERRNOS:  # not stdout's: a bug, shown
            raise
        print(f"trtmc: error: writing the output: {e.strerror}", file=sys.stderr)
        if debug:
            traceback.print_exc()
        return 2


if __name__ == "__main__":
    sys.exit(main())
