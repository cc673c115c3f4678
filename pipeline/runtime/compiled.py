"""torch.compile of a lowered program's step, slots included.

A bound slot kernel (a TVM-FFI function, or any Python callable in tests) is invisible to
torch.compile: Dynamo cannot trace into it and would break the graph. So every SLOT call goes
through one opaque custom op, `trtmc::slot_call(selector, inputs, workspace, out)`, which looks the
kernel up in a process-level registry by a number unique to that lowered slot (two programs
binding the same binding id never collide), held in a CPU tensor: an argument, not a constant of
the graph, so the slot of every layer can be one step of one compiled block (blocks.py). The op
declares that it writes `out` and `workspace`, and its fake impl does nothing, so Dynamo, AOT
autograd and Inductor keep it in one graph and order it like any in-place op. `compile_step` then
compiles with fullgraph=True: a graph break is an error, not a silent slowdown. On CUDA, our own
CUDA graph is captured around the compiled step (pipeline/runtime/generate.py), so Inductor's
cudagraph mode stays off.

Inductor's compile cache: a first compile of a large step takes minutes, a cached one seconds. When
TORCHINDUCTOR_CACHE_DIR is not set at the first `compile_step`, it is set to
`compile_cache_dir(device)`: $XDG_CACHE_HOME/trtmc/inductor/KEY (XDG_CACHE_HOME defaults to
~/.cache), KEY naming what compiled code depends on (`compile_cache_key`: torch's version, its
CUDA build, the GPU's model, as pipeline/gates/environment.py's probe reports them), so a folder
is never shared by two such environments and a CI cache can be keyed by the folder's name. A
TORCHINDUCTOR_CACHE_DIR that is already set is left as it is, unless it is the temporary folder
torch writes there itself when first asked for one. An optimized pipeline on CUDA picks
the folder when it opens, before any Triton kernel compiles (`use_compile_cache`).
"""
from __future__ import annotations

import copy
import itertools
import os
import re
import weakref
from pathlib import Path
from typing import Callable, Optional

import torch

from pipeline.files import cache_home
from pipeline.graph.abi import arrange, extra_values

_KERNELS: dict[int, Callable] = {}
_next = itertools.count()


def register_slot(kernel: Callable, extra_args: list,
                  owner: object) -> tuple[Callable, torch.Tensor]:
    """(`call(inputs, workspace, out)`: `kernel` in the ABI's call order with its constant extra
    arguments bound, the selector (a CPU int64 scalar) `slot_call` finds it by); the registry
    entry is dropped when `owner` (the slot's step function) is garbage-collected."""
    number = next(_next)
    extras = extra_values(extra_args)  # the call signature's order (abi.arrange), extras made once

    def call(inputs: list, workspace, out) -> None:
        kernel(*arrange(inputs, workspace, [out], extras))
    _KERNELS[number] = call
    weakref.finalize(owner, _KERNELS.pop, number, None)
    return call, torch.tensor(number)


@torch.library.custom_op("trtmc::slot_call", mutates_args=("workspace", "out"))
def slot_call(selector: torch.Tensor, inputs: list[torch.Tensor], workspace: Optional[torch.Tensor],
              out: torch.Tensor) -> None:
    """Run the registered kernel in the ABI's call order."""
    _KERNELS[int(selector)](inputs, workspace, out)


def slot_invoker(kernel: Callable, extra_args: list, owner: object) -> tuple[Callable, torch.Tensor]:
    """(`invoke(inputs, workspace, out)`, the slot's selector): invoke runs the kernel in the
    ABI's call order, directly when eager (a custom op's Python dispatch costs about 55 us a call,
    measured on CPU, which a perf gate would charge to the kernel), through the opaque custom op
    while torch.compile traces."""
    call, selector = register_slot(kernel, extra_args, owner)

    def invoke(inputs: list, workspace, out) -> None:
        if torch.compiler.is_compiling():
            slot_call(selector, inputs, workspace, out)
        else:
            call(inputs, workspace, out)
    return invoke, selector


@slot_call.register_fake
def _slot_call_fake(selector, inputs, workspace, out) -> None:
    return None


CACHE_ENV, TRITON_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"


def compile_cache_key(device) -> dict:
    """{torch, cuda, gpu} of `device` as pipeline/gates/environment.py's `gate_environment`
    reports them for the real machine (torch.__version__, torch.version.cuda, the GPU's name; a
    CUDA device without an index is GPU 0 there, and the GPU is null on a CPU). TRTMC_ENV_OVERRIDE
    changes what the gates report, not the code Inductor compiles, so it does not apply here."""
    device = torch.device(device)
    gpu = None
    if device.type == "cuda":
        gpu = torch.cuda.get_device_name(device.index if device.index is not None else 0)
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "gpu": gpu}


