"""Pipeline specs: the declarative input of the doit pipeline, loaded, checked and resolved.

Relative paths in a spec are relative to the spec file's folder; the output folder defaults to
`artifacts/pipelines/NAME` under the project root. Every mistake is a UserError naming the spec
file and the JSON path of the field.
"""
from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path

from pipeline import jsonio
from pipeline.errors import UserError
from pipeline.files import cached_sha256, file_problem, shown, user_os_errors
from pipeline.gates.promotion import report_pins
from pipeline.gates.settings import GateSettings
from pipeline.gates.signing import envelope_path
from pipeline.graph.selection_block import SelectionBlock, selection_block
from pipeline.kernels.block import KernelBlock, resolve
from pipeline.kernels.inspect import CAPABILITIES
from pipeline.models import hubcache

SCHEMA = "pipeline_spec"
PROJECT_ROOT = Path(__file__).resolve().parent.parent.parent
ROOT_ENV = "TRTMC_PROJECT_ROOT"
DEFAULT_SPEC = PROJECT_ROOT / "examples" / "pipelines" / "minilm_residual_add.json"
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")  # also the schema's pattern for $.name


@dataclass(frozen=True)
class BundleSettings:
    """A spec's `bundle` block, with its defaults: `plans` (also build TensorRT plans; off, since
    the reference runtime executes bundles here: on where a TensorRT that runs plans is
    installed) and `weights` (embed or reference)."""
    plans: bool = False
    weights: str = "embed"

    @classmethod
    def from_json(cls, block: dict | None) -> BundleSettings:
        return cls(**(block or {}))

    def to_json(self) -> dict:
        return {"plans": self.plans, "weights": self.weights}


@dataclass(frozen=True)
class Paths:
    """Where each stage writes, inside the spec's output folder (one target per stage)."""
    out: Path

    @property
    def model(self) -> Path:  # synthetic checkpoints only
        return self.out / "model"

    @property
    def graph(self) -> Path:
        return self.out / "graph.json"

    @property
    def selection(self) -> Path:
        return self.out / "selection.json"

    @property
    def native_bundle(self) -> Path:
        return self.out / "native.bundle"

    @property
    def slot_bundle(self) -> Path:
        return self.out / "slot.bundle"

    @property
    def kernel_dir(self) -> Path:
        return self.out / "kernel"

    @property
    def dso(self) -> Path:
        return self.kernel_dir / "kernel.so"

    @property
    def built_from(self) -> Path:
        """The digests of the sources the DSO was built from, as export_dso read them."""
        return self.kernel_dir / "built-from.json"

    @property
    def bindings(self) -> Path:
        return self.kernel_dir / "bindings.json"

    @property
    def reports(self) -> Path:
        return self.out / "reports"

    @property
    def promotion(self) -> Path:
        return self.out / "promotion.json"

    @property
    def promotion_files(self) -> list[Path]:
        """The receipt, its signature (gate sign) and its pin: what a new verdict removes."""
        return [self.promotion, envelope_path(self.promotion), report_pins(self.out, "promotion")]


@dataclass(frozen=True)
class Spec:
    path: Path
    raw: dict
    name: str
    model_dir: Path
    synth: dict | None       # {"config", "overrides", "seed"} when the inspect stage materialises it
    revision: str | None
    build: dict
    engine_role: str | None
    bundle: BundleSettings
    selection: SelectionBlock  # one type per form (graph/selection_block.py)
    kernel: KernelBlock      # the block's form, its files resolved, "function" filled in
    gates: GateSettings      # defaults filled in
    paths: Paths

    def where(self, *json_path) -> str:
        return f"{self.path}: {jsonio.json_path(json_path)}"


def default_root(spec_path: Path) -> Path:
    """Where a spec without $.output writes artifacts/pipelines/NAME: $TRTMC_PROJECT_ROOT when
    set (a matrix task run in place gets the driver's, since the worker's code is a shipped copy
    whose own root is elsewhere), else the project root of a source checkout, else the spec
    file's folder (never inside the Python installation)."""
    if os.environ.get(ROOT_ENV):
        root = Path(os.environ[ROOT_ENV])
        if not root.is_absolute():
            raise UserError(f"{ROOT_ENV}={root}: expected an absolute path")
        return root
    installed = PROJECT_ROOT.name in ("site-packages", "dist-packages")
    return spec_path.parent if installed else PROJECT_ROOT


def _real(path) -> Path:
    """`path` resolved; unlike Path.resolve, a symlink loop is left in place for the first use to
    report as ELOOP (a UserError), not a RuntimeError."""
    return Path(os.path.realpath(path))


def _package_dir(spec_path: Path, package: str, sub: str) -> Path:
    found = importlib.util.find_spec(package)
    if found is None or not found.submodule_search_locations:
        raise UserError(f"{spec_path}: $.model.package: '{package}' is not an installed package "
                        f"(install it, or give the model as a path)")
    return Path(list(found.submodule_search_locations)[0]) / sub


def _resolve_model(path: Path, model, revision, out: Path) -> tuple[Path, str | None, dict | None]:
    """-> (model folder, revision, synth recipe or None)."""
    if isinstance(model, str):
        return _real(path.parent / model), revision, None
    if "hub" in model:
        if revision is None:
            raise UserError(f"{path}: $.revision: a hub model ($.model.hub) needs a revision "
                            f"(a commit or a ref of the local Hugging Face cache)")
        try:
            return hubcache.resolve(model["hub"], revision) + (None,)
        except UserError as e:
            raise UserError(f"{path}: $.model.hub: {e}") from None
    if "package" in model:
        return _real(_package_dir(path, model["package"], model["path"])), revision, None
    synth = {"overrides": {}, "seed": 0, "init": "random", **model["synth"]}
    return Paths(out).model, revision, synth


