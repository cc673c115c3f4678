"""The package's shape (docs/architecture.md, "The house"): imports only point down the layers, only pipeline/trt/
imports a TensorRT module, commands that only read JSON load none, only the packages heavy to import (LAZY_PACKAGES)
are imported inside functions and `trtmc` loads none of them at startup, and only pipeline/families/ tells an encoder
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
# The third-party packages heavy to import: each is imported only inside the functions that use it,
# and so is a pipeline module that imports one at its top (a heavy module); every other import is
# at the top of its module. An entry is a package or one of its modules. The times: importing it
# after what `trtmc --help` loads, 2 CPU cores.
LAZY_PACKAGES = (
    *TENSORRT_MODULES,  # 30-60 ms and the TensorRT library: commands that only read JSON load none
    "torch",  # 1.2-1.5 s
    "tvm_ffi",  # 1.3 s: it imports torch
    "safetensors.torch",  # 1 s: it imports torch (safetensors itself: 1 ms)
    "transformers",  # 0.7 s
    "huggingface_hub",  # 0.5 s for snapshot_download (the package defers its own modules)
    "ray",  # 0.4-0.6 s, and an optional extra
    "matplotlib",  # 0.3-0.4 s
    "triton",  # 70-150 ms
    "numpy",  # 60-90 ms
    "cryptography",  # 10 ms (OpenSSL's bindings) every `trtmc` would pay: cli/gates.py imports gates/signing.py
    "doit",  # 8 ms every `trtmc` would pay: cli/pipeline.py imports flow/tasks.py
    "tokenizers",  # 5 ms every `trtmc` would pay: cli/model.py imports models/synth.py
)  # not heavy, so imported at the top: shtab (1 ms), orjson, jsonschema, safetensors itself


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


def _targets(node: ast.Import | ast.ImportFrom, modules) -> list[str]:
    """The modules an import statement names: `from P import m` is module P.m where the package
    has one (P's own __init__ runs first, but is no dependency of the statement's own making)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    return [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
            for a in node.names if node.module]


def _cycles() -> list[list[str]]:
    """Import cycles among the modules of one folder, imports made inside functions counted
    (a cycle held together by a late import is still a cycle): Tarjan's strongly connected
    components of more than one module."""
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}

    def imported(path: Path) -> set[str]:
        """The package's modules `path` imports."""
        return {m for node in ast.walk(ast.parse(path.read_text()))
                if isinstance(node, (ast.Import, ast.ImportFrom)) for m in _targets(node, paths)
                if m in paths}
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


def _lazy(module: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in LAZY_PACKAGES)


