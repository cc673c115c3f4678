"""A stop (SIGTERM) that lands while a process forks a stage or a worker: held back across the
fork, it must still stop what was forked, and a forked child must never return into its parent's
code. Each case runs in a process of its own, whose start of the child (os.fork, os.posix_spawn,
subprocess.Popen) sends the signal at the moment the case names; the child's work would write a
file after a pause, so a child left running shows."""
from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

STAGE = """
import os, signal, sys, time
from pathlib import Path
from types import SimpleNamespace
from pipeline.flow import tasks
marker = Path(sys.argv[1])

def stage(argv):
    time.sleep(2)
    marker.write_text("the stage ran to its end")
    return 0

tasks.stage_main = SimpleNamespace(main=stage, __file__=tasks.stage_main.__file__)
real_fork = os.fork

def fork():
    {fork}

os.fork = fork
signal.signal(signal.SIGTERM, tasks._stop_run)  # as doit's process has it
try:
    print("stage exit", tasks._fork_stage(SimpleNamespace(name="stage", preload=()), "spec.json"))
finally:
    print("back in the caller", os.getpid(), flush=True)
"""


def _run(script: str, marker: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-c", script, str(marker)], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    time.sleep(3)  # longer than the forked work's pause: a child still running writes the marker
    return proc


def test_a_stop_held_back_by_a_stages_fork_stops_the_stage(tmp_path):
    """The signal reaches doit's process while the fork holds it back: it is raised as the mask
    is restored, where the stage just forked is stopped, not left to finish on its own."""
    script = STAGE.format(fork="os.kill(os.getpid(), signal.SIGTERM)\n    return real_fork()")
    proc = _run(script, tmp_path / "marker")
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr
    assert [line.split()[:-1] for line in proc.stdout.splitlines()] == [["back", "in", "the", "caller"]], proc.stdout
    assert not (tmp_path / "marker").exists(), "the stage outlived the stop"


def test_a_forked_stage_stopped_before_it_lets_stops_through_never_returns_into_doit(tmp_path):
    """The signal reaches the child between the fork and its restoring the mask: the child ends
    there, and doit's own code (here the caller's `finally`) runs once, in doit's process."""
    script = STAGE.format(fork="pid = real_fork()\n    if pid == 0:\n        os.kill(os.getpid(), signal.SIGTERM)\n"
                                 "    return pid")
    proc = _run(script, tmp_path / "marker")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 2 and lines[0] == "stage exit 1" and lines[1].startswith("back in the caller"), lines
    assert not (tmp_path / "marker").exists()


SPAWNED = """
import os, signal, sys, threading
from pipeline.flow import tasks

threading.Thread(target=threading.Event().wait, daemon=True).start()  # no fork: a thread runs
real_spawn = os.posix_spawn

def spawn(path, argv, env, **kwargs):  # the stage: a pause, then the marker
    stage = "import sys, time; time.sleep(2); open(sys.argv[1], 'w').write('the stage ran to its end')"
    pid = real_spawn(path, [path, "-c", stage, sys.argv[1]], env, **kwargs)
    os.kill(os.getpid(), signal.SIGTERM)  # as the stage has started, before doit waits for it
    return pid

os.posix_spawn = spawn
signal.signal(signal.SIGTERM, tasks._stop_run)
try:
    tasks.run_stage("promote", "spec.json")
finally:
    print("back in the caller", flush=True)
"""


def test_a_stop_held_back_by_a_spawned_stages_start_stops_the_stage(tmp_path):
    """Where doit's process cannot fork (another thread runs) the stage is a fresh interpreter:
    a stop that came as it was spawned stops it too."""
    proc = _run(SPAWNED, tmp_path / "marker")
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr
    assert proc.stdout == "back in the caller\n", proc.stdout
    assert not (tmp_path / "marker").exists(), "the stage outlived the stop"


WORKER = """
import os, signal, sys, time
from pathlib import Path
from pipeline import isolation

def work(path):
    time.sleep(1)
    Path(path).write_text("the worker ran to its end")

def stop(signum, frame):
    raise SystemExit(128 + signum)

real_fork = os.fork

def fork():
    os.kill(os.getpid(), signal.SIGTERM)  # held back by the worker's start
    return real_fork()

os.fork = fork
signal.signal(signal.SIGTERM, stop)
try:
    isolation.run_isolated(work, sys.argv[1], what="work", fork=True)
except SystemExit:
    time.sleep(6)  # the caller lives on: a worker left running writes the marker meanwhile
    print("stopped", flush=True)
"""


def test_a_stop_held_back_by_a_workers_start_ends_the_worker(tmp_path):
    proc = subprocess.run([sys.executable, "-c", WORKER, str(tmp_path / "marker")], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.stdout == "stopped\n", (proc.stdout, proc.stderr)
    assert not (tmp_path / "marker").exists(), "the worker outlived the stop"


HOST = """
import os, signal, subprocess
from pathlib import Path
from pipeline import isolation
from pipeline.host import client

started = []

class Popen(subprocess.Popen):
    def __init__(self, args, **kwargs):
        host = args[-1:] == ["pipeline.host"]
        if host:
            os.kill(os.getpid(), signal.SIGTERM)  # held back by the host's start
        super().__init__(args, **kwargs)
        if host:
            started.append(self)

def stop(signum, frame):
    raise SystemExit(128 + signum)

subprocess.Popen = Popen
signal.signal(signal.SIGTERM, stop)
try:
    client.Host(client.HostSpec(Path("bundle"), None, "cpu"), "host", isolation.Limits())
except SystemExit:
    (host,) = started
    print("the host", "runs on" if host.poll() is None else "has ended", flush=True)
"""


def test_a_stop_held_back_by_a_kernel_hosts_start_ends_the_host():
    proc = subprocess.run([sys.executable, "-c", HOST], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.stdout == "the host has ended\n", (proc.stdout, proc.stderr)
