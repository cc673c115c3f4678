"""What the gates ask of a pipeline whose kernels run in another process (a kernel host:
pipeline/host/hosted.py) instead of running, timing or watching a kernel in their own: one
type for the pipeline, one for each of its kernels, so a gate tells the two kinds of pipeline
apart by type, and the host's side says in one place what it must answer. Torch-free."""
from __future__ import annotations

import abc
from typing import Any, Mapping


class KernelsInHost(abc.ABC):
    """A pipeline whose bound kernels run in a kernel host: the judge's view of it."""
    confinement: Mapping[str, Any]  # what the host reported it applied before the library loaded
    audited: Any                    # the audit's draws judged here (host/client.py: Audited)

    @property
    @abc.abstractmethod
    def local(self) -> Any:
        """The bundle opened in this process, every slot on its native region and each kernel a
        `KernelInHost`: what the host's answers are judged against."""

    @abc.abstractmethod
    def time_region(self, key: str, **settings: Any) -> dict[str, Any]:
        """One slot's region timed in the host, with its last call's inputs and output."""

    @abc.abstractmethod
    def tapped(self, replayed: dict[str, Any]) -> dict[str, Any]:
        """Every slot call's output of the kernels' eager run on a replayed item."""

    @abc.abstractmethod
    def cpu_seconds(self) -> float:
        """The host's CPU time so far, read from outside it."""

    @abc.abstractmethod
    def call_limits(self) -> Any:
        """The host's heartbeat values, whose per-call limit a gate raises (isolation.py)."""


class KernelInHost(abc.ABC):
    """One binding's kernel, called in the host on this process's buffers."""

    @abc.abstractmethod
    def cuda_outputs(self, inputs: list[Any]) -> dict[str, Any]:
        """The CUDA checks' raw outputs of one call (gates/probe.py), made in the host."""
