"""Model families: which module builds a network for a checkpoint, and its build options."""
from __future__ import annotations

from types import ModuleType

from pipeline.errors import UserError


def family_of(checkpoint) -> tuple[str, ModuleType]:
    from pipeline.families import bert
    families = {"bert": bert, "distilbert": bert}
    try:
        from pipeline.families import qwen3
        families["qwen3"] = qwen3
    except ImportError:  # the decoder family is optional until it lands
        pass
    model_type = checkpoint.config.get("model_type")
    if model_type not in families:
        raise UserError(f"{checkpoint.path / 'config.json'}: model_type '{model_type}' is not "
                        f"supported (expected one of {', '.join(sorted(families))})")
    return model_type, families[model_type]


def resolve_options(family: ModuleType, options: dict) -> dict:
    """Defaults filled in; unknown options and invalid values are user errors."""
    out = dict(family.DEFAULT_OPTIONS)
    for key, value in options.items():
        if value is None:
            continue
        if key not in out:
            raise UserError(f"build option '{key}' does not apply to this family "
                            f"(expected one of {', '.join(sorted(out))})")
        out[key] = value
    if out["precision"] not in family.PRECISIONS:
        raise UserError(f"--precision {out['precision']}: expected one of "
                        f"{', '.join(family.PRECISIONS)}")
    return out


def check_role(family: ModuleType, role: str, options: dict) -> None:
    roles = family.roles(options)
    if role not in roles:
        raise UserError(f"--engine-role {role}: not a role of this model "
                        f"(valid roles: {', '.join(roles)})")
