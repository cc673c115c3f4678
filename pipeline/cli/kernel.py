"""`trtmc kernel build`: compile a kernel source into a TVM-FFI DSO."""
from __future__ import annotations

from pathlib import Path

from pipeline.cli.args import example
from pipeline.kernels.build import build_kernel


def run_build(args) -> int:
    build_kernel(Path(args.source), Path(args.output), cuda=args.cuda, cuda_arch=args.cuda_arch)
    return 0


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