def _import_statements(tree: ast.Module) -> list[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement that runs, with whether it is inside a function (`if TYPE_CHECKING:`
    blocks never run)."""
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and ast.unparse(child.test) in ("TYPE_CHECKING",
                                                                          "typing.TYPE_CHECKING"):
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append((child, in_function))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                           ast.Lambda)))
    visit(tree, False)
    return found


class Imports:
    """The import statements of a package's modules (name -> (shown path, source)), and what
    importing a module loads through module-level imports alone: the modules it imports at its
    top, theirs, and every package __init__ on the way."""

    def __init__(self, sources: dict[str, tuple[str, str]]):
        self.shown = {name: shown for name, (shown, _) in sources.items()}
        self.statements = {name: _import_statements(ast.parse(source))
                           for name, (_, source) in sources.items()}
        self._loads: dict[str, dict[str, str]] = {}

    def loads(self, module: str) -> dict[str, str]:
        """Each module importing `module` loads -> the module whose top imports it."""
        if module not in self._loads:
            self._loads[module] = {}  # no cycles in the house; this ends one if there were
            parts = module.split(".")
            found: dict[str, str] = {}
            for i in range(1, len(parts) + 1):  # the packages' __init__ run first
                name = ".".join(parts[:i])
                found.setdefault(name, ".".join(parts[:i - 1]) or module)
                for node, in_function in self.statements.get(name, []):
                    for target in _targets(node, self.statements) if not in_function else []:
                        found.setdefault(target, name)
                        if target in self.statements:
                            for m, by in self.loads(target).items():
                                found.setdefault(m, by)
            self._loads[module] = found
        return self._loads[module]

    def heavy(self, module: str) -> bool:
        """Importing `module` loads a lazy package."""
        return any(_lazy(m) for m in self.loads(module))

    def misplaced(self) -> list[str]:
        """Imports inside functions of modules neither lazy nor heavy."""
        return [f"{self.shown[name]}:{node.lineno} imports {target} inside a function, but "
                f"{target} is light (move it to the top)"
                for name, statements in self.statements.items()
                for node, in_function in statements if in_function
                for target in _targets(node, self.statements)
                if not _lazy(target) and not (target in self.statements and self.heavy(target))]

    def chain(self, module: str, target: str) -> list[str]:
        """`module`, ..., `target`: who imports whom on the way."""
        loads, out = self.loads(module), [target]
        while out[-1] != module and loads.get(out[-1], out[-1]) not in out:
            out.append(loads[out[-1]])
        return out[::-1]


def _package_imports() -> Imports:
    return Imports({_module_name(p): (str(p.relative_to(ROOT)), p.read_text())
                    for p in PACKAGE.rglob("*.py")})


def _cli_startup() -> list[str]:
    """What `trtmc` imports before it parses its arguments: its entry points and every module of
    COMMAND_MODULES (its parser imports them all, even for --help)."""
    tree = ast.parse((PACKAGE / "cli" / "__init__.py").read_text())
    commands = next(ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                    and any(getattr(t, "id", None) == "COMMAND_MODULES" for t in node.targets))
    return ["pipeline.cli", "pipeline.cli.__main__", *commands]


def test_imports_inside_functions_are_of_heavy_modules_only():
    """A function imports only what is heavy to import (a LAZY_PACKAGES entry, or a pipeline
    module whose top-level imports load one): anything else is imported at the module's top."""
    misplaced = _package_imports().misplaced()
    assert not misplaced, "\n".join(misplaced)


def test_trtmc_loads_no_lazy_package_at_startup():
    imports = _package_imports()
    loaded = [" -> ".join(imports.chain(entry, m)) for entry in _cli_startup()
              for m in imports.loads(entry) if _lazy(m)]
    assert not loaded, "\n".join(sorted(set(loaded)))


def test_the_import_scan_tells_heavy_from_light():
    sources = {
        "p": ("p/__init__.py", ""),
        "p.heavy": ("p/heavy.py", "import torch.nn\n"),
        "p.via": ("p/via.py", "from p import heavy\n"),
        "p.sub": ("p/sub/__init__.py", "import numpy as np\n"),
        "p.sub.leaf": ("p/sub/leaf.py", "import json\n"),
        "p.light": ("p/light.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n"),
        "p.user": ("p/user.py", "def f():\n    import torch\n    from p import via, light\n"
                                "    from p.sub import leaf\n    import os\n"
                                "    from safetensors.torch import save_file\n"
                                "class C:\n    def g(self):\n        from p.light import x\n"),
    }
    imports = Imports(sources)
    assert [m for m in sources if imports.heavy(m)] == ["p.heavy", "p.via", "p.sub", "p.sub.leaf"]
    assert [line.split(" inside")[0] for line in imports.misplaced()] == \
        ["p/user.py:3 imports p.light", "p/user.py:5 imports os", "p/user.py:9 imports p.light"]
    assert imports.chain("p.via", "torch.nn") == ["p.via", "p.heavy", "torch.nn"]


@pytest.mark.slow
def test_trtmc_help_imports_no_lazy_package():
    """What the scan cannot see (a module imported by name) checked where it runs: the parser
    `trtmc --help` builds imports no lazy package."""
    code = ("import sys\nimport pipeline.cli\npipeline.cli.parser()\n"
            f"print(sorted(p for p in {LAZY_PACKAGES!r} if any(m == p or m.startswith(p + '.') "
            f"for m in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]", out


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
