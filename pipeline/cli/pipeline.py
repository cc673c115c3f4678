"""`trtmc pipeline SPEC... [DOIT ARGS]`: the doit pipeline of each spec, from the installed
package (the same tasks as the repository's `doit`)."""
from __future__ import annotations

import argparse

from pipeline.cli.args import example
from pipeline.errors import UserError
from pipeline.flow.tasks import run_pipeline as run


def split_specs(words: list[str]) -> tuple[list[str], list[str]]:
    """The leading `*.json` words are specs; the rest go to doit as they are."""
    n = next((i for i, w in enumerate(words) if w.startswith("-") or not w.endswith(".json")),
             len(words))
    return words[:n], words[n:]


def run_pipeline(args) -> int:
    specs, doit_args = split_specs(args.words)
    if not specs:
        raise UserError(f"SPEC: no pipeline spec given{' before ' + repr(doit_args[0]) if doit_args else ''} "
                        f"(expected one or more *.json files first, then doit's arguments)")
    return run(specs, doit_args)


def register(sub) -> None:
    p = sub.add_parser(
        "pipeline", help="run the doit pipeline of one or more specs",
        description="Every stage of each spec (inspect, select, build, export, bind, correctness, "
                    "perf, promote) as a cached doit task: a second run with nothing changed runs "
                    "nothing. The outputs go to the spec's output folder ($.output, relative to "
                    "the spec file; in a source checkout the default is "
                    "artifacts/pipelines/NAME), and doit's database is OUTPUT/.doit.db, inside it. "
                    "Each spec is its own doit run, one after another. Words after the specs go "
                    "to doit: a command (list, info, forget, clean), task names (perf, "
                    "build_slot:NAME) and options (-n 2, --always). Exit status: 0 done, 1 a gate "
                    "did not pass, 2 a mistake in a spec or its inputs (one line), 3 a doit usage "
                    "error.",
        epilog=example("trtmc pipeline spec.json",
                       "trtmc pipeline a.json b.json -n 2",
                       "trtmc pipeline spec.json perf --always",
                       "trtmc pipeline spec.json list --all --status"))
    p.add_argument("words", nargs=argparse.REMAINDER, metavar="SPEC... [DOIT ARGS]",
                   help="pipeline spec files (*.json), then doit's arguments")
    p.set_defaults(func=run_pipeline)
