"""The kernel host's side: open a pipeline with its bound kernels and answer requests over the
channel, every answer carrying the slot calls the audit drew since the last one.

Everything a request can need is imported before the kernel's library loads (this module's
imports), so what the library finds loaded is the same whatever it is later asked: a gate's
request and a production run's meet the same modules, the same caller (`runtime.shadow.checked`)
and the same process (`pipeline/host/__main__.py`).
"""
from __future__ import annotations

import os
import sys
import time
from typing import Callable

import torch

import pipeline
from pipeline.confine import confine
from pipeline.errors import UserError
from pipeline.families import EncoderIO
from pipeline.families.workloads import run_replay
from pipeline.gates import harness, probe  # noqa: F401 - loaded before the library, always
from pipeline.graph.abi import call_order
from pipeline.jsonio import SCHEMA_DIR
from pipeline.runtime import cudagraph, generate  # noqa: F401 - loaded before the library, always
from pipeline.runtime.pipeline import Pipeline, open_pipeline, reopen
from pipeline.modes import Mode

HANDLERS: dict[str, Callable[[Pipeline, dict], dict]] = {}


def handles(kind: str):
    def register(fn):
        HANDLERS[kind] = fn
        return fn
    return register


SYSTEM_READ = ("/usr", "/lib", "/lib64", "/bin", "/sbin", "/etc", "/opt", "/sys")
SYSTEM_EXECUTE = ("/usr", "/lib", "/lib64", "/bin", "/sbin", "/opt")


def confine_host(request: dict):
    """Confine this process before the library loads (pipeline/confine.py): only the channel
    open; readable the system, this Python installation and the run's own files (the bundle, the
    manifest, its libraries, the checkpoint); writable only the scratch folder and this host's
    compile cache; programs run, from the system, this installation and PATH, only where something
    compiles here (a GPU's Triton kernels, the optimized mode's Inductor)."""
    package = os.path.dirname(os.path.realpath(pipeline.__file__))
    project = os.path.dirname(package)  # a source checkout's root holds its artifacts: not read
    installation = {sys.prefix, sys.base_prefix, sys.exec_prefix, package, str(SCHEMA_DIR),
                    *(p for p in map(os.path.realpath, filter(None, sys.path))
                      if p not in ("/", project) and os.path.isdir(p))}
    compiles = request.get("mode") == Mode.OPTIMIZED or str(request["device"]).startswith("cuda")
    if str(request["device"]).startswith("cuda"):
        _triton_helpers()
    path = [os.path.realpath(p) for p in os.environ.get("PATH", "").split(os.pathsep) if p]
    return confine(read=[*SYSTEM_READ, *installation, *request.get("read", [])],
                   write=[request["scratch"], request["cache"]],
                   execute=[*SYSTEM_EXECUTE, *installation, *path], allow_exec=compiles,
                   keep_fds=(0, 1, 2, 3, 4))


def _triton_helpers() -> None:
    """Triton's C helpers for CUDA, compiled (into this host's cache) and loaded before the host
    confines itself: compiled afterwards, under Landlock, Triton finds no GPU backend (seen on an
    H100). Loading them starts no CUDA context, which must come after the confinement: a CUDA
    driver started before it cannot open the device."""
    try:
        from triton.backends.nvidia import driver
    except ImportError:  # no Triton, or no CUDA backend in it: nothing to prepare
        return
    driver.CudaUtils()


def open_hosted(request: dict) -> Pipeline:
    """The pipeline a host serves, opened in this process (the library loads here)."""
    if request.get("threads"):
        torch.set_num_threads(int(request["threads"]))
    return open_pipeline(request["bundle"], request.get("bindings"), device=request["device"],
                         checkpoint=request.get("checkpoint"), mode=request.get("mode"),
                         shadow=bool(request.get("shadow")),
                         audit=float(request.get("audit") or 0.0), in_process=True)


def answer(pipe: Pipeline, request: dict) -> dict:
    """One request's answer, with the audit's draws since the last one."""
    kind = request.get("kind")
    if kind not in HANDLERS:
        raise UserError(f"kernel host: no request '{kind}' (known: {', '.join(sorted(HANDLERS))})")
    with torch.inference_mode():
        body = HANDLERS[kind](pipe, request)
    return {**body, "audit": pipe.audit.take() if pipe.audit is not None else {}}


def _sync(pipe: Pipeline) -> None:
    if pipe.device.type == "cuda":
        torch.cuda.synchronize(pipe.device)


def _on(pipe: Pipeline, inputs: dict) -> dict:
    return {k: v.to(pipe.device) for k, v in inputs.items()}


