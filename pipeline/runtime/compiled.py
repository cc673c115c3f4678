"""torch.compile of a lowered program's step, slots included.

A bound slot kernel (a TVM-FFI function, or any Python callable in tests) is invisible to
torch.compile: Dynamo cannot trace into it and would break the graph. So every SLOT call goes
through one opaque custom op, `trtmc::slot_call(key, inputs, workspace, out)`, which looks the
kernel up in a process-level registry by a key unique to that lowered slot (two programs binding
the same binding id never collide). The op declares that it writes `out` and `workspace`, and its
fake impl does nothing, so Dynamo, AOT autograd and Inductor keep it in one graph and order it like
any in-place op. `compile_step` then compiles the whole step with fullgraph=True: a graph break is
an error, not a silent slowdown. On CUDA, our own CUDA graph is captured around the compiled step
(pipeline/runtime/generate.py), so Inductor's cudagraph mode stays off.
"""
from __future__ import annotations

import copy
import itertools
import weakref
from typing import Callable, Optional

import torch

from pipeline.graph.abi import call_order

_KERNELS: dict[str, Callable] = {}
_next = itertools.count()


def register_slot(binding_id: str, kernel: Callable, extra_args: list, owner: object) -> str:
    """Registry key for `kernel` with its constant extra arguments bound; the entry is dropped
    when `owner` (the slot's step function) is garbage-collected."""
    key = f"{binding_id}#{next(_next)}"
    _KERNELS[key] = lambda inputs, workspace, out: kernel(*call_order(inputs, workspace, [out], extra_args))
    weakref.finalize(owner, _KERNELS.pop, key, None)
    return key


@torch.library.custom_op("trtmc::slot_call", mutates_args=("workspace", "out"))
def slot_call(key: str, inputs: list[torch.Tensor], workspace: Optional[torch.Tensor],
              out: torch.Tensor) -> None:
    """Run the registered kernel in the ABI's call order."""
    _KERNELS[key](inputs, workspace, out)


def slot_invoker(binding_id: str, kernel: Callable, extra_args: list, owner: object) -> Callable:
    """`invoke(inputs, workspace, out)` runs the kernel in the ABI's call order: directly
    when eager (a custom op's Python dispatch costs about 55 us a call, measured on CPU, which a
    perf gate would charge to the kernel), through the opaque custom op while torch.compile traces."""
    key = register_slot(binding_id, kernel, extra_args, owner)

    def invoke(inputs: list, workspace, out) -> None:
        if torch.compiler.is_compiling():
            slot_call(key, inputs, workspace, out)
        else:
            kernel(*call_order(inputs, workspace, [out], extra_args))
    return invoke


@slot_call.register_fake
def _slot_call_fake(key, inputs, workspace, out) -> None:
    return None


def compile_step(program, *, mode: str | None = None, backend: str = "inductor",
                 emulate_precision_casts: bool = True) -> Callable:
    """`program.step` compiled whole (fullgraph, static shapes). With Inductor and no `mode`,
    fused kernels round 16-bit intermediates where eager does (emulate_precision_casts), so the
    compiled step stays close to the eager one; on CUDA, independent small kernels (a layer's
    query and key norms, its cache writes) are launched as one (combo kernels: fewer launches per
    decode step, measured in docs/performance.md). A `mode` uses that mode's own settings."""
    options = None
    if backend == "inductor" and mode is None:
        options = {"emulate_precision_casts": emulate_precision_casts,
                   "combo_kernels": program.device.type == "cuda"}
    return torch.compile(program.step, fullgraph=True, dynamic=False, backend=backend,
                         mode=mode, options=options)


def compiled_program(program, **kwargs):
    """A shallow copy of `program` whose step is `compile_step(program, **kwargs)`."""
    twin = copy.copy(program)
    twin.step = compile_step(program, **kwargs)
    return twin
