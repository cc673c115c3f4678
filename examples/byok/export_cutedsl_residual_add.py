#!/usr/bin/env python3
"""Export a CuTe DSL residual add (out = a + b) as a TVM-FFI DSO exporting `run(a, b, out)`.

    python examples/byok/export_cutedsl_residual_add.py \
        --snapshot graph.json --selection residual.selection.json --output residual_add_cute.so

The selection's contract must be two inputs and one output of one dtype (FP32/FP16/BF16) and one
shape, with no workspace and no extra args. The kernel is compiled for that dtype and shape
(dynamic dims stay symbolic) with `--enable-tvm-ffi`; it launches on the TVM-FFI environment
stream, which the runtime sets. Compiling needs a CUDA GPU and nvidia-cutlass-dsl >= 4.3; every
check of the inputs runs first, without either. The DSO carries no signature metadata, so binding
reports its signature as "unknown"; the CuTe runtime checks dtypes and shapes at call time.
"""

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from pipeline import jsonio
from pipeline.errors import UserError
from pipeline.graph.receipt import SelectionReceipt
from pipeline.graph.select import check_fresh, load_receipt

SUPPORTED_DTYPES = ("FP32", "FP16", "BF16")
THREADS_PER_BLOCK = 256


def _log(msg: str) -> None:
    print(f"[export cutedsl] {msg}", file=sys.stderr, flush=True)


def check_contract(receipt: SelectionReceipt, where: str) -> tuple[str, list[int]]:
    """(dtype, shape) of a residual-add contract, or a UserError saying what differs."""
    abi = receipt.abi.to_json()  # as the contract's messages quote it
    tensors = abi["inputs"] + abi["outputs"]
    if len(abi["inputs"]) != 2 or len(abi["outputs"]) != 1:
        raise UserError(f"{where}: a residual add takes 2 inputs and 1 output; selection "
                        f"'{receipt.binding_id}' has {len(abi['inputs'])} inputs and "
                        f"{len(abi['outputs'])} outputs")
    first = tensors[0]
    for name, t in zip(("input 0", "input 1", "output 0"), tensors):
        if (t["dtype"], t["shape"]) != (first["dtype"], first["shape"]):
            raise UserError(f"{where}: {name} is {t['dtype']} {t['shape']}, but a residual add "
                            f"needs every tensor like input 0: {first['dtype']} {first['shape']}")
    if first["dtype"] not in SUPPORTED_DTYPES:
        raise UserError(f"{where}: dtype {first['dtype']} is not supported "
                        f"(expected one of {', '.join(SUPPORTED_DTYPES)})")
    if abi["workspace_bytes"] or abi["extra_args"]:
        raise UserError(f"{where}: a residual add takes no workspace and no extra args; the "
                        f"selection has workspace_bytes={abi['workspace_bytes']} and "
                        f"{len(abi['extra_args'])} extra args")
    return first["dtype"], list(first["shape"])


def _require_gpu() -> None:
    import torch
    if not torch.cuda.is_available():
        raise UserError("compiling a CuTe DSL kernel needs a CUDA GPU and none is visible here; "
                        "run this exporter on the GPU machine")


def _compile_object(dtype: str, shape: list[int], gpu_arch: str, obj: Path, function: str) -> list[str]:
    """Compile and export the kernel into the object file `obj`; returns the runtime libraries
    the DSO must link against."""
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute

    @cute.kernel
    def add_kernel(a: cute.Tensor, b: cute.Tensor, c: cute.Tensor, n: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        i = bidx * THREADS_PER_BLOCK + tidx
        if i < n:
            c[i] = a[i] + b[i]

    @cute.jit
    def residual_add(m_a: cute.Tensor, m_b: cute.Tensor, m_c: cute.Tensor, stream: cuda.CUstream):
        # All three are compact row-major with one shape: add over flat 1-D views.
        n = cute.size(m_a)
        flat = cute.make_layout(n)
        a = cute.make_tensor(m_a.iterator, flat)
        b = cute.make_tensor(m_b.iterator, flat)
        c = cute.make_tensor(m_c.iterator, flat)
        add_kernel(a, b, c, n).launch(grid=((n + THREADS_PER_BLOCK - 1) // THREADS_PER_BLOCK, 1, 1),
                                      block=(THREADS_PER_BLOCK, 1, 1), stream=stream)

    element = {"FP32": cutlass.Float32, "FP16": cutlass.Float16, "BF16": cutlass.BFloat16}[dtype]
    dims = tuple(cute.sym_int() if d < 0 else d for d in shape)  # one symbol per dim, shared
    row_major = tuple(range(len(dims) - 1, -1, -1))
    fakes = [cute.runtime.make_fake_compact_tensor(element, dims, stride_order=row_major)
             for _ in range(3)]
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    compiled = cute.compile(residual_add, *fakes, stream,
                            options=f"--enable-tvm-ffi --gpu-arch {gpu_arch}")
    compiled.export_to_c(str(obj), function_name=function)
    return list(cute.runtime.find_runtime_libraries(enable_tvm_ffi=True))


def export(snapshot: Path, selection: Path, output: Path, *, gpu_arch: str = "sm_90a",
           function: str = "run") -> Path:
    receipt = load_receipt(selection)
    check_fresh(receipt, jsonio.read_json(snapshot, "graph"), str(selection))
    dtype, shape = check_contract(receipt, str(selection))
    if output.exists():
        raise UserError(f"--output {output}: already exists; refusing to overwrite it "
                        f"(remove it or choose another path)")
    _require_gpu()
    output.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=output.parent, prefix=f".{output.name}.") as tmp:
        obj, lib = Path(tmp) / "kernel.o", Path(tmp) / output.name
        _log(f"compiling the CuTe DSL residual add for {dtype} {shape} ({gpu_arch})")
        libs = _compile_object(dtype, shape, gpu_arch, obj, function)
        rpaths = [f"-Wl,-rpath,{d}" for d in dict.fromkeys(str(Path(p).parent) for p in libs)]
        _log(f"linking {output.name} against {', '.join(Path(p).name for p in libs)}")
        proc = subprocess.run(["gcc", "-shared", "-o", str(lib), str(obj), *libs, *rpaths],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.returncode != 0:
            raise UserError(f"linking {output} failed:\n{proc.stdout.strip()}")
        try:
            os.link(lib, output)  # fails rather than replace a file created meanwhile
        except FileExistsError:
            raise UserError(f"--output {output}: appeared while exporting; not overwritten") from None
    _log(f"wrote {output} (function '{function}', no signature metadata)")
    return output


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--snapshot", required=True, type=Path, help="graph snapshot (graph.json)")
    p.add_argument("--selection", required=True, type=Path, help="selection receipt")
    p.add_argument("--output", required=True, type=Path, help="the .so to write (never overwritten)")
    p.add_argument("--gpu-arch", default="sm_90a", help="CuTe DSL target (default sm_90a: H100/H200)")
    p.add_argument("--function", default="run", help="exported function name (default run)")
    args = p.parse_args(argv)
    try:
        export(args.snapshot, args.selection, args.output, gpu_arch=args.gpu_arch,
               function=args.function)
    except UserError as e:
        print(f"export_cutedsl_residual_add: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
