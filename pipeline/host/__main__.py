"""`python -m pipeline.host`: the kernel host, the one process a bound kernel runs in.

Started by `pipeline.host.client.start` with no arguments, in `/`, with an allow-listed
environment and four descriptors besides stdin/stdout/stderr: requests (3), answers (4) and the
heartbeat (5, a memfd mapped here, then closed). It forks once: the parent only waits and exits
as the child did, so the host's parent is this same command line whoever started it. The child
maps the heartbeat, reads the `open` request, imports what any request needs, confines itself
(pipeline/confine.py), opens the pipeline (the kernel's library loads here) and answers requests
until the channel closes.
"""
from __future__ import annotations

import mmap
import os
import signal
import sys
import traceback

from pipeline import isolation
from pipeline.errors import UserError
from pipeline.host import frames

REQUESTS, ANSWERS, HEARTBEAT_FD = 3, 4, 5
ERROR_CHARS = 8000  # of a traceback the host sends back


def _keeper(child: int) -> None:
    """Wait for the host and end as it ended."""
    for fd in (REQUESTS, ANSWERS, HEARTBEAT_FD):
        os.close(fd)
    _, status = os.waitpid(child, 0)
    if os.WIFSIGNALED(status):
        signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        os.kill(os.getpid(), os.WTERMSIG(status))
    os._exit(os.waitstatus_to_exitcode(status))


def _heartbeat():
    shared = mmap.mmap(HEARTBEAT_FD, isolation.HEARTBEAT_BYTES)
    os.close(HEARTBEAT_FD)
    values, text = isolation.heartbeat_views(shared)
    isolation.HEARTBEAT = isolation._Heartbeat(values, text)
    return shared


def _serve() -> None:
    keep = _heartbeat()  # noqa: F841 - the mapping lives as long as the host
    isolation.die_with_parent()
    isolation.beat("starting")
    try:
        request = frames.read_frame(REQUESTS, timed=False)
        from pipeline.host import serve
        confined = serve.confine_host(request)
        isolation.beat("opening the pipeline")
        pipe = serve.open_hosted(request)
        # tvm-ffi, which binding imported, installs its own SIGSEGV handler: ours is the default
        # action. Never imported before the host confines itself: the CUDA driver it starts then
        # cannot open a device once Landlock and the dropped capabilities apply.
        isolation._quiet_crashes()
        frames.write_frame(ANSWERS, {"kind": "ready", "confinement": confined.as_dict(),
                                     "kernels": _kernels(pipe)})
    except frames.FrameError:
        os._exit(3)
    except UserError as e:
        frames.write_frame(ANSWERS, {"kind": "user_error", "message": str(e)})
        os._exit(0)
    while True:
        try:
            request = frames.read_frame(REQUESTS, timed=False, pinned=pipe.device.type == "cuda")
        except frames.FrameError:
            os._exit(0)  # the client closed the channel: done
        isolation.beat(f"request {request.get('kind')}")
        try:
            answer = {"kind": "ok", **serve.answer(pipe, request)}
        except UserError as e:  # with its cause, which the client shows under --debug
            answer = {"kind": "user_error", "message": str(e),
                      "cause": traceback.format_exc()[-ERROR_CHARS:]}
        except Exception:  # noqa: BLE001 - a fault of the host's own code, sent to be shown
            answer = {"kind": "error", "message": traceback.format_exc()[-ERROR_CHARS:]}
        frames.write_frame(ANSWERS, answer)
        del request, answer  # a request's page-locked blocks go back before the next one's come


def _kernels(pipe) -> list[dict]:
    """The kernels bound here, as the ready frame carries them (JSON)."""
    from pipeline.gates.probe import tested_kernels
    return [k.to_json() for k in tested_kernels(pipe)]


def main() -> None:
    child = os.fork()
    if child:
        _keeper(child)
    try:
        _serve()
    except BaseException:  # noqa: BLE001 - the client sees the host end; the cause goes to the log
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(2)
    os._exit(0)


if __name__ == "__main__":
    main()
