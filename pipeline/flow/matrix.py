"""`trtmc matrix`: the pipeline of many specs, one task per spec, on a Ray cluster or here, one
after another; each spec's outputs brought back into one folder, with a combined JUnit XML and a
Markdown summary. See docs/matrix.md.

Ray is imported only when a cluster is asked for (`pipeline.flow.matrix.run_matrix(...,
ray_address=...)`); without it the specs run here, one after another. Either way a spec's
pipeline runs in a child process (`trtmc pipeline SPEC`), so its stages fork from it as from any
doit run, and a spec that kills its process is reported alike here and on a cluster.
"""
from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence


import pipeline
from pipeline import jsonio
from pipeline.errors import UserError
from pipeline.files import atomic_write_bytes, shown
from pipeline.flow.spec import ROOT_ENV, default_root, load_spec
from pipeline.flow.stages import BY_NAME
from pipeline.flow.tasks import MATRIX_WORKER, load_pipeline_specs
from pipeline.gates.environment import resolve_device
from pipeline.gates.ledger import FILE as LEDGER
from pipeline.gates.report_types import SCHEMA as REPORT_SCHEMA
from pipeline.gates.report_types import GateReport

if TYPE_CHECKING:
    from pipeline.flow.spec import Spec

MiB = 1 << 20
MAX_SHIPPED_BYTES = 64 * MiB    # one spec's inputs sent to the cluster (the code is ~1 MiB more)
MAX_RETURNED_BYTES = 64 * MiB   # one spec's outputs brought back
LOG_TAIL_BYTES = 1 * MiB        # the end of a spec's pipeline log kept in DIR/NAME/pipeline.log
GPU_MODEL_RESOURCE = "accelerator_type:{}"  # Ray's own label of a node's GPU model
GPU_MODEL_SHARE = 0.001         # asks for the label without using it up
STAGED = "specs"                # inside the shipped working folder: specs/NAME/<inputs>
LOG = "pipeline.log"
SUMMARY, JUNIT = "summary.md", "junit.xml"
MARKER = ".trtmc-matrix"  # in each DIR/NAME the matrix wrote: only such a folder is replaced
STATUSES = ("passed", "failed", "error", "crashed")


@dataclass
class Entry:
    """One spec of the matrix: where it came from, what it needs, and (once run) its outcome."""
    given: str
    name: str
    spec: Spec | None = None     # None when it did not load
    gpu: bool = False
    gpu_model: str | None = None
    status: str | None = None    # one of STATUSES
    message: str = ""
    seconds: float = 0.0
    verdicts: dict = field(default_factory=dict)   # gate -> verdict, from the reports brought back
    files: dict = field(default_factory=dict)      # relative path -> bytes
    log: bytes = b""

    @property
    def loaded(self) -> Spec:
        """The spec of an entry that loaded: every entry a runner is given."""
        assert self.spec is not None, f"{self.given} did not load"
        return self.spec

    def resources(self) -> dict:
        """The Ray task options of this spec."""
        res: dict[str, Any] = {"num_cpus": 1, "num_gpus": 1 if self.gpu else 0}
        if self.gpu_model:
            res["resources"] = {GPU_MODEL_RESOURCE.format(self.gpu_model): GPU_MODEL_SHARE}
        return res

    def where(self) -> str:
        r = self.resources()
        extra = "".join(f", {k}" for k in r.get("resources", {}))
        return f"gpu{extra}" if r["num_gpus"] else "cpu"


# -- planning -----------------------------------------------------------------------------------
def parse_gpu_models(values: list[str]) -> dict[str | None, str]:
    """`--gpu-model MODEL` (every GPU spec) or `--gpu-model NAME=MODEL` (one spec) -> {name or
    None: model}."""
    out: dict[str | None, str] = {}
    for v in values:
        name, _, model = v.rpartition("=")
        if not model or not all(c.isalnum() or c in "-_." for c in model):
            raise UserError(f"--gpu-model {v!r}: expected MODEL or NAME=MODEL, MODEL as Ray names "
                            f"a GPU (e.g. H200, A100)")
        out[name or None] = model
    return out


def gate_device(spec) -> str:
    """The spec's gates.device (cpu, cuda or auto)."""
    gates = spec.gates
    return gates["device"] if isinstance(gates, dict) else gates.device


