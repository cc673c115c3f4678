"""`trtmc embed`: an encoder bundle's embedding of a text, as JSON on stdout: by default the full
last hidden state, flattened (`{"embedding": [...], "shape": [S, H]}`)."""
from __future__ import annotations

import sys

import orjson

from pipeline.cli.args import add_audit_option, add_pipeline_options, audit_verdict, example, text
from pipeline.host import open_pipeline
from pipeline.log import get as log_topic

log = log_topic("embed")


def run(args) -> int:
    with open_pipeline(args.bundle, args.kernel_bindings, args.device, args.checkpoint,
                       mode=args.mode, audit=args.audit,
                       what=f"trtmc {args.command}") as pipe:
        (hidden,) = pipe.embed([args.prompt], pooling=args.pooling, normalize=args.normalize)
    log.info("%s: embedding %s %s on %s", args.bundle, list(hidden.shape), hidden.dtype, pipe.device)
    flat = hidden.float().flatten().cpu().tolist()
    sys.stdout.buffer.write(orjson.dumps({"embedding": flat, "shape": list(hidden.shape)}) + b"\n")
    audit_verdict(pipe)
    return 0


def register(sub) -> None:
    p = sub.add_parser("embed", help="run an encoder bundle on a text",
                       description="Print {\"embedding\": [...], \"shape\": [...]} on stdout: the "
                                   "last hidden state [S, H] flattened (padded positions "
                                   "included), or with --pooling mean one [H] vector.",
                       epilog=example("trtmc embed minilm.bundle --prompt 'The quick brown fox.' "
                                      "> native.json",
                                      "trtmc embed minilm.bundle --prompt 'The quick brown fox.' "
                                      "--pooling mean --normalize"))
    add_pipeline_options(p)
    add_audit_option(p)
    p.add_argument("--prompt", required=True, type=text, metavar="TEXT", help="the text to embed")
    p.add_argument("--pooling", choices=("mean",), type=str.lower,
                   help="mean: average over the real tokens only, using the attention mask "
                        "(default: none, the full hidden state)")
    p.add_argument("--normalize", action="store_true",
                   help="scale each vector to unit L2 norm (default: off)")
    p.set_defaults(func=run)