def compile_cache_name(key: dict) -> str:
    """The folder name of a `compile_cache_key`: torch-VERSION_cuda-VERSION_GPU, e.g.
    `torch-2.11.0+cu130_cuda-13.0_NVIDIA-H200` (`none` and `cpu` for a CPU build and device), any
    character outside [A-Za-z0-9.+-] replaced by '-'."""
    name = f"torch-{key['torch']}_cuda-{key['cuda'] or 'none'}_{key['gpu'] or 'cpu'}"
    return "_".join(re.sub(r"[^A-Za-z0-9.+-]+", "-", part) for part in name.split("_"))


def compile_cache_dir(device) -> Path:
    """`cache_home()`/inductor/`compile_cache_name` ($XDG_CACHE_HOME/trtmc/inductor/...)."""
    return cache_home() / "inductor" / compile_cache_name(compile_cache_key(device))


def _cache_dir_is_users() -> bool:
    """Whether TORCHINDUCTOR_CACHE_DIR names a folder of the user's: the first time anything in a
    process asks Inductor for its folder, torch writes its own default (a temporary folder) into
    the environment, and lowering a program can be that first time."""
    value = os.environ.get(CACHE_ENV)
    if value is None:
        return False
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    return os.path.abspath(value) != os.path.abspath(default_cache_dir())


def use_compile_cache(device) -> str:
    """The Inductor cache folder this process compiles into: TORCHINDUCTOR_CACHE_DIR when it is
    set (the user's, or one an earlier call set), else `compile_cache_dir(device)`, which is
    then set in the environment before Inductor reads it. Triton's own cache (the runtime's
    kernels a prefill runs uncompiled, as well as Inductor's) goes in its `triton` folder unless
    TRITON_CACHE_DIR is set, so one folder holds everything a first call compiles."""
    if not _cache_dir_is_users():
        os.environ[CACHE_ENV] = str(compile_cache_dir(device))
    os.environ.setdefault(TRITON_CACHE_ENV, os.path.join(os.environ[CACHE_ENV], "triton"))
    return os.environ[CACHE_ENV]


def _precompiled_headers_in(folder: str) -> None:
    """Inductor precompiles the C++ header its CPU kernels include into a folder it fixes when it
    is imported, in the temporary directory (/tmp/torchinductor_USER/precompiled_headers),
    whatever TORCHINDUCTOR_CACHE_DIR says: another user of the machine can make that folder first
    and fill it, and every CPU kernel compiled here would include what it holds. The headers go
    in the compile cache folder instead (torch's private names; left alone where they differ)."""
    from torch._inductor import codecache
    if isinstance(getattr(codecache, "_HEADER_DIR", None), str) and \
            isinstance(getattr(codecache, "_HEADER_LOCK_DIR", None), str):
        codecache._HEADER_DIR = os.path.join(folder, "precompiled_headers")
        codecache._HEADER_LOCK_DIR = os.path.join(codecache._HEADER_DIR, "locks")


def compile_step(program, *, mode: str | None = None, backend: str = "inductor",
                 emulate_precision_casts: bool = True) -> Callable:
    """`program.step` compiled (fullgraph, static shapes): block by block when blocks repeat (a
    decoder's layers: each distinct block traced and compiled once, blocks.py), else whole. With
    Inductor and no `mode`, fused kernels round 16-bit intermediates where eager does
    (emulate_precision_casts), so the compiled step stays close to the eager one; on CUDA,
    independent small kernels are launched as one (combo kernels: fewer launches per decode
    step). A `mode`
    uses that mode's own settings. The compile cache is `use_compile_cache(program.device)` (the
    module docstring), Inductor's precompiled headers included."""
    from pipeline.runtime import blocks
    folder = use_compile_cache(program.device)
    if backend == "inductor":
        _precompiled_headers_in(folder)
    options = None
    if backend == "inductor" and mode is None:
        options = {"emulate_precision_casts": emulate_precision_casts,
                   "combo_kernels": program.device.type == "cuda"}

    def compile_fn(fn):
        return torch.compile(fn, fullgraph=True, dynamic=False, backend=backend, mode=mode,
                             options=options)
    return blocks.segmented_step(program, compile_fn) or compile_fn(program.step)


def compiled_program(program, **kwargs):
    """A shallow copy of `program` whose step is `compile_step(program, **kwargs)`."""
    twin = copy.copy(program)
    twin.step = compile_step(program, **kwargs)
    return twin