@handles("encoder")
def _encoder(pipe: Pipeline, request: dict) -> dict:
    """The encoder on inputs the client tokenized (a run's texts, a gate's items)."""
    io = pipe.family.io
    if not isinstance(io, EncoderIO):
        raise UserError(f"kernel host: an 'encoder' request to a {pipe.bundle.family} decoder bundle")
    hidden = io.hidden
    outputs = [pipe.encoder(**_on(pipe, x))[hidden].clone() for x in request["inputs"]]
    _sync(pipe)
    return {"outputs": outputs}


@handles("generate")
def _generate(pipe: Pipeline, request: dict) -> dict:
    records = pipe.generate(list(request["prompts"]), int(request["max_new_tokens"]),
                            **request.get("sampling", {}))
    _sync(pipe)
    return {"records": records}


@handles("forced")
def _forced(pipe: Pipeline, request: dict) -> dict:
    return {"logits": pipe.teacher_forced_logits(list(request["prompt_ids"]),
                                                 list(request["token_ids"]))}


@handles("collect")
def _collect(pipe: Pipeline, request: dict) -> dict:
    """The shadow's raw rows since the last collect (the host's own figures), as a tensor: a
    non-finite figure stays what it is."""
    if pipe.shadow is None:
        return {"rows": torch.zeros(0, 0, dtype=torch.float64), "sites": [], "count": 0}
    rows, sites, n = pipe.shadow.take()
    return {"rows": rows, "sites": sites, "count": n}


@handles("use_kernels")
def _use_kernels(pipe: Pipeline, request: dict) -> dict:
    pipe.use_kernels(list(request["keys"]))
    return {}


def _region_of(pipe: Pipeline, binding_id: str):
    """A slot bound to `binding_id` (every slot of one id calls the same kernel)."""
    found = next((r for r in pipe.regions.values() if r.binding_id == binding_id), None)
    if found is None:
        raise UserError(f"kernel host: no slot is bound to {binding_id!r}")
    return found


@handles("call")
def _call(pipe: Pipeline, request: dict) -> dict:
    """One kernel call on the client's buffers (a probe's): the output and the workspace as the
    kernel left them, and each input the call changed (None for one it left as it was). An
    unchanged input does not travel back: a probe call's caches are most of its bytes, and this
    process could forge the comparison as easily as the copies it would send instead."""
    region = _region_of(pipe, request["key"])
    dev = pipe.device
    inputs = [x.to(dev) for x in request["inputs"]]
    sent = [x.clone() for x in inputs]
    ws = None if request.get("workspace") is None else request["workspace"].to(dev)
    out = request["out"].to(dev)
    _sync(pipe)  # the copies are made before a kernel on a stream of its own can write an input
    t0 = time.perf_counter()
    region.kernel(*call_order(inputs, ws, [out], region.abi["extra_args"]))
    _sync(pipe)
    seconds = time.perf_counter() - t0
    written = [None if _same_bytes(x, s) else x for x, s in zip(inputs, sent)]
    return {"out": out, "inputs": written, "workspace": ws, "seconds": seconds}


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (a NaN the kernel left in place is unchanged)."""
    return torch.equal(a.contiguous().view(-1).view(torch.uint8),
                       b.contiguous().view(-1).view(torch.uint8))


@handles("cuda_checks")
def _cuda_checks(pipe: Pipeline, request: dict) -> dict:
    """The CUDA properties of a call, as raw outputs the client compares: the call fully
    synchronized, on a side stream behind a GPU spin, and captured in a CUDA graph."""
    region = _region_of(pipe, request["key"])
    return probe.cuda_outputs(region, [x.to(pipe.device) for x in request["inputs"]],
                              pipe.device)


@handles("tapped")
def _tapped(pipe: Pipeline, request: dict) -> dict:
    """Every slot on its kernel, eager, on an item the client replays (families/workloads.py
    `run_replay`): each slot call's output, in order, up to `max_bytes` in all."""
    outputs: dict[str, list] = {}
    left = [int(request["max_bytes"])]

    def tap(key, inputs, output) -> None:
        n = output.numel() * output.element_size()
        if n <= left[0]:
            left[0] -= n
            outputs.setdefault(key, []).append(output.detach().clone())
    replayed = request["replayed"]
    if "inputs" in replayed:
        replayed = {"inputs": _on(pipe, replayed["inputs"])}
    run_replay(reopen(pipe, pipe.regions, mode=Mode.EAGER, tap=tap), replayed)
    return {"outputs": outputs}


@handles("time_region")
def _time_region(pipe: Pipeline, request: dict) -> dict:
    """A region timed alone in this process (its figures are the host's: informational), and the
    last timed call's inputs and output for the client to check."""
    from pipeline.gates.performance import time_region
    region = pipe.regions[request["key"]]
    kept: dict = {}
    figures = time_region(pipe, region, trials=int(request["trials"]),
                          warmup=int(request["warmup"]), seed=int(request["seed"]),
                          bandwidth=float(request["bandwidth"]), keep=kept)
    return {"figures": figures.to_json(), **kept}
