"""`trtmc`: thin command-line wrappers over the library (one module per command group)."""
from __future__ import annotations

import argparse
import importlib
import signal
import sys

from pipeline.errors import UserError

# Each module has register(subparsers); a subcommand sets `func(args) -> int | None`.
COMMAND_MODULES = [
    "pipeline.commands.graph",
    "pipeline.commands.model",
    "pipeline.commands.build",
    "pipeline.commands.kernel",
    "pipeline.commands.bind",
    "pipeline.commands.embed",
    "pipeline.commands.run",
]


def _sigterm(signum, frame):
    # Exit through Python so that finally-blocks and atomic writes clean up their temp files.
    raise SystemExit(128 + signum)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trtmc", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:  # command group not written yet
                continue
            raise
        module.register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _sigterm)
    args = parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except UserError as e:
        print(f"trtmc: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `trtmc graph list ... | head`
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
