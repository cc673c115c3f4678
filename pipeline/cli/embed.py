"""`trtmc embed`: the full last hidden state of an encoder bundle, as JSON on stdout."""
from __future__ import annotations

import sys

import orjson

from pipeline.cli.args import add_pipeline_options
from pipeline.log import get as log_topic

log = log_topic("embed")

def run(args) -> int:
    from pipeline.runtime.pipeline import open_pipeline
    pipe = open_pipeline(args.bundle, args.kernel_bindings, args.device, args.checkpoint)
    (hidden,) = pipe.embed([args.prompt])
    log.info("%s: hidden state %s %s on %s", args.bundle, list(hidden.shape), hidden.dtype, pipe.device)
    flat = hidden.float().flatten().cpu().tolist()
    sys.stdout.buffer.write(orjson.dumps({"embedding": flat, "shape": list(hidden.shape)}) + b"\n")
    return 0


def register(sub) -> None:
    p = sub.add_parser("embed", help="run an encoder bundle on a text")
    add_pipeline_options(p)
    p.add_argument("--prompt", required=True, metavar="TEXT")
    p.set_defaults(func=run)
