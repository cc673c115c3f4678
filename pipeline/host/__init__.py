"""The kernel host: the one process a bound kernel runs in, the same for a gate and a production
run (`__main__.py`, `serve.py`), the client that starts and watches it (`client.py`), the
bounded channel between them (`frames.py`), and the pipeline whose kernels run there
(`hosted.py`). `open_pipeline` here is the library's way to open a pipeline."""
from __future__ import annotations

from pathlib import Path

from pipeline.errors import UserError
from pipeline.host.client import HostSpec


def open_pipeline(bundle, kernel_bindings=None, device: str | None = "cpu", checkpoint=None,
                  mode: str | None = None, *, shadow: bool = False, audit: float = 0.0,
                  what: str = "kernel host", **in_process):
    """A bundle's pipeline. With a binding manifest its kernels run in a confined kernel host
    (`HostedPipeline`: end it with `close()` or a `with` block); `shadow` (a gate's): every slot
    call is checked there against its native region and drawn for this process to compute again;
    `audit`: the probability that a slot call is drawn (production's own check); `what`: how
    an error the host ends with starts (pipeline/isolation.py: KernelAborted). Without one,
    or with `in_process=True` and the in-process options of runtime.pipeline.open_pipeline, the
    pipeline runs in this process."""
    if kernel_bindings is None or in_process.get("in_process"):
        from pipeline.runtime.pipeline import open_pipeline as opened_here
        return opened_here(bundle, kernel_bindings, device, checkpoint, mode, shadow=shadow,
                           audit=audit, **in_process)
    if in_process:
        raise UserError(f"{', '.join(sorted(in_process))}: options of a pipeline run in this "
                        f"process (in_process=True), not of a kernel host", param="in_process")
    from pipeline.host.hosted import HostedPipeline
    bundle = getattr(bundle, "path", bundle)
    return HostedPipeline(HostSpec(Path(bundle), Path(kernel_bindings), str(device or "auto"),
                                   mode, None if checkpoint is None else Path(checkpoint),
                                   shadow=shadow, audit=audit), what=what)
