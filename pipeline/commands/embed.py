"""`trtmc embed`: the full last hidden state of an encoder bundle, as JSON on stdout."""
from __future__ import annotations

import sys

import orjson



def run(args) -> int:
    from pipeline.runtime.session import open_pipeline
    pipe = open_pipeline(args.bundle, args.kernel_bindings, args.device, args.checkpoint)
    (hidden,) = pipe.embed([args.prompt])
    print(f"[embed] {args.bundle}: hidden state {list(hidden.shape)} {hidden.dtype} on {pipe.device}",
          file=sys.stderr)
    flat = hidden.float().flatten().cpu().tolist()
    sys.stdout.buffer.write(orjson.dumps({"embedding": flat, "shape": list(hidden.shape)}) + b"\n")
    return 0


def add_pipeline_options(p) -> None:
    """Options every command that opens a pipeline shares."""
    p.add_argument("bundle", metavar="BUNDLE")
    p.add_argument("--kernel-bindings", metavar="M.json", help="binding manifest for the slots")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    p.add_argument("--checkpoint", help="checkpoint for a weight-stripped bundle "
                                        "(default: the path recorded at build time)")


def register(sub) -> None:
    p = sub.add_parser("embed", help="run an encoder bundle on a text")
    add_pipeline_options(p)
    p.add_argument("--prompt", required=True, metavar="TEXT")
    p.set_defaults(func=run)
