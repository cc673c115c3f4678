"""What a script here that needs a GPU calls once its arguments are read: without a CUDA device
(none present, or hidden with CUDA_VISIBLE_DEVICES="") it refuses in one line on stderr with exit
status 2, as trtmc answers a usage error, instead of a traceback from deep inside a run."""
from __future__ import annotations

import sys
from pathlib import Path


def require_cuda(script: str) -> None:
    """Exit 2 with one line naming `script` (its __file__) unless torch sees a CUDA device."""
    import torch
    if not torch.cuda.is_available():
        print(f"{Path(script).name}: needs a CUDA GPU, and torch {torch.__version__} sees none",
              file=sys.stderr)
        raise SystemExit(2)
