"""Argument groups shared by the commands, and the one table from library parameter names to the
flags that set them, so a library error ("max_cache_length 99: ...") reads as the user typed it
("--max-cache-length 99: ...")."""
from __future__ import annotations

import argparse

# library parameter (family build option, pipeline argument) -> CLI flag
FLAGS = {
    "model_revision": "--model-revision",
    "precision": "--precision",
    "sequence_length": "--sequence-length",
    "max_cache_length": "--max-cache-length",
    "decoder_engine_layout": "--decoder-engine-layout",
    "engine_role": "--engine-role",
    "weights": "--weights",
    "graph_patch": "--graph-patch",
    "kernel_bindings": "--kernel-bindings",
    "device": "--device",
    "checkpoint": "--checkpoint",
    "max_new_tokens": "--max-new-tokens",
    "library": "--library",
    "cuda": "--cuda",
    "cuda_arch": "--cuda-arch",
    "output": "-o",
    "override": "--override",
}
BUILD_OPTIONS = ("precision", "sequence_length", "max_cache_length", "decoder_engine_layout")


def add_build_options(parser: argparse.ArgumentParser) -> None:
    """MODEL's revision and the graph-producing options (`graph inspect`, `build`)."""
    parser.add_argument("--model-revision", metavar="REV",
                        help="hub commit or ref in the local cache (a directory's revision is its "
                             "digest, a cached snapshot folder's its commit)")
    parser.add_argument("--precision", metavar="P", type=str.lower,
                        help="bert: fp16 (default), fp32; qwen3: bf16 (default), fp16")
    parser.add_argument("--sequence-length", type=int, metavar="N",
                        help="bert: padded sequence length (default 256)")
    parser.add_argument("--max-cache-length", type=int, metavar="N",
                        help="qwen3: KV cache capacity in tokens (default 4096)")
    parser.add_argument("--decoder-engine-layout", choices=("split", "unified"), type=str.lower,
                        help="qwen3: split = prefill + decode engines (default), unified = one")


def build_options(args: argparse.Namespace) -> dict:
    """Only the options the user gave; the family fills defaults and rejects inapplicable ones."""
    return {key: getattr(args, key) for key in BUILD_OPTIONS if getattr(args, key) is not None}


def add_pipeline_options(p: argparse.ArgumentParser) -> None:
    """Options every command that opens a pipeline shares."""
    p.add_argument("bundle", metavar="BUNDLE", help="a *.bundle directory from `trtmc build`")
    p.add_argument("--kernel-bindings", metavar="M.json",
                   help="binding manifest for the slots of a slot-ready bundle")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default: cuda "
                                                    "when available)")
    p.add_argument("--checkpoint", help="checkpoint for a weight-stripped bundle "
                                        "(default: the path recorded at build time)")
