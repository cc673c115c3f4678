"""How fast a frame crosses the kernel host's channel: one process writes frames of a given size
(one tensor, as a probe call's cache is) into a pipe set up as the host's, another reads them with
the judge's bounds and deadline; the median seconds per frame and the rate, as JSON. `--cuda`: the
tensor starts on the writer's GPU and ends on the reader's, as a probe call's caches go from the
judge to a host; `--pageable`: without the page-locked staging (`frames.PINNED` emptied)."""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import statistics
import sys
import time

os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # asking for a GPU starts no CUDA
import torch  # noqa: E402 - before the fork, which a started CUDA would not survive

from pipeline.host import client, frames  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(prog="host_channel.py", description=__doc__)
    ap.add_argument("--mib", type=int, default=64, help="tensor bytes per frame, MiB (64)")
    ap.add_argument("--frames", type=int, default=9, help="frames timed (9)")
    ap.add_argument("--pipe-bytes", type=int, default=None,
                    help="the pipe's size (default: what a kernel host's channel sets)")
    ap.add_argument("--cuda", action="store_true", help="from the writer's GPU to the reader's")
    ap.add_argument("--pageable", action="store_true", help="no page-locked staging")
    args = ap.parse_args()
    if args.cuda:
        from _gpu import require_cuda
        require_cuda(__file__)
    if args.pageable:
        frames.PINNED = (1, 0)
    tensor = torch.randint(0, 255, (args.mib << 20,), dtype=torch.uint8)  # CUDA starts after fork
    r, w = os.pipe()
    with contextlib.suppress(OSError):
        fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, args.pipe_bytes or client.PIPE_BYTES)
    pid = os.fork()
    if pid == 0:  # the writer
        os.close(r)
        sent = tensor.cuda() if args.cuda else tensor
        for _ in range(args.frames + 1):
            frames.write_frame(w, {"x": sent})
        os._exit(0)
    os.close(w)
    seconds = []
    for i in range(args.frames + 1):
        start = time.perf_counter()
        body = frames.read_frame(r, frames.Bounds(seconds=60), pinned=args.cuda)
        if args.cuda:
            body["x"] = body["x"].cuda()
            torch.cuda.synchronize()
        if i:  # the first one warms both sides up
            seconds.append(time.perf_counter() - start)
        assert body["x"].numel() == tensor.numel()
    os.waitpid(pid, 0)
    median = statistics.median(seconds)
    print(json.dumps({"mib": args.mib, "frames": args.frames, "cuda": args.cuda,
                      "pinned": args.cuda and frames.PINNED[0] <= args.mib << 20 <= frames.PINNED[1],
                      "median_s": round(median, 4),
                      "gb_per_s": round((args.mib << 20) / median / 1e9, 3),
                      "pipe_bytes": fcntl.fcntl(r, fcntl.F_GETPIPE_SZ)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
