"""Serialized TensorRT plans: the one place a builder config is made and a plan compiled."""
from __future__ import annotations

from pipeline import progress
from pipeline.errors import UserError
from pipeline.log import get as log_topic
from pipeline.trt import capabilities, MODULE, VERSION, trt

log = log_topic("build")


def _monitor(line: progress.Progress):
    """A `trt.IProgressMonitor` that shows the innermost builder phase and its step on `line`;
    None where the module has no progress interface."""
    if not hasattr(trt, "IProgressMonitor"):
        return None

    class Monitor(trt.IProgressMonitor):
        def __init__(self):
            trt.IProgressMonitor.__init__(self)
            self.phases: dict[str, int] = {}  # open phases, innermost last -> number of steps

        def phase_start(self, phase_name, parent_phase, num_steps):
            self.phases[phase_name] = num_steps
            line.update(0, note=f"{phase_name} 0/{num_steps}")

        def step_complete(self, phase_name, step):
            line.update(0, note=f"{phase_name} {step + 1}/{self.phases.get(phase_name, '?')}")
            return True  # never cancel

        def phase_finish(self, phase_name):
            self.phases.pop(phase_name, None)

    return Monitor()


def build_plan(builder, network, role: str, profile: dict, *, weights_mode: str,
               slot_ready: bool) -> tuple[bytes | None, str]:
    """The serialized plan of `network`, or None and why none can be built here.
    `profile`: input name -> (min, opt, max) shapes of its dynamic inputs."""
    if slot_ready and not capabilities().has_plugin_layers:
        return None, (f"{MODULE} {VERSION} has no plugin layers, so a plan with the kernel slot "
                      f"cannot be built here; the bundle runs on the reference runtime")
    if slot_ready:
        return None, "slot plans are built by the TensorRT runtime path (full TensorRT), not here"
    if weights_mode == "reference" and not capabilities().can_execute:
        return None, (f"a weight-stripped (refittable) plan needs a GPU at build time with "
                      f"{MODULE}; build one where it can execute, or embed the weights")
    log.info("building the %s plan with %s %s", role, MODULE, VERSION)
    config = builder.create_builder_config()
    if profile:
        shapes = builder.create_optimization_profile()
        for name, (lo, opt, hi) in profile.items():
            shapes.set_shape(name, lo, opt, hi)
        config.add_optimization_profile(shapes)
    if weights_mode == "reference":
        config.set_flag(trt.BuilderFlag.STRIP_PLAN)
        config.set_flag(trt.BuilderFlag.REFIT_IDENTICAL)
    with progress.spinner(f"{role} plan") as line:
        monitor = _monitor(line) if line.on else None  # kept alive until the build returns
        if monitor is not None:
            config.progress_monitor = monitor
        plan = builder.build_serialized_network(network, config)
        line.update(0, note="built" if plan is not None else "failed")
    if plan is None:
        raise UserError(f"{MODULE} failed to build the {role} plan")
    return bytes(plan), "built"
