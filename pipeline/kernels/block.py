"""A spec's kernel block in its three forms, one type each: a source trtmc compiles
(`CudaSource`), a DSO given as it is (`PrebuiltDso`), or a command that exports one
(`Exporter`). Each owns what differs between the forms: the files it names, how its DSO is made,
and what that DSO depends on in a machine (its toolchain). `resolve` is the one place that tells
the forms apart; everything else asks the block."""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from pipeline.errors import UserError
from pipeline.files import read_regular, shown
from pipeline.kernels.bind import MAX_LIBRARY_BYTES, elf_problem
from pipeline.kernels import build  # its EXPORT_TIMEOUT_S read at each export
from pipeline.kernels.build import build_kernel, run_limited

DEFAULT_FUNCTION = "run"
FORMS = ("source", "dso", "exporter")  # the key that names each form in a spec


@dataclass(frozen=True)
class KernelBlock:
    """What every form has: the function the slot calls and the capabilities its library is
    granted beyond the allow-list of imports (kernels/inspect.py)."""
    function: str
    capabilities: tuple[str, ...]

    def fields(self) -> list[tuple[str, Path]]:
        """(the spec's JSON path, file) of each file the block names."""
        raise NotImplementedError

    def files(self) -> list[Path]:
        return [p for _, p in self.fields()]

    def export(self, out: Path, where: Callable[[str], str], cwd: Path) -> None:
        """Write the DSO at `out`; `where(field)` names a field of the block in an error."""
        raise NotImplementedError

    def toolchain(self, env: Mapping[str, Any]) -> dict[str, Any]:
        """What the DSO depends on in the machine `env` describes (gates/environment.py: probe)."""
        return {}

    def to_json(self) -> dict[str, Any]:
        return {"function": self.function, "capabilities": list(self.capabilities)}


@dataclass(frozen=True)
class CudaSource(KernelBlock):
    """A C++/CUDA source built with TVM-FFI (kernels/build.py); `cuda` None: CUDA where a GPU
    and nvcc are both present."""
    source: Path
    cuda: bool | None

    def fields(self) -> list[tuple[str, Path]]:
        return [("$.kernel.source", self.source)]

    def export(self, out: Path, where: Callable[[str], str], cwd: Path) -> None:
        build_kernel(self.source, out, cuda=self.cuda)

    def toolchain(self, env: Mapping[str, Any]) -> dict[str, Any]:
        """The target build_kernel chooses here (CPU only, or CUDA and its arch) and its
        compiler's version."""
        archs = [g["arch"] for g in env["gpus"]]
        cuda = self.cuda if self.cuda is not None else env["nvcc"] is not None and bool(archs)
        if not cuda:
            return {"target": "CPU only", "compiler": env["cxx"]}
        arch = os.environ.get("TVM_FFI_CUDA_ARCH_LIST") or (archs[0] if archs else None)
        return {"target": f"CUDA {arch} + CPU", "compiler": env["nvcc"]}

    def to_json(self) -> dict[str, Any]:
        return {**super().to_json(), "source": str(self.source), "cuda": self.cuda}


@dataclass(frozen=True)
class PrebuiltDso(KernelBlock):
    """A DSO built elsewhere, copied as it is."""
    dso: Path

    def fields(self) -> list[tuple[str, Path]]:
        return [("$.kernel.dso", self.dso)]

    def export(self, out: Path, where: Callable[[str], str], cwd: Path) -> None:
        shutil.copyfile(self.dso, out)
        check_dso(out, f"{where('dso')}: {shown(self.dso)} is not a shared library")

    def to_json(self) -> dict[str, Any]:
        return {**super().to_json(), "dso": str(self.dso)}


@dataclass(frozen=True)
class Exporter(KernelBlock):
    """A command that writes the DSO where its `{output}` argument says, from `sources` (the
    files it reads, which the stages watch and the receipt pins)."""
    command: tuple[str, ...]
    sources: tuple[Path, ...]

    def fields(self) -> list[tuple[str, Path]]:
        return [(f"$.kernel.sources[{i}]", s) for i, s in enumerate(self.sources)]

    def export(self, out: Path, where: Callable[[str], str], cwd: Path) -> None:
        out.unlink(missing_ok=True)
        cmd = [arg.replace("{output}", str(out)) for arg in self.command]
        said = f"{where('exporter')}: {shown(' '.join(self.command))}"
        try:
            done = run_limited(cmd, build.EXPORT_TIMEOUT_S, cwd=cwd)
        except OSError as e:  # not found, not executable, no #! line (ENOEXEC)
            raise UserError(f"{said}: cannot be run: {e.strerror or e}") from None
        if done is None:
            raise UserError(f"{said}: still running after {build.EXPORT_TIMEOUT_S} s (the limit, "
                            f"pipeline.kernels.build.EXPORT_TIMEOUT_S); it and its child "
                            f"processes were killed")
        rc = done.returncode
        if rc != 0:
            raise UserError(f"{said} " + (f"was killed by signal {-rc}" if rc < 0
                                          else f"exited with status {rc}"))
        if not out.is_file() or out.is_symlink():
            raise UserError(f"{said} wrote no DSO (expected a regular file at {{output}})")
        check_dso(out, f"{said} wrote no shared library")

    def toolchain(self, env: Mapping[str, Any]) -> dict[str, Any]:
        """An exporter's toolchain is its own: the GPUs and CUDA it may compile for stand in."""
        return {"gpu_archs": [g["arch"] for g in env["gpus"]], "cuda": env["cuda"],
                "torch": env["torch"]}

    def to_json(self) -> dict[str, Any]:
        return {**super().to_json(), "exporter": list(self.command),
                "sources": [str(s) for s in self.sources]}


def check_dso(path: Path, refusal: str) -> None:
    """The file is a shared library, or one line (`refusal`, and why): an exporter that wrote
    anything else is stopped here, not at bind."""
    data = read_regular(path, MAX_LIBRARY_BYTES, "pipeline.kernels.bind.MAX_LIBRARY_BYTES")
    problem = elf_problem(data)
    if problem is not None:
        raise UserError(f"{refusal} ({problem})")


def named_files(raw: Mapping[str, Any]) -> list[str]:
    """The file names a kernel block gives as written (a spec's, or a receipt's copy of it)."""
    return [raw["source"]] if "source" in raw else [raw["dso"]] if "dso" in raw else \
        list(raw["sources"])


def resolve(raw: Mapping[str, Any], existing: Callable[[str, str], Path],
            capabilities: tuple[str, ...], spec: Path) -> KernelBlock:
    """The typed block of the schema-valid `kernel` of the spec at `spec`, each file found by
    `existing(name, json_path)`; an exporter command must say where its DSO goes (`{output}`)."""
    common = {"function": raw.get("function", DEFAULT_FUNCTION), "capabilities": capabilities}
    if "source" in raw:
        return CudaSource(**common, source=existing(raw["source"], "$.kernel.source"),
                          cuda=raw.get("cuda"))
    if "dso" in raw:
        return PrebuiltDso(**common, dso=existing(raw["dso"], "$.kernel.dso"))
    if not any("{output}" in arg for arg in raw["exporter"]):
        raise UserError(f"{spec}: $.kernel.exporter: no argument contains '{{output}}' (the "
                        f"command must be told where to write the DSO)")
    return Exporter(**common, command=tuple(raw["exporter"]),
                    sources=tuple(existing(s, f"$.kernel.sources[{i}]")
                                  for i, s in enumerate(raw["sources"])))
