"""Argument groups shared by the commands, the parser and help format they all use, `--json`
output, and the one table from library parameter names to the flags that set them, so a library
error ("max_cache_length 99: ...") reads as the user typed it ("--max-cache-length 99: ...")."""
from __future__ import annotations

import argparse
import sys

from pipeline import jsonio
from pipeline.errors import UserError
from pipeline.families import registry
from pipeline.kernels.manifest import load_manifest

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
    "nodes": "--nodes",
    "override": "--override",
    "pooling": "--pooling",
    "ref": "--ref",
    "binding_id": "--binding-id",
    "recipe": "--recipe",
    "expect_count": "--expect-count",
    "output_shape_like_input": "--output-shape-like-input",
    "audit": "--audit",
}


def text(value: str) -> str:
    """An argparse type: text that is valid UTF-8 (argv bytes that are not reach Python as lone
    surrogates, which a tokenizer refuses with a traceback)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        byte = ord(value[e.start]) - 0xDC00
        what = f"byte 0x{byte:02x}" if 0x80 <= byte <= 0xFF else "a lone surrogate"
        raise argparse.ArgumentTypeError(
            f"not valid UTF-8 ({what} at character {e.start})") from None
    return value


def count(lo: int, hi: int):
    """An argparse type: an integer in lo..hi (the bounds the spec schema uses), so a huge or
    negative number is one usage line, not a crash deep in a library."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"{value} is out of range (expected {lo}..{hi})")
        return value
    parse.__name__ = "integer"
    return parse


