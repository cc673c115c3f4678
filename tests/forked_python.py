"""`python -m MODULE ARGS` for the tests, forked from one process that has imported torch already.

A doit run that reaches a stage imports torch (about a second of CPU on a 2-core machine) before
it forks the stage, and the tests run doit and `trtmc pipeline` dozens of times. The server here
imports torch once; for each run it forks a child that does what `python -m MODULE ARGS` does
(runpy, as `-m` runs a module) in the run's folder, with the run's environment and its output in
files. pipeline's modules are not imported before the fork, so each run reads its own
environment as a fresh process would. Tests that signal the process start it with subprocess.
"""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import orjson

_SERVER = r"""
import os, runpy, sys, traceback
import orjson
import torch  # noqa: F401 (what every stage imports first: here once, not once per run)
for line in sys.stdin.buffer:
    module, argv, cwd, env, out, err = orjson.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            for fd, path in ((1, out), (2, err)):
                os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), fd)
            os.chdir(cwd)
            os.environ.clear()
            os.environ.update(env)
            sys.argv = [module, *argv]
            sys.path[0] = cwd
            runpy.run_module(module, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            traceback.print_exc()
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:
                    pass
            os._exit(code)
    sys.stdout.buffer.write(orjson.dumps(pid) + b"\n")
    sys.stdout.flush()
    _, status = os.waitpid(pid, 0)
    sys.stdout.buffer.write(orjson.dumps(os.waitstatus_to_exitcode(status)) + b"\n")
    sys.stdout.flush()
"""

_server: subprocess.Popen | None = None


def _started() -> subprocess.Popen:
    global _server
    if _server is None or _server.poll() is not None:
        _server = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE)
    return _server


def _reply(server: subprocess.Popen, timeout: float):
    if not select.select([server.stdout], [], [], timeout)[0]:
        raise TimeoutError
    line = server.stdout.readline()
    if not line:
        raise RuntimeError(f"the test's python server ended (status {server.wait()})")
    return orjson.loads(line)


def python_m(module: str, *args, cwd: str | os.PathLike, env: dict[str, str] | None = None,
             stderr_to_stdout: bool = False, timeout: float = 900) -> subprocess.CompletedProcess:
    """`python -m module *args` in `cwd` (environment: this one, or `env`); its stdout and stderr
    as text, or both in stdout with `stderr_to_stdout` (as subprocess.run gives them)."""
    server = _started()
    command = [sys.executable, "-m", module, *map(str, args)]
    with tempfile.TemporaryDirectory(prefix="python-m-") as folder:
        out, err = Path(folder, "stdout"), Path(folder, "stderr" if not stderr_to_stdout else "stdout")
        request = [module, command[3:], os.fspath(cwd), dict(os.environ if env is None else env),
                   str(out), str(err)]
        server.stdin.write(orjson.dumps(request) + b"\n")
        server.stdin.flush()
        pid = _reply(server, 60)
        try:
            code = _reply(server, timeout)
        except TimeoutError:
            os.kill(pid, signal.SIGKILL)
            _reply(server, 60)
            raise subprocess.TimeoutExpired(command, timeout) from None
        read = lambda f: f.read_text(errors="replace") if f.exists() else ""  # noqa: E731
        return subprocess.CompletedProcess(command, code, read(out),
                                           None if stderr_to_stdout else read(err))
