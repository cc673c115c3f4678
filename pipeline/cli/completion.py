"""`trtmc completion bash|zsh`: the shell completion script (shtab) of the whole command tree."""
from __future__ import annotations

import argparse

import shtab

from pipeline.cli import parser
from pipeline.cli.args import example

SHELLS = ("bash", "zsh")


def _files_for_values(parser: argparse.ArgumentParser, files: dict) -> None:
    """Every flag or positional that takes a free-form value completes file names (most are paths);
    choices and subcommands complete their names."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _files_for_values(sub, files)
        elif action.nargs != 0 and not action.choices:
            action.complete = files  # type: ignore[attr-defined]  # shtab reads it


def run(args) -> int:
    root = parser()
    _files_for_values(root, shtab.FILE)
    print(shtab.complete(root, shell=args.shell))
    return 0


def register(sub) -> None:
    p = sub.add_parser("completion", help="print the shell completion script",
                       epilog=example('eval "$(trtmc completion bash)"            # this shell',
                                      "trtmc completion zsh > ~/.zfunc/_trtmc      # zsh, for good"))
    p.add_argument("shell", choices=SHELLS, type=str.lower, help="the shell to complete in")
    p.set_defaults(func=run)
