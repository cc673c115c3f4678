"""Count limits of JSON files, checked before the full schema validation, and the ABI's bounds.

Validating a document item by item costs about 0.1 ms per graph node, so a file with 10^6 nodes
would run for minutes before its schema's `maxItems` refused it. The limits stay in the schemas
(one place per bound); this checks the top-level arrays' `maxItems` first, in microseconds. The
region validator's ABI bounds (boundary dtypes, rank, workspace size) are read from the selection
schema's `$defs` too (`ABI_LIMITS`).
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import orjson

from pipeline import jsonio
from pipeline.errors import UserError
from pipeline.files import shown


@functools.cache
def schema_defs(schema_name: str) -> dict:
    """The `$defs` of a schema file (each schema file is self-contained: no `$ref` between
    files)."""
    schema = orjson.loads((jsonio.SCHEMA_DIR / f"{schema_name}.schema.json").read_bytes())
    return schema.get("$defs", {})


@dataclass(frozen=True)
class AbiLimits:
    dtypes: tuple[str, ...]     # boundary tensor dtypes ($defs/dtype)
    max_rank: int               # boundary tensor rank ($defs/shape maxItems)
    max_workspace_bytes: int    # $defs/workspace_bytes maximum


def _abi_limits(schema_name: str = "selection") -> AbiLimits:
    defs = schema_defs(schema_name)
    return AbiLimits(tuple(defs["dtype"]["enum"]), defs["shape"]["maxItems"],
                     defs["workspace_bytes"]["maximum"])


ABI_LIMITS = _abi_limits()


@functools.cache
def _top_limits(schema_name: str) -> tuple[tuple[str, int], ...]:
    """(key, maxItems) of each top-level array property of the schema that declares one."""
    schema = orjson.loads((jsonio.SCHEMA_DIR / f"{schema_name}.schema.json").read_bytes())
    return tuple((key, prop["maxItems"]) for key, prop in schema.get("properties", {}).items()
                 if isinstance(prop, dict) and "maxItems" in prop)


def check_counts(doc, schema_name: str, where: str | os.PathLike) -> None:
    """Refuse a top-level array longer than its schema's maxItems, naming the key and limit."""
    if not isinstance(doc, dict):
        return  # the schema's own type error says so
    for key, limit in _top_limits(schema_name):
        value = doc.get(key)
        if isinstance(value, list) and len(value) > limit:
            raise UserError(f"{shown(where)}: $.{key}: {len(value)} items, more than the limit "
                            f"of {limit} (maxItems in {schema_name}.schema.json)")


def parse_counted(data: bytes, schema_name: str, where: str | os.PathLike):
    """`jsonio.parse_json` with the counts checked before the schema."""
    return jsonio.parse_json(data, schema_name, where,
                             before=lambda doc: check_counts(doc, schema_name, where))


def read_counted(path: str | os.PathLike, schema_name: str):
    """`jsonio.read_json` with the counts checked before the schema."""
    return jsonio.read_json(path, schema_name,
                            before=lambda doc: check_counts(doc, schema_name, path))