def _wants_gpu(device: str, gpus_here: bool) -> bool:
    """gates.device cuda always; auto where the cluster (or this machine) has a GPU."""
    return device == "cuda" or (device == "auto" and gpus_here)


def plan(paths: list[str], gpus_here: bool, gpu_models: dict[str | None, str],
         local: bool) -> list[Entry]:
    """Every spec loaded and checked here; a spec that does not load is an `error` entry with its
    one line, and the others go on. Names must differ (each has its folder DIR/NAME)."""
    entries: list[Entry] = []
    seen: dict[str, str] = {}
    for given in paths:
        try:
            spec = load_pipeline_specs([given])[0] if local else load_spec(given)
        except UserError as e:
            entries.append(Entry(given, Path(given).stem, status="error", message=str(e)))
            continue
        if spec.name in seen:
            entries.append(Entry(given, spec.name, status="error", message=(
                f"{spec.path}: name '{spec.name}' is also the name of {seen[spec.name]} (each spec "
                f"of a matrix needs its own name)")))
            continue
        seen[spec.name] = str(spec.path)
        gpu = _wants_gpu(gate_device(spec), gpus_here)
        model = gpu_models.get(spec.name, gpu_models.get(None)) if gpu else None
        entries.append(Entry(given, spec.name, spec=spec, gpu=gpu, gpu_model=model))
    unknown = {name for name in gpu_models if name is not None} - set(seen)
    if unknown:
        raise UserError(f"--gpu-model {sorted(unknown)[0]}=...: no spec of the matrix has that name")
    return entries


# -- what is shipped ----------------------------------------------------------------------------
def spec_inputs(spec) -> list[Path]:
    """The files a spec's stages read from outside its output folder: the spec, its kernel's
    files (sources, local headers, DSO, exporter sources) and a model given as a folder."""
    files = [spec.path, *BY_NAME["export_dso"].inputs(spec)]
    if isinstance(spec.raw["model"], str):
        files += sorted(p for p in spec.model_dir.rglob("*") if p.is_file())
    return [Path(os.path.realpath(p)) for p in files]


def stage_spec(entry: Entry, into: Path) -> str:
    """Copy the spec's inputs under `into/specs/NAME`, keeping their places relative to each
    other (so the spec's relative paths hold); -> the staged spec's path, relative to `into`."""
    spec = entry.loaded
    files = list(dict.fromkeys(spec_inputs(spec)))
    anchors = [*files, *([spec.paths.out] if "output" in spec.raw else [])]
    anchor = Path(os.path.commonpath([str(p) for p in anchors]))
    if anchor in files:  # a single file
        anchor = anchor.parent
    size = sum(p.stat().st_size for p in files)
    if size > MAX_SHIPPED_BYTES:
        raise UserError(f"{spec.path}: its inputs are {size / MiB:.1f} MiB (more than the "
                        f"{MAX_SHIPPED_BYTES // MiB} MiB a spec may ship, pipeline.flow.matrix."
                        f"MAX_SHIPPED_BYTES); give the model as a package, hub id or synth recipe")
    base = into / STAGED / entry.name
    for p in files:
        target = base / p.relative_to(anchor)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(p, target)
    return str((base / spec.path.relative_to(anchor)).relative_to(into))