def _existing(spec_path: Path, rel: str, field: str) -> Path:
    p = _real(spec_path.parent / rel)
    problem = file_problem(p)
    if problem is not None:
        raise UserError(f"{spec_path}: {field}: {shown(p)} {problem}")
    return p


def _capabilities(path: Path, kernel: dict) -> list[str]:
    """The capabilities the spec grants the kernel's library, each one inspect.py knows."""
    granted = kernel.get("capabilities", [])
    for i, name in enumerate(granted):
        if name not in CAPABILITIES:
            raise UserError(f"{path}: $.kernel.capabilities[{i}]: no capability {name!r} "
                            f"(expected one of {', '.join(CAPABILITIES)})")
    return sorted(granted)


def _resolve_kernel(path: Path, kernel: dict) -> KernelBlock:
    return resolve(kernel, lambda name, field: _existing(path, name, field),
                   tuple(_capabilities(path, kernel)), path)


def _check_output(path: Path, out: Path, model_dir: Path | None) -> None:
    """The output folder holds only what the stages write: it is not the spec's folder nor above
    it (a synth stage replaces out/model), and apart from a model folder, whose files are the
    model's identity (a graph written there would change it on every run)."""
    if path.parent.is_relative_to(out):
        raise UserError(f"{path}: $.output: {shown(out)} holds the spec file; expected a folder "
                        f"of the stages' outputs alone")
    if model_dir is not None and (out.is_relative_to(model_dir) or model_dir.is_relative_to(out)):
        raise UserError(f"{path}: $.output: {shown(out)} "
                        f"{'lies inside' if out.is_relative_to(model_dir) else 'holds'} the model "
                        f"folder {shown(model_dir)}; expected a folder apart from it")
    if os.path.lexists(out) and not out.is_dir():
        raise UserError(f"{path}: $.output: {shown(out)} exists and is not a folder")


def _check_kernel_inputs(path: Path, kernel: KernelBlock, out: Path) -> None:
    """A kernel's files are inputs: none lies in the output folder, where the stages write (a DSO
    there could be the export stage's own target)."""
    for where, file in kernel.fields():
        if file.is_relative_to(out):
            raise UserError(f"{path}: {where}: {shown(file)} lies in the output folder "
                            f"{shown(out)}, where the stages write; keep the kernel's files apart")


def load_spec(path, root: Path | None = None) -> Spec:
    """Read, validate and resolve a spec; `root` (default: `default_root`) anchors the default
    output folder."""
    path = _real(path)
    raw = jsonio.read_json(path, SCHEMA)
    name = raw.get("name", path.stem)
    if not NAME.fullmatch(name):
        raise UserError(f"{path}: the file stem {name!r} is not a valid task name; set $.name")
    out = _real(path.parent / raw["output"]) if "output" in raw else \
        (root or default_root(path)) / "artifacts" / "pipelines" / name
    model_dir, revision, synth = _resolve_model(path, raw["model"], raw.get("revision"), out)
    _check_output(path, out, None if synth else _real(model_dir))
    kernel = _resolve_kernel(path, raw["kernel"])
    _check_kernel_inputs(path, kernel, out)
    with user_os_errors(model_dir):
        no_config = synth is None and not (model_dir / "config.json").is_file()
    if no_config:
        raise UserError(f"{path}: $.model: {shown(model_dir)} has no config.json (expected a "
                        f"Hugging Face model directory)")
    gates = GateSettings.from_json(raw["gates"])
    if not gates.texts and not gates.prompts:
        raise UserError(f"{path}: $.gates: needs 'texts' (encoders) or 'prompts' (decoders)")
    return Spec(path=path, raw=raw, name=name, model_dir=model_dir, synth=synth,
                revision=revision, build=dict(raw.get("build", {})),
                engine_role=raw.get("engine_role"),
                bundle=BundleSettings.from_json(raw.get("bundle")), selection=selection_block(raw["selection"]),
                kernel=kernel, gates=gates, paths=Paths(out))


def model_identity(spec: Spec) -> dict:
    """What identifies the model: the synth recipe, or the revision plus the name, size and
    content digest of every file of the model folder (hashed once per machine, files.
    cached_sha256), so a cache restored on another machine keeps its graph and bundles."""
    if spec.synth is not None:
        return {"synth": spec.synth}
    files = sorted(p for p in spec.model_dir.iterdir() if p.is_file())
    return {"dir": str(spec.model_dir), "revision": spec.revision,
            "files": [[p.name, p.stat().st_size, digest]
                      for p, digest in zip(files, cached_sha256(files))]}


def load_specs(paths: str) -> list[Spec]:
    """Comma-separated spec paths -> specs with distinct names and output folders; at least
    one (an empty `spec=`, as from an unset variable, would gate nothing and pass)."""
    specs = [load_spec(p.strip()) for p in paths.split(",") if p.strip()]
    if not specs:
        raise UserError(f"spec={paths}: no spec file given (expected spec=PATH[,PATH...])")
    names: dict[str, Path] = {}
    outputs: dict[Path, Path] = {}
    for s in specs:
        if s.name in names:
            raise UserError(f"{s.path}: name '{s.name}' is also the name of {names[s.name]} "
                            f"(task names must be unique)")
        shared = next((o for o in outputs if o.is_relative_to(s.paths.out) or
                       s.paths.out.is_relative_to(o)), None)
        if shared is not None:
            raise UserError(f"{s.path}: $.output: {shown(s.paths.out)} overlaps the output folder "
                            f"{shown(shared)} of {outputs[shared]} (each spec needs its own)")
        names[s.name], outputs[s.paths.out] = s.path, s.path
    return specs
