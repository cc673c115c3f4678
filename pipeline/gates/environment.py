"""The machine a kernel build or a gate verdict depends on: one probe, and what each depends on.

`probe()` reports the machine once per process, cheaply enough for doit to call while it loads its
tasks: torch's version and CUDA build are read without importing torch (torch/version.py), torch
is asked about GPUs only when it was built with CUDA, and nvidia-smi runs with a timeout.

`TRTMC_ENV_OVERRIDE` (a testing and CI aid) holds a JSON object of probe fields to replace, e.g.
`{"torch": "2.14.0"}` or `{"gpus": [{"name": "NVIDIA H200", "arch": "90"}], "cuda": "12.8"}`, to
see what another machine would re-run or refuse. Nothing runs differently: only the reported
machine changes.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

import orjson

from pipeline import isolation, jsonio
from pipeline.errors import UserError
from pipeline.kernels.build import compiler_version, nvcc_version
from pipeline.modes import Mode

if TYPE_CHECKING:
    from pipeline.kernels.block import KernelBlock

OVERRIDE = "TRTMC_ENV_OVERRIDE"
TOOL_TIMEOUT_S = 30  # nvidia-smi or a compiler's --version that hangs: the field is unknown
PROBE_TIMEOUT_S = 120  # torch's first CUDA call (driver start-up) in the probe's worker
_STR_OR_NULL = (str, type(None))
FIELDS = {  # the probe's report: field -> the types an override may give it
    "python": (str,), "platform": (str,), "cpu": _STR_OR_NULL,
    "torch": (str,), "cuda": _STR_OR_NULL, "triton": _STR_OR_NULL, "apache_tvm_ffi": _STR_OR_NULL,
    "gpus": (list,), "gpu_driver": _STR_OR_NULL, "cxx": _STR_OR_NULL, "nvcc": _STR_OR_NULL,
    "engine_code": (str,),
}
# what a gate verdict is compared on (`verdict_key`): a difference in any of these is another
# verdict; the rest of an environment (python, other packages, the CPU of a GPU verdict) is a note
VERDICT_FIELDS = ("device", "gpu", "cpu", "gpu_driver_major", "cuda", "torch", "triton",
                  "apache_tvm_ffi", "engine", "engine_code")
PACKAGE = Path(__file__).resolve().parent.parent  # trtmc's own code: the `pipeline` package
PRESENTATION = ("cli",)  # its subpackages that only show verdicts: not part of `engine_code`


def _version(*packages: str) -> str | None:
    """The installed version of the first of `packages` that is installed (Triton ships as
    `triton`, or as `pytorch-triton` beside a nightly torch)."""
    for package in packages:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            pass
    return None


def _torch_version() -> tuple[str, str | None]:
    """(torch.__version__, torch.version.cuda) without importing torch (seconds, and a CUDA
    context in a doit process that then holds it while the gates run)."""
    if "torch" in sys.modules:
        import torch
        return torch.__version__, torch.version.cuda
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("torch is not installed (pip install torch)")
    path = os.path.join(spec.submodule_search_locations[0], "version.py")
    loader = importlib.machinery.SourceFileLoader("_trtmc_torch_version", path)
    found = importlib.util.spec_from_loader(loader.name, loader)
    assert found is not None  # a loader was given
    module = importlib.util.module_from_spec(found)
    loader.exec_module(module)
    return module.__version__, module.cuda


def _run(cmd: list[str]) -> str | None:
    """stdout of `cmd`, or None when it cannot run, fails or outlives TOOL_TIMEOUT_S."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TOOL_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout if proc.returncode == 0 else None


def _torch_gpus() -> list[dict]:
    """[{name, arch}] of the GPUs torch sees (this initialises CUDA in the calling process)."""
    import torch
    if not torch.cuda.is_available():
        return []
    return [{"name": torch.cuda.get_device_name(i),
             "arch": "".join(map(str, torch.cuda.get_device_capability(i)))}
            for i in range(torch.cuda.device_count())]


def _gpus(cuda: str | None) -> tuple[list[dict], str | None]:
    """([{name, arch}] of the GPUs torch sees, the driver version); ([], None) for a CPU build of
    torch, which is never imported to find that out. Torch is asked in a worker process: a process
    that initialised CUDA cannot fork a child that uses it, and doit's process forks its stages."""
    if cuda is None:
        return [], None
    gpus = isolation.run_isolated(_torch_gpus, what="asking torch about the GPUs", fork=True,
                                  limits=isolation.Limits(stall_s=PROBE_TIMEOUT_S))
    if not gpus:
        return [], None
    smi = shutil.which("nvidia-smi")
    out = _run([smi, "--query-gpu=driver_version", "--format=csv,noheader", "-i", "0"]) if smi \
        else None
    return gpus, (out.strip() or None) if out else None


def _cpu() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f
                          if line.startswith("model name")), None)
    except OSError:
        model = None
    return model or platform.processor() or None


