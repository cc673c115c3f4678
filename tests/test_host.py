"""The kernel host and the judge: the channel's frames, and kernels that attack the gate from
inside their process run through doit and in production.

The doit tests share one workspace (a one-layer DistilBERT) and run in order on one worker.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pipeline.errors import UserError
from pipeline.host import frames

ROOT = Path(__file__).resolve().parent.parent


# -- frames ---------------------------------------------------------------------------------------
def _through_pipe(data: bytes, bounds: frames.Bounds = frames.Bounds(seconds=2.0)) -> dict:
    r, w = os.pipe()
    try:
        os.write(w, data)
        os.close(w)
        w = None
        return frames.read_frame(r, bounds)
    finally:
        os.close(r)
        if w is not None:
            os.close(w)


def test_a_frame_carries_json_and_tensors_of_every_dtype_back_as_they_were():
    body = {"kind": "ok", "n": 3, "nested": [{"t": torch.arange(6, dtype=torch.int32).view(2, 3)}],
            "bf16": torch.randn(4, 5).to(torch.bfloat16), "flags": torch.tensor([True, False]),
            "empty": torch.zeros(0, 7), "scalar": torch.tensor(2.5, dtype=torch.float64)}
    back = _through_pipe(frames.pack(body))
    assert back["kind"] == "ok" and back["n"] == 3
    for got, sent in ((back["nested"][0]["t"], body["nested"][0]["t"]), (back["bf16"], body["bf16"]),
                      (back["flags"], body["flags"]), (back["empty"], body["empty"]),
                      (back["scalar"], body["scalar"])):
        assert got.dtype == sent.dtype and torch.equal(got, sent)


def _frame(body: bytes, tensors: bytes = b"", json_bytes: int | None = None) -> bytes:
    """A frame head (claiming `json_bytes` of JSON, by default the body's) and what follows."""
    n = len(body) if json_bytes is None else json_bytes
    return frames.HEAD.pack(frames.MAGIC, n, len(tensors)) + body + tensors


@pytest.mark.parametrize("data, said", [
    (b"XXXX" + bytes(20), "magic"),
    (frames.HEAD.pack(frames.MAGIC, 1 << 40, 0), "more than the"),
    (_frame(b"{nope"), "not JSON"),
    (_frame(b"[]"), "not a JSON object"),
    (_frame(b'{"kind"', json_bytes=100), "the channel closed after 7 of 100"),
    (_frame(b'{"tensors": [{"dtype": "int8", "shape": [4]}]}', b"abc"),
     "take 4 bytes, the head says 3"),
    (_frame(b'{"tensors": [{"dtype": "object", "shape": [1]}]}'), "is not a dtype"),
    (_frame(b'{"x": {"tensor": 0}}'), "names no tensor"),
])
def test_a_malformed_frame_is_one_error_naming_what_was_wrong(data, said):
    with pytest.raises(frames.FrameError, match=re.escape(said)):
        _through_pipe(data)


def test_a_frame_that_stops_short_is_an_error_at_its_deadline_not_a_hang():
    r, w = os.pipe()
    try:
        os.write(w, frames.HEAD.pack(frames.MAGIC, 1000, 0) + b'{"kind"')  # and nothing more
        t0 = time.monotonic()
        with pytest.raises(frames.FrameError, match="came before the deadline"):
            frames.read_frame(r, frames.Bounds(seconds=0.5))
        assert time.monotonic() - t0 < 5
    finally:
        os.close(r)
        os.close(w)


# -- kernels attacking the gate from inside their process -----------------------------------------
@pytest.fixture(scope="module")
def ws(tiny_distilbert, tmp_path_factory):
    from tests.test_doit_pipeline import one_layer_workspace
    ws = one_layer_workspace(tmp_path_factory.mktemp("host"), tiny_distilbert)
    ws.spec["gates"]["call_timeout_s"] = 3
    return ws


def _kernel(ws, source: str, *capabilities: str) -> None:
    ws.spec["kernel"] = {"source": str(ROOT / source), "capabilities": list(capabilities)}
    ws.write_spec()


@pytest.mark.slow
@pytest.mark.xdist_group("host_workspace")
def test_a_kernel_that_rewrites_the_gates_in_its_process_is_refused_by_the_judge(ws):
    """It computes a - b, and on its first call patches, in the kernel host, the shadow's
    comparison, the encoder comparison, the probe's and the perf trials' output checks to pass:
    none of them judges it, so both gates fail; the host's own rows say pass and the judge's
    computation of the same calls says otherwise."""
    _kernel(ws, "tests/kernels/residual_add_forges.cu", "python")
    rc, _, out = ws.doit()
    assert rc != 0 and "TaskFailed - taskid:correctness:tiny" in out, out
    report = ws.report("correctness")
    assert not report["passed"] and not report["probe"]["passed"]
    assert report["shadow"]["passed"], "the host's own figures were forged to pass"
    judged = report["host"]["judged"]
    assert judged["judged"] == judged["calls"] > 0 and judged["failed"] == judged["judged"]
    assert judged["host_disagrees"] == judged["judged"] and not judged["passed"]
    assert all(not c["passed"] for c in report["cases"])
    assert report["host"]["capabilities"] == ["python"]
    rc, _, out = ws.doit("perf")
    perf = ws.report("perf")
    assert rc != 0 and perf["verdict"] == "fail" and "timed outputs differ" in perf["message"], out
    assert not (ws.out / "promotion.json").exists()


@pytest.mark.slow
@pytest.mark.xdist_group("host_workspace")
@pytest.mark.parametrize("source, said", [
    ("tests/kernels/residual_add_breaks_channel.cu", "magic"),
    ("tests/kernels/residual_add_partial_frame.cu", "came before the deadline"),
])
def test_a_kernel_that_writes_to_the_channel_ends_the_gate_with_an_aborted_report(ws, source, said):
    """Bytes that are no frame, or a frame head whose body never comes (the kernel then never
    returns): the judge kills the host, one `aborted` report, within the call's time limit."""
    _kernel(ws, source, "files")
    t0 = time.monotonic()
    rc, _, out = ws.doit("correctness")
    assert rc == 1 and time.monotonic() - t0 < 60, out
    report = ws.report("correctness")
    assert report["aborted"]["how"] == "channel" and said in report["message"], report
    assert "Traceback" not in out


@pytest.mark.slow
@pytest.mark.xdist_group("host_workspace")
def test_a_kernel_sees_the_same_process_in_each_gate_and_in_production(ws, capfd):
    """A kernel that fingerprints its stack, modules, command line, environment, working folder,
    descriptors, its parent's and grandparent's command lines and the files it can list prints
    one fingerprint in the correctness gate, the perf gate, `trtmc embed` and the library."""
    from pipeline.host import open_pipeline
    _kernel(ws, "tests/kernels/residual_add_fingerprints.cu", "python")
    rc, _, out = ws.doit()
    assert rc == 0 and (ws.out / "promotion.json").exists(), out
    bundle, bindings = ws.out / "slot.bundle", ws.out / "kernel" / "bindings.json"
    embed = subprocess.run([sys.executable, "-m", "pipeline.cli", "embed", str(bundle),
                            "--kernel-bindings", str(bindings), "--device", "cpu",
                            "--prompt", "Hello world!"], capture_output=True, text=True)
    assert embed.returncode == 0, embed.stderr
    capfd.readouterr()
    with open_pipeline(bundle, bindings, "cpu") as pipe:
        pipe.embed(["Hello world!"])
    library = capfd.readouterr().err
    prints = [re.findall(r"^FINGERPRINT (\w+) (.*)$", text, re.M)
              for text in (out, embed.stderr, library)]
    assert [len(p) for p in prints] == [2, 1, 1], prints  # the two gates' hosts, embed, library
    seen = {digest: shown for p in prints for digest, shown in p}
    assert len(seen) == 1, "\n".join(seen.values())
    (shown,) = seen.values()
    assert "cmdline=b'" in shown and "pipeline.host" in shown and "cwd='/'" in shown
    assert "parent='PermissionError'" in shown and "tmp='PermissionError'" in shown
    assert "project='PermissionError'" in shown  # the checkout's artifacts, a gate's included


@pytest.mark.slow
@pytest.mark.xdist_group("host_workspace")
def test_the_judge_never_loads_the_kernels_library(ws):
    """The correctness stage run in this process: afterwards nothing of the DSO is mapped here."""
    import hashlib

    from pipeline.flow import stages
    from pipeline.flow.spec import load_spec
    loaded = sys.modules["pipeline.kernels.bind"]._LOADED  # what this process has dlopened
    _kernel(ws, "examples/byok/residual_add.cu")
    rc, _, out = ws.doit("bind")
    assert rc == 0, out
    digest = hashlib.sha256((ws.out / "kernel" / "kernel.so").read_bytes()).hexdigest()
    stages.correctness(load_spec(ws.spec_path))
    assert ws.report("correctness")["passed"]
    assert digest not in loaded
    with open("/proc/self/maps") as f:
        assert digest[:16] not in f.read()


@pytest.mark.slow
@pytest.mark.xdist_group("host_workspace")
def test_production_audit_catches_a_kernel_that_goes_wrong_after_the_calls_it_counted(ws):
    """Right for its first 8 calls only: a run that audits every call reports the calls past the
    eighth, computed again by the native region in the client, which never loads the library;
    the command exits 1 after its output."""
    from pipeline.host import open_pipeline
    _kernel(ws, "tests/kernels/residual_add_first_n.cu")
    rc, _, out = ws.doit("bind")
    assert rc == 0, out
    bundle, bindings = ws.out / "slot.bundle", ws.out / "kernel" / "bindings.json"
    with open_pipeline(bundle, bindings, "cpu", audit=1.0) as pipe:
        pipe.embed([f"text number {i}" for i in range(12)])
    audited = pipe.audited
    assert (audited.calls, audited.drawn, len(audited.judged)) == (12, 12, 12)
    assert [c["call"] for c in audited.failed] == [8, 9, 10, 11]
    with open_pipeline(bundle, bindings, "cpu", audit=0.0) as pipe:
        pipe.embed(["unchecked"] * 3)
    assert pipe.audited.drawn == 0 and not pipe.audited.judged  # no audit: nothing drawn
    _kernel(ws, "tests/kernels/residual_sub.cu")
    assert ws.doit("bind")[0] == 0
    cli = subprocess.run([sys.executable, "-m", "pipeline.cli", "embed", str(bundle),
                          "--kernel-bindings", str(bindings), "--device", "cpu", "--audit", "1",
                          "--prompt", "Hello world!"], capture_output=True, text=True)
    assert cli.returncode == 1 and '"embedding"' in cli.stdout, cli.stderr
    assert "audit: 1 slot calls, 1 drawn, 1 computed again, 1 differ from the native region" \
        in cli.stderr


@pytest.mark.slow
def test_a_host_reads_the_checkpoint_a_weight_referencing_bundle_names(logits_slot, tiny_qwen3):
    from pipeline.bundle.reader import Bundle
    from pipeline.host import open_pipeline
    bundle, manifest, _ = logits_slot
    assert Bundle.open(bundle).manifest["checkpoint"] == str(tiny_qwen3)  # outside what it reads
    with open_pipeline(bundle, manifest, "cpu") as pipe:
        tokens = pipe.generate(["hello"], 2, greedy=True)[0]["token_ids"]
        # an error the host answers with: one line, and the host's traceback as its cause
        with pytest.raises(UserError, match="kernel host: no request 'nothing'") as e:
            pipe.ask("nothing")
    assert len(tokens) == 2
    assert type(e.value.__cause__).__name__ == "HostTraceback"
    assert "pipeline/host/serve.py" in str(e.value.__cause__), e.value.__cause__


def test_a_host_is_told_the_device_auto_resolves_to_before_it_confines_itself(tmp_path):
    """A host compiles for a GPU only where its request names one (exec is refused otherwise):
    `auto` reaches it as the device it stands for here."""
    from pipeline.host.client import HostSpec
    from pipeline.runtime.pipeline import resolve_device
    assert HostSpec(tmp_path, None, "auto").device == str(resolve_device("auto"))


def test_a_hosts_cpu_clock_never_steps_back_while_its_threads_come_and_go():
    """The perf gate reads a host's CPU time from outside around each trial: threads that end
    between two readings never make a trial's CPU time negative, and the total follows the
    process's own clock."""
    from types import SimpleNamespace

    from pipeline.host.client import Host, _ticks
    churn = ("import threading, time\n"
             "def burn():\n    t = time.thread_time() + 0.015\n    while time.thread_time() < t: pass\n"
             "while True:\n    ts = [threading.Thread(target=burn) for _ in range(3)]\n"
             "    [t.start() for t in ts]; [t.join() for t in ts]\n")
    child = subprocess.Popen([sys.executable, "-c", churn])
    try:
        clock = SimpleNamespace(pid=child.pid, _cpu=0.0)
        readings = []
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            readings.append(Host.cpu_seconds(clock))  # type: ignore[arg-type]
            time.sleep(0.004)
        total = _ticks(f"/proc/{child.pid}/stat") / os.sysconf("SC_CLK_TCK")
    finally:
        child.kill()
        child.wait()
    steps = [b - a for a, b in zip(readings, readings[1:])]
    assert min(steps) >= 0, min(steps)
    assert readings[-1] > 0.5 and abs(readings[-1] - total) < 0.1 * total + 0.05, (readings[-1], total)


def test_the_calls_a_judge_computes_again_are_a_random_sample_of_a_requests_calls():
    """Past its byte budget the audit keeps a reservoir: every drawn call is as likely to reach
    the judge as any other, so a kernel wrong only after the first calls of a request is still
    seen; what is kept stays inside the budget and comes in call order."""
    from pipeline.runtime.shadow import Audit
    x = torch.zeros(256)  # 1 KiB with its output
    positions = []
    for _ in range(200):
        audit = Audit(1.0, budget=4 * 2 * x.numel() * x.element_size())
        for _ in range(100):
            audit.after("slot", [x], x, None)
        taken = audit.take()
        calls = [c["call"] for c in taken["kept"]]
        assert len(calls) == 4 and calls == sorted(calls)
        assert (taken["calls"], taken["drawn"], taken["over_budget"]) == (100, 100, 96)
        positions += calls
    assert 35 < sum(positions) / len(positions) < 65  # uniform over 0..99 has mean 49.5
    assert sum(p >= 50 for p in positions) > len(positions) / 3
