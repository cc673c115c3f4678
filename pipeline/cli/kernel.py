"""`trtmc kernel build | export | inspect`: compile a kernel source into a TVM-FFI DSO; export a
library's kernel (FlashInfer's) as one; say what a DSO can call before anything loads it."""
from __future__ import annotations

from pathlib import Path

from pipeline.cli.args import add_json, example, print_json
from pipeline.kernels.build import build_kernel
from pipeline.kernels.flashinfer import PINNED_VERSION, export_decode_attention
from pipeline.kernels.inspect import CAPABILITIES, inspect_file


def run_build(args) -> int:
    build_kernel(Path(args.source), Path(args.output), cuda=args.cuda, cuda_arch=args.cuda_arch)
    return 0


def run_export_flashinfer(args) -> int:
    info = export_decode_attention(Path(args.output), selection=args.selection and Path(args.selection),
                                   arch=args.arch, flashinfer=args.flashinfer and Path(args.flashinfer),
                                   version=args.flashinfer_version)
    print(f"wrote {args.output}: FlashInfer {info['flashinfer']['version']} decode attention, "
          f"{info['arch']}")
    return 0


def run_inspect(args) -> int:
    inspection = inspect_file(args.library, args.grant)
    if args.json:
        print_json(inspection.to_json())
    else:
        for line in inspection.lines():
            print(line)
    return 0 if inspection.passed else 1


def register(sub) -> None:
    p = sub.add_parser("kernel", help="kernel DSOs")
    s = p.add_subparsers(dest="kernel_command", required=True, metavar="SUBCOMMAND")
    b = s.add_parser("build", help="compile a kernel source (.cu) into a TVM-FFI DSO with signature "
                                   "metadata",
                     epilog=example("trtmc kernel build examples/byok/residual_add.cu --cpu-only "
                                    "-o kernel/residual_add.so",
                                    "trtmc kernel build examples/byok/residual_add.cu --cuda "
                                    "--cuda-arch 90a -o kernel/residual_add.so"))
    b.add_argument("source", metavar="SOURCE", help="kernel source: C++ for g++, CUDA for nvcc")
    b.add_argument("-o", "--output", required=True, metavar="X.so",
                   help="the .so to write (atomically)")
    mode = b.add_mutually_exclusive_group()
    mode.add_argument("--cuda", dest="cuda", action="store_const", const=True, default=None,
                      help="compile with nvcc: CPU and CUDA paths (default when a GPU and nvcc "
                           "are present)")
    mode.add_argument("--cpu-only", dest="cuda", action="store_const", const=False,
                      help="compile with g++: CPU path only")
    b.add_argument("--cuda-arch", help="CUDA architecture(s) for --cuda, e.g. 90a or 80,90a "
                                       "(default: TVM_FFI_CUDA_ARCH_LIST, else the visible GPU)")
    b.set_defaults(func=run_build)
    e = s.add_parser("export", help="build a library's kernel into a TVM-FFI DSO for a slot")
    es = e.add_subparsers(dest="exporter", required=True, metavar="KERNEL")
    f = es.add_parser(
        "flashinfer-decode-attention",
        help="FlashInfer's batch decode kernel with the decode-attention recipe's ABI",
        description="Builds FlashInfer's own decode kernel, from the headers of a pinned, "
                    "unmodified release, into a DSO exporting run(q, k_cache, v_cache, kv_len, "
                    "out): the key and value caches are read in place as FlashInfer pages, and "
                    "the active length and split plan stay on the device (no host "
                    "synchronisation: CUDA-graph capturable). Needs nvcc, and a GPU or --arch.",
        epilog=example("trtmc kernel export flashinfer-decode-attention selection.json -o fi.so",
                       "trtmc kernel export flashinfer-decode-attention --arch 90a -o fi.so"))
    f.add_argument("selection", nargs="?", metavar="SELECTION.json",
                   help="a selection (or selection set) whose ABI the DSO must implement: checked "
                        "before anything is compiled")
    f.add_argument("-o", "--output", required=True, metavar="X.so", help="the .so to write (atomically)")
    f.add_argument("--arch", help="the CUDA architecture to build for, e.g. 90a (default: the "
                                  "visible GPU's; required without one)")
    f.add_argument("--flashinfer", metavar="FOLDER",
                   help="a copy of the flashinfer package folder (_build_meta.py, data/include, "
                        "data/cccl); default: the installed flashinfer-python")
    f.add_argument("--flashinfer-version", default=PINNED_VERSION, metavar="V",
                   help=f"the FlashInfer release the headers must be (default: the pin, "
                        f"{PINNED_VERSION})")
    f.set_defaults(func=run_export_flashinfer)
    i = s.add_parser("inspect", help="what a kernel DSO can call (its libraries, imports and raw "
                                     "system calls), read before anything loads it",
                     description="Reads the DSO's needed libraries and imported symbols, sorts "
                                 "each import into a category of the allow-list "
                                 "(pipeline/kernels/inspect.py), and scans its code for raw "
                                 "system-call instructions. Exit status 1 when anything is "
                                 "refused: a capability the spec did not grant, or a name the "
                                 "allow-list does not list.",
                     epilog=example("trtmc kernel inspect kernel/residual_add.so",
                                    "trtmc kernel inspect kernel/loader.so --grant dynamic-loading "
                                    "--json"))
    i.add_argument("library", metavar="X.so", help="the kernel DSO to inspect (not loaded)")
    i.add_argument("--grant", action="append", default=[], choices=CAPABILITIES, metavar="CAP",
                   help="a capability to allow, as a spec's kernel block grants it; repeatable")
    add_json(i, "the inspection")
    i.set_defaults(func=run_inspect)
