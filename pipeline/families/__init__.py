"""Model families: each one object with a declared contract.

A family says which checkpoints it takes (model types), its graph-producing build options and
their defaults, its precisions, its engine roles and their optimization profiles, the names
of its network inputs and outputs, and its workload (what the gates feed it and how two arms'
outputs compare, `workloads.py`). The runtime, the gates and the CLI ask the family; nothing
else spells `input_ids` or `prefill`. The contract imports no TensorRT module: only
`build_network` does, through the family's `network` module, so the runtime runs where no
TensorRT is installed.
"""
from __future__ import annotations

import functools
import importlib
import pkgutil
from dataclasses import dataclass, field
from typing import Callable, Mapping

from pipeline.errors import UserError, as_typed
from pipeline.families.workloads import DecoderWorkload, EncoderWorkload  # noqa: F401 (declarations)
from pipeline.families.workloads import WorkloadKind, of_kind
from pipeline.jsonio import excerpt


@dataclass(frozen=True)
class EncoderIO:
    """Inputs [S] INT32 padded to the fixed sequence length; output [S, H]."""
    input_ids: str = "input_ids"
    attention_mask: str = "attention_mask"
    hidden: str = "last_hidden_state"


@dataclass(frozen=True)
class DecoderIO:
    """Batch-1 decoder over a fixed-capacity KV cache updated in place (see qwen3)."""
    input_ids: str = "input_ids"
    position_ids: str = "position_ids"
    past_length: str = "past_length"
    total_length: str = "total_length"
    attention_mask: str = "attention_mask"   # single-engine layout only
    logits: str = "logits"
    past_key: str = "past_key."              # + layer index; updated into present_key.N
    past_value: str = "past_value."
    present_key: str = "present_key."
    present_value: str = "present_value."
    prefill_role: str = "prefill"            # absent in a single-engine build: decode serves both
    decode_role: str = "decode"

    def is_cache(self, name: str) -> bool:
        return name.startswith((self.past_key, self.past_value))


# The role of a model's single engine (every encoder; a decoder's unified layout).
SINGLE_ENGINE_ROLE = "decode"


@dataclass(frozen=True)
class RegionReference:
    """What the region of one of a family's recipes computes, stated by the family as a
    FlashInfer-Bench Definition states a kernel task (`definition.py` makes the Definition of a
    selection from it and the selection's ABI). Every text here is the family's own constant:
    nothing of a selection or a graph enters `reference`, and the Definition's name is `name`
    filled with integers of the ABI and the dtype's name."""
    op_type: str                                     # the Definition's `type`
    name: str                                        # str.format template: {const axis}, {dtype}
    inputs: tuple[tuple[str, tuple[str, ...]], ...]  # call order: (name, one axis name per dim)
    outputs: tuple[tuple[str, tuple[str, ...]], ...]
    axes: Mapping[str, str]                          # every axis named above -> its description
    tensors: Mapping[str, str]                       # every input and output -> its description
    reference: str                                   # Python source: `run(*inputs)` -> the output
    description: str
    tags: tuple[str, ...] = ()
    constraints: tuple[str, ...] = ()                # Python expressions over the axis names


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    kind: str                                   # "encoder" (embed) or "decoder" (generate)
    io: EncoderIO | DecoderIO
    default_options: Mapping[str, object]
    precisions: Mapping[str, str]               # option value -> dtype name
    option_choices: Mapping[str, tuple] = field(default_factory=dict)  # option -> allowed values
    roles_of: Callable[[dict], tuple[str, ...]] = lambda options: (SINGLE_ENGINE_ROLE,)
    profile_of: Callable[[str, dict], dict] = lambda role, options: {}
    network_module: str = ""
    # recipe id -> what its region computes, for the recipes whose semantics the family states
    references: Mapping[str, RegionReference] = field(default_factory=dict)
    workload: WorkloadKind = field(kw_only=True)  # EncoderWorkload or DecoderWorkload (workloads.py)

    def __post_init__(self):
        if self.workload is not of_kind(self.kind):
            raise TypeError(f"family {self.name}: a {self.kind} declares {of_kind(self.kind).__name__} "
                            f"as its workload, not {self.workload.__name__}")

    def roles(self, options: dict) -> tuple[str, ...]:
        return self.roles_of(options)

    def profile(self, role: str, options: dict) -> dict:
        """(min, opt, max) shapes of the role's dynamic inputs, for a plan build."""
        return self.profile_of(role, options)

    def build_network(self, checkpoint, role: str, options: dict):
        return importlib.import_module(self.network_module).build_network(checkpoint, role, options)

    def resolve_options(self, options: dict) -> dict:
        """Defaults filled in; unknown options and invalid values are user errors named by
        their option (parameter) names."""
        out = dict(self.default_options)
        for key, value in options.items():
            if value is None:
                continue
            if key not in out:
                raise UserError(f"{key}: does not apply to the {self.name} family (its build "
                                f"options: {', '.join(sorted(out))})", param=key, mentions=tuple(out))
            out[key] = value
        choices = {"precision": tuple(self.precisions), **self.option_choices}
        for key, allowed in choices.items():
            if out[key] not in allowed:
                raise UserError(f"{key} {out[key]}: expected one of {', '.join(map(str, allowed))}",
                                param=key)
        return out

    def check_role(self, role: str, options: dict) -> None:
        roles = self.roles(options)
        if role not in roles:
            raise UserError(f"engine_role {as_typed(role)}: not a role of this model (valid roles: "
                            f"{', '.join(roles)})", param="engine_role")


@functools.cache
def registry() -> tuple[Family, ...]:
    """Every family: each subpackage of pipeline.families declares one `FAMILY`, so adding a
    family is adding its package (its contract in `__init__.py`, its network in `network.py`)."""
    found = []
    for info in pkgutil.iter_modules(__path__):
        if info.ispkg:
            found.append(importlib.import_module(f"{__name__}.{info.name}").FAMILY)
    return tuple(sorted(found, key=lambda f: f.name))


def family_named(model_type: str) -> Family:
    """The family of a checkpoint's (or a bundle's) model type."""
    for family in registry():
        if model_type in family.model_types:
            return family
    known = sorted(t for f in registry() for t in f.model_types)
    raise UserError(f"model_type '{model_type}' is not supported (expected one of {', '.join(known)})")


def family_of(checkpoint) -> tuple[str, Family]:
    model_type = checkpoint.config.get("model_type")
    try:
        return model_type, family_named(model_type)
    except UserError as e:
        raise UserError(f"{checkpoint.path / 'config.json'}: {e}") from None


def config_size(cfg: dict, key: str, path, default: int | None = None) -> int:
    """A size a family's network needs from config.json (a layer count, a width): a positive
    integer, or one line naming the file and the field, not a KeyError inside a builder."""
    value = default if cfg.get(key) is None else cfg[key]  # null: not given (as transformers reads)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        found = "missing" if value is None else excerpt(repr(value), 80)
        raise UserError(f"{path / 'config.json'}: $.{key}: {found}; expected a positive integer "
                        f"(the {cfg.get('model_type')} family needs it)")
    return value
