"""`trtmc model synth`: write a synthetic checkpoint (shipped or given config, seeded weights)."""
from __future__ import annotations

from pathlib import Path

from pipeline.cli.args import SEED, example
from pipeline.models import hubcache
from pipeline.models.synth import INITS, parse_override, shipped_names, synthesize


def _synth(args) -> int:
    overrides = dict(parse_override(text) for text in args.override)
    out = synthesize(args.name_or_config, Path(args.out), seed=args.seed, weights=not args.no_weights,
                     overrides=overrides, init=args.init)
    print(out)
    return 0


def _cache(args) -> int:
    print(hubcache.add_to_cache(Path(args.directory), args.repo_id, args.revision, ref=args.ref))
    return 0


def register(subparsers) -> None:
    group = subparsers.add_parser("model", help="model checkpoints").add_subparsers(
        dest="model_command", required=True, metavar="SUBCOMMAND")
    p = group.add_parser("synth", help="write a Hugging Face checkpoint with random weights",
                         description="Write config.json (+ overrides), seeded random weights in "
                                     "model.safetensors and a small real tokenizer to a new directory.",
                         epilog=example("trtmc model synth Qwen3-8B --override num_hidden_layers=2 "
                                        "-o artifacts/qwen3-tiny"))
    p.add_argument("name_or_config", metavar="NAME_OR_CONFIG",
                   help=f"a shipped config ({', '.join(shipped_names())}, or its hub id) "
                        f"or a path to a config.json")
    p.add_argument("-o", "--out", required=True, metavar="DIR", help="new (or empty) output directory")
    p.add_argument("--seed", type=SEED, default=0, help="seed of the weights")
    p.add_argument("--init", choices=INITS, default="random",
                   help="random: transformers' seeded init, built in memory; pattern: a hash of "
                        "seed, name and index, the same bits on every machine, written shard by "
                        "shard (for full-size checkpoints)")
    p.add_argument("--no-weights", action="store_true",
                   help="config and tokenizer only (enough to capture the graph)")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="set a config key; VALUE is JSON if it parses, else a string (repeatable)")
    p.set_defaults(func=_synth)

    p = group.add_parser("cache", help="file a local checkpoint into the offline Hugging Face cache",
                         description="Copy a model directory into the local Hugging Face cache "
                                     "(HF_HOME / HF_HUB_CACHE) as REPO_ID at COMMIT, in the hub's "
                                     "own layout, so commands can name it by hub id offline.",
                         epilog=example("trtmc model cache artifacts/qwen3-tiny --repo-id "
                                        "Qwen/Qwen3-8B --revision "
                                        "b968826d9c46dd6066d109eabc6255188de91218"))
    p.add_argument("directory", metavar="DIR", help="a Hugging Face model directory")
    p.add_argument("--repo-id", required=True, metavar="ORG/NAME", help="hub id to file it under")
    p.add_argument("--revision", required=True, metavar="COMMIT", help="40-hex-digit commit hash")
    p.add_argument("--ref", default="main", help="ref to point at the commit")
    p.set_defaults(func=_cache)