@functools.cache
def engine_code() -> str:
    """sha256 of trtmc's own code as it runs here: the path and bytes of every Python file of the
    package but the command line's. A verdict holds for the engine, gates and stages that
    reached it; a version string does not change with an edited or patched install."""
    digest = hashlib.sha256()
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative.split("/")[0] in PRESENTATION:
            continue
        data = path.read_bytes()
        digest.update(b"%s\0%d\0" % (relative.encode(), len(data)))
        digest.update(data)
    return f"sha256:{digest.hexdigest()}"


@functools.cache
def _measured() -> dict:
    torch_version, cuda = _torch_version()
    gpus, driver = _gpus(cuda)
    return {"python": platform.python_version(), "platform": platform.platform(), "cpu": _cpu(),
            "torch": torch_version, "cuda": cuda, "triton": _version("triton", "pytorch-triton"),
            "apache_tvm_ffi": _version("apache-tvm-ffi"), "gpus": gpus, "gpu_driver": driver,
            "cxx": compiler_version(os.environ.get("CXX") or shutil.which("g++"), ""),
            "nvcc": nvcc_version(), "engine_code": engine_code()}


def _override() -> dict:
    text = os.environ.get(OVERRIDE)
    if not text:
        return {}
    fields = jsonio.parse_object(text, OVERRIDE, "probe fields")
    for key, value in fields.items():
        if key not in FIELDS:
            raise UserError(f"{OVERRIDE}: unknown field '{key}' (expected one of "
                            f"{', '.join(FIELDS)})")
        if not isinstance(value, FIELDS[key]) or key == "gpus" and not (isinstance(value, list) and all(
                isinstance(g, dict) and set(g) == {"name", "arch"} and
                all(isinstance(v, str) for v in g.values()) for g in value)):
            expected = '[{"name": STR, "arch": STR}, ...]' if key == "gpus" else \
                " or ".join("null" if t is type(None) else "a string" for t in FIELDS[key])
            raise UserError(f"{OVERRIDE}: field '{key}': expected {expected}, got "
                            f"{orjson.dumps(value).decode()}")
    return fields


def probe() -> dict:
    """This machine as builds and verdicts see it (FIELDS), with TRTMC_ENV_OVERRIDE applied."""
    return {**_measured(), **_override()}


def overridden() -> list[str]:
    """The fields TRTMC_ENV_OVERRIDE replaces (sorted; empty without it): an environment with
    any is simulated, not measured."""
    return sorted(_override())


def build_key(kernel: KernelBlock) -> dict:
    """What a DSO made from the spec's `kernel` block depends on here: the tvm-ffi it links, and
    its form's toolchain (kernels/block.py: a source's build target and compiler, an exporter's
    GPUs, CUDA and torch; nothing more for a given DSO, which is copied as it is)."""
    env = probe()
    return {"apache_tvm_ffi": env["apache_tvm_ffi"], **kernel.toolchain(env)}


def resolve_device(device: str | None) -> tuple[str, int | None]:
    """(kind, CUDA index) that `device` (cpu, cuda, cuda:N or auto) names here, as
    `pipeline.runtime.pipeline.resolve_device` resolves it; a CUDA device on a machine without
    one stays CUDA (the gate itself refuses it)."""
    gpus = probe()["gpus"]
    if device in (None, "auto"):
        return ("cuda", 0) if gpus else ("cpu", None)
    kind, _, index = str(device).partition(":")
    return (kind, int(index) if index.isdigit() else 0) if kind == "cuda" else (kind, None)


def gate_environment(device: str | None, mode: str | None = None) -> dict:
    """Where a gate on `device` runs here: the device kind, the GPU and driver when it is CUDA
    (null on a CPU, whatever GPUs the machine has), the CPU model when it is a CPU, CUDA, torch, Triton, tvm-ffi,
    the engine
    mode: `mode` (the spec's gates.mode), else the device's default (`Mode.of`, which
    `open_pipeline` calls too), and the engine's code (`engine_code`)."""
    env = probe()
    kind, index = resolve_device(device)
    gpu = env["gpus"][index] if kind == "cuda" and index is not None and index < len(env["gpus"]) \
        else None
    return {"device": kind, "gpu": gpu and gpu["name"], "cpu": env["cpu"] if kind == "cpu" else None,
            "gpu_driver": env["gpu_driver"] if kind == "cuda" else None,
            **{k: env[k] for k in ("cuda", "torch", "triton", "apache_tvm_ffi")},
            "engine": Mode.of(mode, kind).value, "engine_code": env["engine_code"]}


def verdict_key(env: Mapping) -> dict:
    """The VERDICT_FIELDS of an environment (`gate_environment`, or a receipt's): a driver by its
    major version (a bug-fix release of the same branch is the same verdict); the CPU model only
    for a verdict reached on a CPU (it is the device timed there)."""
    driver = env.get("gpu_driver")
    derived = {"gpu_driver_major": driver.split(".")[0] if driver else None,
               "cpu": env.get("cpu") if env.get("device") == "cpu" else None}
    return {k: derived[k] if k in derived else env.get(k) for k in VERDICT_FIELDS}
