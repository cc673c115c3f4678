"""The engine's modes and the default one per device type: a torch-free module, so that what
only records the mode (the gates' environment, the receipt) decides it exactly as a pipeline
does when it opens."""
from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from pipeline.errors import UserError

if TYPE_CHECKING:
    import torch


class Mode(enum.StrEnum):
    """How a pipeline's engine runs, decided once when it opens (`Mode.of`) and passed to what
    depends on it: the lowering passes, generation (compiled decode steps) and the gates' region
    timing (compiled and graphed arms). A string: it compares and serialises as its name."""
    OPTIMIZED = "optimized"   # lowering passes, then compiled (+ CUDA-graphed on CUDA) steps
    EAGER = "eager"           # layer by layer

    @classmethod
    def of(cls, mode: str | None, device_type: str) -> Mode:
        """`mode`, or the default of a device of type `device_type` ("cuda", "cpu"):
        optimized on CUDA, eager on a CPU."""
        if not mode:
            return cls.OPTIMIZED if device_type == "cuda" else cls.EAGER
        try:
            return cls(mode)
        except ValueError:
            raise UserError(f"mode {mode}: expected one of {', '.join(MODES)}", param="mode") from None

    @property
    def optimized(self) -> bool:
        """Lowering passes at load, and steps compiled when run (decode steps, the encoder)."""
        return self is Mode.OPTIMIZED

    def graphed(self, device: torch.device) -> bool:
        """Steps compiled and replayed from CUDA graphs: the optimized mode on CUDA."""
        return self.optimized and device.type == "cuda"


MODES = tuple(m.value for m in Mode)
