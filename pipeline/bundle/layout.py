"""Where things live inside a `*.bundle` directory; one place so writer and reader agree."""
from __future__ import annotations

from pathlib import Path

FORMAT_VERSION = 1
MANIFEST = "manifest.json"          # written last: its presence means the bundle is complete
WEIGHTS = "weights.safetensors"     # embedded weights (and computed constants in any mode)
SLOTS = "kernel_slots.json"
TOKENIZER = "tokenizer"
CONFIG = "config.json"


def network_path(role: str) -> str:
    return f"roles/{role}/network.json"


def plan_path(role: str) -> str:
    return f"roles/{role}/plan.engine"


def selection_path(bundle: Path) -> Path:
    """`X.bundle` -> `X.selection.json` beside it."""
    name = bundle.name[: -len(".bundle")] if bundle.name.endswith(".bundle") else bundle.name
    return bundle.parent / f"{name}.selection.json"
