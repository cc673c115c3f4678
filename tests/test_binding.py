"""Binding manifests: strict loading, one binding per slot, ABI and signature checks, frozen result."""
from __future__ import annotations

import dataclasses
import hashlib
import importlib
import shutil

import orjson
import pytest
import torch

from pipeline.kernels import bind, load_manifest
from pipeline.errors import UserError
from pipeline.graph.abi import abi_of, abi_sha256
from pipeline.jsonio import read_json

SPEC = {"dtype": "FP32", "shape": [2, 8]}
binding = importlib.import_module("pipeline.kernels.bind")  # the module (the package exports bind())


def _slot(binding_id="res", extra_args=(), role="decode"):
    abi = abi_of([SPEC, SPEC], [SPEC], 0, list(extra_args), None)
    return {"binding_id": binding_id, "abi_sha256": abi_sha256(abi), "engine_role": role, "abi": abi}


@pytest.fixture
def folder(tmp_path, byok_kernels):
    """A manifest folder holding copies of the test DSOs."""
    for path in byok_kernels.values():
        shutil.copy(path, tmp_path / path.name)
    return tmp_path


def _manifest(folder, *entries, name="bindings.json"):
    path = folder / name
    path.write_bytes(orjson.dumps({"schema_version": 1, "bindings": list(entries)}))
    return path


def _entry(binding_id="res", library="residual_add.so", function="run", slot=None):
    return {"id": binding_id, "abi_sha256": (slot or _slot(binding_id))["abi_sha256"],
            "library": library, "function": function}


def test_bind_calls_the_kernel_in_abi_order(folder):
    slot = _slot()
    kernels = bind(_manifest(folder, _entry()), [slot])
    k = kernels["res"]
    assert (k.binding_id, k.function, k.signature) == ("res", "run", "checked")
    assert k.library == (folder / "residual_add.so").resolve() and k.abi_sha256 == slot["abi_sha256"]
    a, b, out = torch.randn(2, 8), torch.randn(2, 8), torch.full((2, 8), float("nan"))
    k(a, b, out)
    assert torch.equal(out, a + b)


def test_a_new_library_at_a_path_loaded_before_is_the_one_called(folder):
    """The dynamic loader hands back what it first loaded from a path name; binding loads a
    private copy of the bytes it read, so a kernel rebuilt in place is the kernel that runs, and
    the same bytes from another path are the library already loaded."""
    (folder / "lib").mkdir()
    shutil.copy(folder / "residual_add.so", folder / "lib" / "k.so")
    manifest = _manifest(folder, _entry(library="lib/k.so"))
    first = bind(manifest, [_slot()])["res"]
    shutil.rmtree(folder / "lib")  # a new file (and inode) at the same path
    (folder / "lib").mkdir()
    shutil.copy(folder / "residual_sub.so", folder / "lib" / "k.so")
    second = bind(manifest, [_slot()])["res"]
    a, b = torch.randn(2, 8), torch.randn(2, 8)
    out_first, out_second = torch.empty(2, 8), torch.empty(2, 8)
    first(a, b, out_first), second(a, b, out_second)
    assert torch.equal(out_first, a + b) and torch.equal(out_second, a - b)
    assert first.library == second.library and first.library_sha256 != second.library_sha256
    assert second.library_sha256 == hashlib.sha256((folder / "lib" / "k.so").read_bytes()).hexdigest()
    loaded = len(binding._LOADED)
    again = bind(_manifest(folder, _entry(library="residual_sub.so")), [_slot()])["res"]
    assert again.library_sha256 == second.library_sha256 and len(binding._LOADED) == loaded