def stage_code(into: Path) -> None:
    """The `pipeline` package with its schemas inside (as a wheel carries them), and a run id so
    that the cluster unpacks a fresh copy for every matrix run."""
    src = Path(pipeline.__file__).resolve().parent
    shutil.copytree(src, into / "pipeline", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    schemas = into / "pipeline" / "schemas"
    schemas.mkdir(exist_ok=True)
    for s in jsonio.SCHEMA_DIR.glob("*.schema.json"):
        shutil.copyfile(s, schemas / s.name)
    (into / ".trtmc-run").write_text(uuid.uuid4().hex + "\n")


# -- what comes back ----------------------------------------------------------------------------
def collect(out: Path) -> dict[str, bytes]:
    """The outputs a matrix brings back from a spec's output folder: the reports (JSON, Markdown,
    JUnit XML, plot, pins), the promotion receipt and the ledger."""
    files = [out / "promotion.json", out / LEDGER]
    if (out / "reports").is_dir():
        files += sorted(p for p in (out / "reports").iterdir())
    got, size = {}, 0
    for p in files:
        if p.is_file() and not p.is_symlink():
            size += p.stat().st_size
            if size > MAX_RETURNED_BYTES:
                break
            got[str(p.relative_to(out))] = p.read_bytes()
    return got


def _tail(data: bytes) -> bytes:
    return data[-LOG_TAIL_BYTES:]


def _one_line(log: bytes, *needles: str) -> str:
    """The last log line holding one of `needles`, as the spec's one line."""
    lines = [line.strip() for line in log.decode(errors="replace").splitlines() if line.strip()]
    for line in reversed(lines):
        if any(n in line for n in needles):
            return line
    return lines[-1] if lines else "no output"


def outcome(rc: int, files: dict[str, bytes], log: bytes) -> tuple[str, str, dict]:
    """(status, one line, verdicts) of a pipeline process that ended with status `rc` (negative:
    killed by that signal)."""
    if rc < 0:
        return "crashed", (f"the pipeline process was killed by signal {-rc} "
                           f"({signal.Signals(-rc).name}) mid-run"), {}
    verdicts, failed = {}, []
    for gate in ("correctness", "perf"):
        data = files.get(f"reports/{gate}.json")
        if data is None:
            continue
        try:  # as strictly as any report file is read
            report = GateReport.from_json(jsonio.parse_json(data, REPORT_SCHEMA, f"reports/{gate}.json"))
        except (UserError, ValueError):
            verdicts[gate] = "unreadable"
            continue
        verdicts[gate] = str(report.verdict)
        if not report.passed:
            failed.append(f"{gate} gate {report.verdict}: {report.message}")
    if rc == 0:
        return "passed", "promoted" if "promotion.json" in files else "done", verdicts
    if rc == 1 and failed:
        return "failed", failed[0], verdicts
    if rc == 1:
        return "failed", _one_line(log, "TaskFailed", "error:"), verdicts
    return "error", _one_line(log, "error:", "ERROR"), verdicts


# -- running one spec ---------------------------------------------------------------------------
def run_pipeline_process(spec_path: Path, env: dict | None = None) -> tuple[int, bytes, float]:
    """`trtmc pipeline SPEC` in a child process, here or in a Ray worker (its stages fork from
    that child as they do from any doit run, where a Ray worker, with its threads, cannot fork
    them) -> (exit status, the end of its output, seconds). The `pipeline` package imported is
    the one in the current folder where there is one (a Ray task's working folder holds the
    shipped code), else the installed one."""
    start = time.perf_counter()
    with tempfile.TemporaryFile() as log:
        rc = subprocess.call([sys.executable, "-m", "pipeline.cli", "pipeline", str(spec_path)],
                             stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             env=env)
        log.seek(0)
        return rc, _tail(log.read()), time.perf_counter() - start


def run_in_worker(staged: str, root: str | None = None) -> dict:
    """The Ray task: the staged spec's pipeline in a child of this worker, which dies with it;
    its output and outputs read back. `staged` is relative to the shipped folder, or absolute
    (`--in-place`: the spec where it is, with `root`, the driver's default output root, so the
    shipped code resolves the output folder the driver's would). A worker that dies here
    (killed, out of memory) is reported by Ray to the driver."""
    spec_path = Path.cwd() / staged
    if not spec_path.is_file():  # --in-place on a node that does not share the driver's files
        return {"rc": 2, "files": {}, "seconds": 0.0, "host": os.uname().nodename,
                "log": (f"trtmc: error: {spec_path}: no such file on this node; --in-place needs "
                        f"every spec and its output folder at the same path on each node (one "
                        f"node, or a shared file system)\n").encode()}
    env = {**os.environ, MATRIX_WORKER: str(os.getpid()), **({ROOT_ENV: root} if root else {})}
    rc, log, seconds = run_pipeline_process(spec_path, env)
    try:
        files = collect(load_spec(spec_path, Path(root) if root else None).paths.out)
    except UserError:
        files = {}
    return {"rc": rc, "files": files, "log": log, "seconds": seconds,
            "host": os.uname().nodename}


def run_here(entry: Entry) -> None:
    """The spec's pipeline here, in a child process, its outputs read from the spec's output
    folder."""
    rc, entry.log, entry.seconds = run_pipeline_process(entry.loaded.path)
    entry.files = collect(entry.loaded.paths.out)
    entry.status, entry.message, entry.verdicts = outcome(rc, entry.files, entry.log)


def _import_ray():
    try:
        import ray
    except ImportError:
        raise UserError("--ray: Ray is not installed (install the extra: pip install "
                        "'trtmc[ray]')") from None
    return ray


def run_on_ray(entries: list[Entry], address: str, init: dict, stage_dir: Path,
               in_place: bool = False) -> None:
    """One Ray task per runnable entry, with the resources it needs; every task awaited, a crashed
    worker or a task that raised reported as that entry's `crashed` status. `in_place`: each
    spec runs where it is, on its own output folder and doit database, not on shipped copies."""
    ray = _import_ray()
    runnable = [e for e in entries if e.status is None]
    staged = {}
    for e in runnable:
        try:
            staged[e.name] = (str(e.loaded.path), str(default_root(e.loaded.path))) if in_place \
                else (stage_spec(e, stage_dir),)
        except (UserError, OSError) as err:
            e.status, e.message = "error", str(err)
    runnable = [e for e in runnable if e.status is None]
    stage_code(stage_dir)
    kwargs = {"runtime_env": {"working_dir": str(stage_dir),
                              "env_vars": {"TRTMC_PROGRESS": "0"}},
              "include_dashboard": False, "log_to_driver": False, "logging_level": logging.WARNING}
    if address != "local":
        kwargs["address"] = address
        if init:
            raise UserError("--ray-init: only for --ray local (a private cluster started here)")
    else:
        kwargs.update(init)
    try:
        ray.init(**kwargs)
    except (ConnectionError, ValueError, RuntimeError) as err:
        raise UserError(f"--ray {address}: cannot start or join the cluster ({err})") from None
    try:
        task = ray.remote(max_calls=1, max_retries=0)(run_in_worker)
        refs = {}
        for e in runnable:
            if e.gpu and gate_device(e.loaded) == "auto" and not _cluster_gpus(ray):
                e.gpu, e.gpu_model = False, None  # auto on a cluster without GPUs: a CPU spec
            refs[e.name] = (task.options(**e.resources()).remote(*staged[e.name]),
                            time.perf_counter())
        for e in runnable:
            ref, start = refs[e.name]
            try:
                result = ray.get(ref)
            except ray.exceptions.WorkerCrashedError as err:
                e.status, e.seconds = "crashed", time.perf_counter() - start
                e.message = f"the Ray worker died mid-run ({_first_line(err)})"
                continue
            except ray.exceptions.RayError as err:  # RayTaskError and the like
                e.status, e.seconds = "crashed", time.perf_counter() - start
                e.message = f"the Ray task failed: {type(err).__name__}: {_first_line(err)}"
                continue
            e.files, e.log, e.seconds = result["files"], result["log"], result["seconds"]
            e.status, e.message, e.verdicts = outcome(result["rc"], e.files, e.log)
            e.message += f" (on {result['host']})" if e.status != "passed" else ""
    finally:
        ray.shutdown()


def _cluster_gpus(ray) -> bool:
    return ray.cluster_resources().get("GPU", 0) > 0


def _first_line(err) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


# -- the folder of results ----------------------------------------------------------------------
def check_folders(entries: list[Entry], out: Path) -> None:
    """Before anything runs: no spec's folder DIR/NAME is one of the combined files, or a folder
    (or file) the matrix did not write, which writing the results would replace."""
    for e in entries:
        folder = out / e.name
        if e.name in (SUMMARY, JUNIT):
            raise UserError(f"{e.given}: name '{e.name}' is the name of the matrix's combined "
                            f"{e.name} in {shown(out)}; give the spec another name")
        if (folder.exists() or folder.is_symlink()) and not (
                folder.is_dir() and not folder.is_symlink() and (folder / MARKER).is_file()):
            raise UserError(f"{shown(folder)}: exists and is not a folder trtmc matrix wrote (no "
                            f"{MARKER} in it); the results of spec '{e.name}' would replace it: "
                            f"move it, or write the matrix elsewhere (-o)")


def write_results(entries: list[Entry], out: Path) -> None:
    """DIR/NAME/ per spec (its outputs, pipeline.log and the matrix's marker), DIR/junit.xml,
    DIR/summary.md; a spec's earlier folder (check_folders) replaced."""
    for e in entries:
        folder = out / e.name
        if folder.is_dir() and not folder.is_symlink():
            shutil.rmtree(folder)
        for rel, data in e.files.items():
            atomic_write_bytes(folder / rel, data)
        if e.log or e.spec is not None:
            atomic_write_bytes(folder / LOG, e.log)
        if folder.is_dir():
            atomic_write_bytes(folder / MARKER, b"")
    atomic_write_bytes(out / JUNIT, junit(entries))
    atomic_write_bytes(out / SUMMARY, summary(entries).encode())


def junit(entries: list[Entry]) -> bytes:
    """Every gate's JUnit testsuite, and for a spec that ended without its gates' verdicts (an
    error, a crash, a stage that failed) a testsuite `trtmc.NAME.pipeline` with the reason."""
    root = ET.Element("testsuites", name="trtmc matrix")
    for e in entries:
        suites = []
        for gate in ("correctness", "perf"):
            data = e.files.get(f"reports/{gate}.xml")
            if data is not None:
                try:
                    suites.append(ET.fromstring(data))
                except ET.ParseError:
                    pass
        root.extend(suites)
        gates_failed = any(s.get("failures", "0") != "0" for s in suites)
        if e.status != "passed" and not gates_failed:
            suite = ET.SubElement(root, "testsuite", name=f"trtmc.{e.name}.pipeline", tests="1",
                                  failures="0", errors="1", time=f"{e.seconds:.3f}")
            case = ET.SubElement(suite, "testcase", classname=f"trtmc.{e.name}", name="pipeline",
                                 time=f"{e.seconds:.3f}")
            ET.SubElement(case, "error", message=e.message, type=str(e.status)).text = e.message
    totals = {k: sum(int(s.get(k, "0")) for s in root) for k in ("tests", "failures", "errors")}
    root.attrib.update({k: str(v) for k, v in totals.items()})
    return ET.tostring(root, encoding="utf-8", xml_declaration=True)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def summary(entries: list[Entry]) -> str:
    counts = {s: sum(1 for e in entries if e.status == s) for s in STATUSES}
    lines = ["# trtmc matrix", "",
             ", ".join(f"{n} {s}" for s, n in counts.items() if n) + f" of {len(entries)} specs",
             "", "| spec | status | correctness | perf | ran on | time | detail |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for e in entries:
        lines.append("| " + " | ".join(_cell(str(x)) for x in (
            e.name, e.status, e.verdicts.get("correctness", "-"), e.verdicts.get("perf", "-"),
            e.where() if e.spec is not None else "-", f"{e.seconds:.1f} s", e.message)) + " |")
    return "\n".join(lines) + "\n"


# -- the command --------------------------------------------------------------------------------
def run_matrix(paths: list[str], out: str | os.PathLike, *, ray_address: str | None = None,
               ray_init: dict | None = None, gpu_models: Sequence[str] = (),
               in_place: bool = False) -> tuple[int, list[Entry]]:
    """Run every spec's pipeline (on the Ray cluster at `ray_address`, "local" for a private one
    started here with `ray_init` as ray.init's arguments; None: here, one after another), write
    the results under `out`; -> (exit status: 0 every spec promoted, 1 otherwise; the entries).
    `in_place` (Ray only; here every spec runs in place): the tasks run the specs where they are,
    on their own output folders and doit databases, so what a CPU job built there is reused and
    only the stages that depend on the machine run (one node, or nodes sharing the files)."""
    if in_place and ray_address is None:
        raise UserError("--in-place: only with --ray (without it every spec runs in place, here)")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"-o {shown(out)}: exists and is not a folder")
    models = parse_gpu_models(list(gpu_models))
    if ray_address is None:
        entries = plan(paths, resolve_device("auto")[0] == "cuda", models, local=True)
        check_folders(entries, out)
        for e in entries:
            if e.status is None:
                run_here(e)
    else:
        _import_ray()
        # "auto" specs ask for a GPU when the cluster has one (checked again once joined)
        entries = plan(paths, True, models, local=False)
        check_folders(entries, out)
        with tempfile.TemporaryDirectory(prefix="trtmc-matrix-") as stage_dir:
            run_on_ray(entries, ray_address, dict(ray_init or {}), Path(stage_dir), in_place)
    out.mkdir(parents=True, exist_ok=True)
    write_results(entries, out)
    return (0 if all(e.status == "passed" for e in entries) else 1), entries
