"""The package's shape (docs/architecture.md, "The house"): imports only point down the layers, only pipeline/trt/
imports a TensorRT module, commands that only read JSON load none, and only pipeline/families/ tells an encoder
from a decoder."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "pipeline"
HOUSE = ROOT / "docs" / "architecture.md"


def _layers() -> list[str]:
    """The page's table, top to bottom: `pipeline/NAME/` or `pipeline/NAME.py` per row."""
    rows = [line.split("`")[1] for line in HOUSE.read_text().splitlines()
            if line.startswith("| `pipeline/")]
    return [row.removeprefix("pipeline/").strip("/").removesuffix(".py") for row in rows]


# top to bottom: a package may import only from packages after it
LAYERS = _layers()
TENSORRT_MODULES = ("tensorrt", "tensorrt_rtx")


def _imports(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names]
    return out


def _layer(path: Path) -> str:
    rel = path.relative_to(PACKAGE).with_suffix("")
    return rel.parts[0]


def test_the_page_names_every_package_and_module_once():
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    modules = {p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    own = packages | modules
    assert sorted(LAYERS) == sorted(own) and len(set(LAYERS)) == len(LAYERS), LAYERS


def test_imports_point_down_the_layers():
    upward = []
    for path in PACKAGE.rglob("*.py"):
        own = _layer(path)
        if own == "__init__":
            continue
        for name in _imports(path):
            parts = name.split(".")
            if parts[0] != "pipeline" or len(parts) < 2 or parts[1] == own:
                continue
            if parts[1] in LAYERS and LAYERS.index(parts[1]) < LAYERS.index(own):
                upward.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not upward, "\n".join(upward)


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


def _cycles() -> list[list[str]]:
    """Import cycles among the modules of one folder, imports made inside functions counted
    (a cycle held together by a late import is still a cycle): Tarjan's strongly connected
    components of more than one module."""
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}

    def imported(path: Path) -> set[str]:
        """The package's modules `path` imports: `from P import m` is module P.m where there is
        one (P's own __init__ runs first, but is no dependency of the module's own making)."""
        out = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                out |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in paths
                        else node.module for a in node.names}
            elif isinstance(node, ast.Import):
                out |= {a.name for a in node.names}
        return {m for m in out if m in paths}
    edges = {name: {t for t in imported(path) - {name} if paths[t].parent == path.parent}
             for name, path in paths.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_folder_has_an_import_cycle():
    assert _cycles() == []


def test_only_the_trt_folder_imports_tensorrt():
    offenders = [f"{p.relative_to(ROOT)}: {name}" for p in PACKAGE.rglob("*.py")
                 if _layer(p) != "trt"
                 for name in _imports(p) if name.split(".")[0] in TENSORRT_MODULES]
    sources = [p for p in PACKAGE.rglob("*.py") if _layer(p) != "trt"
               and any(f'import_module("{m}' in p.read_text() for m in TENSORRT_MODULES)]
    assert not offenders and not sources, offenders + [str(p) for p in sources]


KIND_NAMES = ("encoder", "decoder")


def _kind_comparisons(source: str, where: str) -> list[str]:
    """Where `source` compares a value with a kind's name: an `==`, `!=`, `is` or `in` with the
    string "encoder" or "decoder" on either side (alone, or in a tuple, list or set), or a match
    case on one."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
        elif isinstance(node, ast.MatchValue):
            operands = [node.value]
        else:
            continue
        for operand in operands:
            items = operand.elts if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else [operand]
            if any(isinstance(i, ast.Constant) and isinstance(i.value, str) and i.value in KIND_NAMES
                   for i in items):
                found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
                break
    return found


def test_only_the_families_tell_an_encoder_from_a_decoder():
    """A decision that differs by kind is the kind's workload's (families/workloads.py; a report's
    `kind` finds it through `of_kind`): no module outside pipeline/families/ compares with a
    kind's name."""
    found = [hit for p in PACKAGE.rglob("*.py") if _layer(p) != "families"
             for hit in _kind_comparisons(p.read_text(), str(p.relative_to(ROOT)))]
    assert not found, "\n".join(found)


def test_the_kind_scan_finds_each_form_of_comparison():
    source = ("if kind == 'encoder': pass\nif 'decoder' != report['kind']: pass\n"
              "if kind in ('decoder', 'x'): pass\nif kind is 'encoder': pass\n"
              "match kind:\n    case 'decoder': pass\n"
              "if kind == 'encoders' or ask('encoder') or {'encoder': 1}: pass\n")
    assert [hit.split(":")[1] for hit in _kind_comparisons(source, "m.py")] == \
        ["1", "2", "3", "4", "6"]


@pytest.fixture(scope="module")
def receipt(tmp_path_factory, tiny_qwen3):
    from pipeline.families.capture import capture_role
    from pipeline.graph import select, snapshot
    out = tmp_path_factory.mktemp("json_only")
    cap = capture_role(str(tiny_qwen3), None, "decode", {"max_cache_length": 32})
    snapshot.save(cap.snapshot, out / "g.json")
    r = select.from_recipe(cap.snapshot, "qwen.decode_logits_copy@1", "decoder.logits_zero_bias")
    select.save_receipt(r, out / "sel.json")
    (out / "k.so").write_bytes(b"")
    return out


@pytest.mark.parametrize("argv", [
    ["graph", "list", "{d}/g.json"],
    ["graph", "recipes", "{d}/g.json"],
    ["graph", "select", "{d}/g.json", "--nodes", "node:1", "--binding-id", "x@1",
     "--workspace-bytes", "0", "-o", "{d}/s.json"],
    ["bind", "manifest", "{d}/sel.json", "--library", "{d}/k.so", "-o", "{d}/m.json"],
])
@pytest.mark.slow
def test_json_only_commands_load_no_tensorrt(receipt, argv):
    argv = [a.format(d=receipt) for a in argv]
    code = ("import sys\nfrom pipeline.cli import main\nrc = main(sys.argv[1:])\n"
            f"loaded = [m for m in {TENSORRT_MODULES!r} if m in sys.modules]\n"
            "print('LOADED', loaded)\nsys.exit(0 if not loaded else 99)")
    proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert "LOADED []" in proc.stdout, proc.stdout + proc.stderr


def test_importing_the_tensorrt_seam_initialises_no_cuda_driver():
    """The capability probe (cuInit) runs when a capability is first asked for, not at import."""
    code = ("import sys; import pipeline.trt as t; "
            "print('cuda.bindings.driver' in sys.modules); t.capabilities(); "
            "print(t.capabilities() is t.capabilities())")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["False", "True"]