def real(lo: float, hi: float):
    """An argparse type: a finite number in (lo, hi], checked before any model is loaded."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not lo < value <= hi:
            raise argparse.ArgumentTypeError(f"{value} is out of range (expected ({lo:g}, {hi:g}])")
        return value
    parse.__name__ = "number"
    return parse


SEED = count(0, 2 ** 32 - 1)
LENGTH = count(1, 2 ** 20)       # sequence lengths, cache lengths, new tokens
RUNS = count(0, 100_000)         # warm-up and benchmark runs


BUILD_OPTIONS = ("precision", "sequence_length", "max_cache_length", "decoder_engine_layout")
EXAMPLE = "example:\n"  # an epilog of example command lines (see `example`)


class HelpFormatter(argparse.HelpFormatter):
    """Examples keep their lines (RawDescriptionHelpFormatter's way), other text wraps; a flag's
    help line ends with its allowed values and its default unless it already names them."""

    def _fill_text(self, text, width, indent):
        if text.startswith(EXAMPLE):
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)

    def _get_help_string(self, action):
        text = action.help or ""
        if action.choices and not all(str(c) in text for c in action.choices):
            text += f" (one of: {', '.join(map(str, action.choices))})"
        default = action.default
        if default not in (None, argparse.SUPPRESS) and default is not False and default != [] \
                and "default" not in text:
            text += " (default: %(default)s)"
        return text


class Parser(argparse.ArgumentParser):
    """The help format everywhere (subparsers are made with the parent's class), and an unknown
    flag reported by the (sub)command it was given to, with that command's usage."""

    def __init__(self, *args, formatter_class=HelpFormatter, **kwargs):
        super().__init__(*args, formatter_class=formatter_class, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if extras and self._subparsers is None:  # a leaf command: nothing below it to take them
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras


def example(*lines: str) -> str:
    """An epilog of example command lines."""
    return EXAMPLE + "\n".join(f"  {line}" for line in lines)


def add_json(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--json", action="store_true",
                   help=f"print {what} as JSON on stdout instead of the table (nothing else on stdout)")


def print_json(obj) -> None:
    sys.stdout.write(jsonio.dumps(obj).decode())


def _option_help(key: str, what: str) -> str:
    """`what; bert: fp16 (default), fp32; qwen3: ...`: values and defaults from the family contracts."""
    parts = []
    for f in registry():
        if key not in f.default_options:
            continue
        default = f.default_options[key]
        allowed = tuple(f.precisions) if key == "precision" else f.option_choices.get(key)
        parts.append(f"{f.name}: " + (", ".join(f"{v} (default)" if v == default else str(v)
                                                for v in allowed) if allowed else f"default {default}"))
    return f"{what}; {'; '.join(parts)}"


def _choices(key: str) -> tuple[str, ...]:
    return tuple(dict.fromkeys(v for f in registry() for v in f.option_choices.get(key, ())))


def roles_help() -> str:
    """The engine roles of every family, over every layout its options allow."""
    parts = []
    for f in registry():
        layouts = [{**f.default_options, key: v} for key, values in f.option_choices.items()
                   for v in values] or [dict(f.default_options)]
        parts.append(f"{f.name}: {', '.join(dict.fromkeys(r for o in layouts for r in f.roles(o)))}")
    return "engine role (any case); " + "; ".join(parts)


def add_build_options(parser: argparse.ArgumentParser) -> None:
    """MODEL's revision and the graph-producing options (`graph inspect`, `build`)."""
    parser.add_argument("--model-revision", metavar="REV",
                        help="hub commit or ref in the local cache (default: a directory's revision "
                             "is its digest, a cached snapshot folder's its commit)")
    parser.add_argument("--precision", metavar="P", type=str.lower,
                        help=_option_help("precision", "build precision (any case)"))
    parser.add_argument("--sequence-length", type=LENGTH, metavar="N",
                        help=_option_help("sequence_length", "padded sequence length"))
    parser.add_argument("--max-cache-length", type=LENGTH, metavar="N",
                        help=_option_help("max_cache_length", "KV cache capacity in tokens"))
    parser.add_argument("--decoder-engine-layout", choices=_choices("decoder_engine_layout"),
                        type=str.lower, help=_option_help(
                            "decoder_engine_layout",
                            "split = prefill + decode engines, unified = one engine"))


def build_options(args: argparse.Namespace) -> dict:
    """Only the options the user gave; the family fills defaults and rejects inapplicable ones."""
    return {key: getattr(args, key) for key in BUILD_OPTIONS if getattr(args, key) is not None}


def pipeline_inputs(args) -> list:
    """What a command that opens a pipeline reads: an output must not replace or enter them."""
    libraries = []
    if args.kernel_bindings:
        libraries = [b.library for b in load_manifest(args.kernel_bindings).bindings]
    return [args.bundle, args.kernel_bindings, args.checkpoint, *libraries]


def add_pipeline_options(p: argparse.ArgumentParser) -> None:
    """Options every command that opens a pipeline shares."""
    p.add_argument("bundle", metavar="BUNDLE", help="a *.bundle directory from `trtmc build`")
    p.add_argument("--kernel-bindings", metavar="M.json",
                   help="binding manifest for the slots of a slot-ready bundle (default: none, "
                        "for a native bundle)")
    p.add_argument("--device", default="auto", type=str.lower,
                   help="cpu, cuda, cuda:N or auto (default: auto = cuda when available)")
    p.add_argument("--checkpoint", metavar="DIR",
                   help="checkpoint for a weight-stripped bundle (default: the path recorded at "
                        "build time)")
    p.add_argument("--eager", dest="mode", action="store_const", const="eager", default=None,
                   help="run layer by layer (default on CUDA: the optimized mode, lowering passes "
                        "then the step compiled and replayed as a CUDA graph; a CPU is always eager)")


def add_audit_option(p: argparse.ArgumentParser) -> None:
    """Production's own check of a bound kernel (pipeline/host/hosted.py)."""
    p.add_argument("--audit", type=real(0, 1), default=0.0, metavar="RATE",
                   help="with --kernel-bindings: draw each slot call with probability RATE once "
                        "it has returned and compute it again by its native region in this "
                        "process, which never loads the kernel; a call that differs is reported "
                        "and the command exits 1 (default: 0, no audit)")


class AuditFailed(UserError):
    """A drawn slot call differed from its native region: the run's output is out, and wrong."""
    exit_status = 1


def audit_verdict(pipe) -> None:
    """The audit's summary on stderr; AuditFailed when a drawn call differed."""
    audited = getattr(pipe, "audited", None)
    if audited is None or not audited.drawn:
        return
    failed = audited.failed
    line = (f"audit: {audited.calls} slot calls, {audited.drawn} drawn, {len(audited.judged)} "
            f"computed again, {len(failed)} differ from the native region")
    if not failed:
        print(line, file=sys.stderr)
        return
    first = failed[0]
    raise AuditFailed(f"{line} (first: call {first['call']} of slot {first['slot']}, error "
                      f"ratio {first['max_error_ratio']:.3g})")


def add_ray_options(p: argparse.ArgumentParser) -> None:
    """Where a command spreads its tasks: a Ray cluster (the `ray` extra) or this machine."""
    p.add_argument("--ray", metavar="ADDRESS",
                   help="run on this Ray cluster: an address (host:6379, ray://host:10001, auto) "
                        "or `local`, a private cluster started here for this run (default: no "
                        "Ray, every task here, one after another; needs pip install 'trtmc[ray]')")
    p.add_argument("--ray-init", metavar="JSON",
                   help="with --ray local: ray.init's arguments as a JSON object, e.g. "
                        "'{\"num_cpus\": 2, \"num_gpus\": 2, \"resources\": "
                        "{\"accelerator_type:H200\": 2}}' (default: this machine's resources)")
    p.add_argument("--gpu-model", action="append", default=[], metavar="[NAME=]MODEL",
                   help="run GPU specs only on nodes with this GPU model (Ray's "
                        "accelerator_type:MODEL label); NAME= limits it to one spec; repeatable")


def ray_init(text: str | None) -> dict:
    """--ray-init's JSON object, checked here (one line, not a Ray traceback)."""
    if text is None:
        return {}
    return jsonio.parse_object(text, "--ray-init", "ray.init arguments")