def test_a_bound_set_cannot_be_rebound(folder):
    kernels = bind(_manifest(folder, _entry()), [_slot()])
    with pytest.raises(TypeError):
        kernels["res"] = kernels["res"]
    with pytest.raises(TypeError):
        del kernels["res"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        kernels["res"].library = folder / "residual_sub.so"
    with pytest.raises(TypeError):
        kernels["res"].abi["workspace_bytes"] = 1
    assert isinstance(kernels["res"].abi["inputs"], tuple)


def test_missing_metadata_is_unknown_and_noted(folder, caplog):
    with caplog.at_level("INFO", logger="trtmc"):
        kernels = bind(_manifest(folder, _entry(library="residual_add_no_metadata.so")), [_slot()])
    assert kernels["res"].signature == "unknown"
    assert "no signature metadata" in caplog.text


def test_library_may_live_in_a_subfolder(folder):
    (folder / "lib").mkdir()
    shutil.copy(folder / "residual_add.so", folder / "lib" / "k.so")
    kernels = bind(_manifest(folder, _entry(library="lib/../lib/k.so")), [_slot()])
    assert kernels["res"].library == (folder / "lib" / "k.so").resolve()


def _raw(folder, obj):
    path = folder / "bindings.json"
    path.write_bytes(orjson.dumps(obj))
    return path


@pytest.mark.parametrize("obj, message", [
    ({"schema_version": 1, "bindings": [{**_entry(), "extra": 1}]},
     "$.bindings[0]: Additional properties are not allowed ('extra' was unexpected)"),
    ({"schema_version": 1, "bindings": [{k: v for k, v in _entry().items() if k != "function"}]},
     "$.bindings[0]: 'function' is a required property"),
    ({"schema_version": 2, "bindings": []}, "$.schema_version: 1 was expected"),
    ({"schema_version": 1, "bindings": [{**_entry(), "abi_sha256": "abc"}]},
     "$.bindings[0].abi_sha256: 'abc' does not match"),
])
def test_schema_errors_name_the_file_and_json_path(folder, obj, message):
    path = _raw(folder, obj)
    with pytest.raises(UserError) as e:
        load_manifest(path)
    assert str(e.value).startswith(f"{path}: ") and message in str(e.value)


def _bind_error(folder, entries, slots) -> str:
    path = _manifest(folder, *entries)
    with pytest.raises(UserError) as e:
        bind(path, slots)
    assert str(e.value).startswith(f"{path}: ")
    return str(e.value)


def test_absolute_library_is_refused(folder):
    msg = _bind_error(folder, [_entry(library=str(folder / "residual_add.so"))], [_slot()])
    assert "$.bindings[0].library:" in msg and "is absolute" in msg


def test_library_outside_the_folder_is_refused(folder, tmp_path_factory):
    outside = tmp_path_factory.mktemp("elsewhere")
    shutil.copy(folder / "residual_add.so", outside / "k.so")
    (folder / "sub").mkdir()
    msg = _bind_error(folder / "sub", [_entry(library=f"../../{outside.name}/k.so")], [_slot()])
    assert "outside the manifest's folder" in msg
    (folder / "sub" / "link.so").symlink_to(outside / "k.so")
    msg = _bind_error(folder / "sub", [_entry(library="link.so")], [_slot()])
    assert "resolves to" in msg and "outside the manifest's folder" in msg and "symlink" in msg


def test_missing_library_file(folder):
    msg = _bind_error(folder, [_entry(library="nope.so")], [_slot()])
    assert "$.bindings[0].library: library file" in msg and "nope.so not found" in msg


def test_library_that_fails_to_load(folder):
    (folder / "garbage.so").write_bytes(b"not an ELF file")
    msg = _bind_error(folder, [_entry(library="garbage.so")], [_slot()])
    assert "$.bindings[0].library:" in msg and "garbage.so failed to load" in msg


def test_missing_function(folder):
    msg = _bind_error(folder, [_entry(function="launch")], [_slot()])
    assert "$.bindings[0].function: residual_add.so has no TVM-FFI function 'launch'" in msg


def test_abi_mismatch_shows_both_hashes(folder):
    other = _slot(extra_args=[{"type": "int", "value": 3}])
    msg = _bind_error(folder, [_entry(slot=other)], [_slot()])
    assert "$.bindings[0].abi_sha256: ABI mismatch for 'res'" in msg
    assert other["abi_sha256"] in msg and _slot()["abi_sha256"] in msg


def test_a_slot_bound_twice(folder):
    msg = _bind_error(folder, [_entry(), _entry(library="residual_sub.so")], [_slot()])
    assert "$.bindings[1].id: slot 'res' is bound twice (also at $.bindings[0])" in msg


def test_a_slot_left_unbound(folder):
    msg = _bind_error(folder, [_entry()], [_slot(), _slot("mlp", role="decode")])
    assert "slot 'mlp' (engine role decode) is left unbound" in msg


def test_a_binding_for_no_slot(folder):
    msg = _bind_error(folder, [_entry(), _entry("ghost")], [_slot()])
    assert "$.bindings[1].id: binding 'ghost' matches no kernel slot (slots: res)" in msg


def test_signature_kinds_must_match_the_abi(folder):
    msg = _bind_error(folder, [_entry(library="residual_add_wrong_signature.so")], [_slot()])
    assert "takes (DLTensor*, DLTensor*, int) per its signature metadata" in msg
    assert "calls it with 3 args (input 0: tensor, input 1: tensor, output 0: tensor)" in msg


def test_signature_count_must_match_the_abi(folder):
    slot = _slot(extra_args=[{"type": "float", "value": 0.5}])
    msg = _bind_error(folder, [_entry(slot=slot)], [slot])
    assert "takes (DLTensor*, DLTensor*, DLTensor*)" in msg and "extra 0: float" in msg


def test_nothing_is_bound_when_a_later_binding_fails(folder):
    slots = [_slot(), _slot("b")]
    msg = _bind_error(folder, [_entry(), _entry("b", library="residual_add_wrong_signature.so")],
                      slots)
    assert "$.bindings[1]" in msg


def test_kernel_slots_schema_accepts_a_slot_and_refuses_unknown_fields(tmp_path):
    path = tmp_path / "kernel_slots.json"
    path.write_bytes(orjson.dumps({"schema_version": 1, "slots": [_slot()]}))
    assert read_json(path, "kernel_slots")["slots"][0]["binding_id"] == "res"
    path.write_bytes(orjson.dumps({"schema_version": 1, "slots": [{**_slot(), "library": "x"}]}))
    with pytest.raises(UserError, match=r"\$\.slots\[0\]: Additional properties"):
        read_json(path, "kernel_slots")
