"""doit task helpers that need no doit run."""
from pipeline.flow.tasks import _remove


def test_clean_removes_outputs_and_the_empty_folders_they_leave_inside_the_output(tmp_path):
    out = tmp_path / "artifacts" / "pipelines" / "x"
    (out / "kernel").mkdir(parents=True)
    (out / "kernel" / "kernel.so").write_bytes(b"\0")
    (out / "slot.bundle").mkdir()
    (out / "slot.bundle" / "manifest.json").write_text("{}")
    (out / "graph.json").write_text("{}")
    _remove([str(out / "kernel" / "kernel.so"), str(out / "slot.bundle")], str(out))
    assert sorted(p.name for p in out.iterdir()) == ["graph.json"]  # kernel/ gone, graph kept
    _remove([str(out / "graph.json")], str(out))
    assert not out.exists() and (tmp_path / "artifacts" / "pipelines").is_dir()  # stops at out
