"""JSON in and out: orjson, schema-validated on read and write, atomic writes.

Every file the project reads or writes has a draft 2020-12 schema under `schemas/`; a file that
does not match is a UserError naming the file, the JSON path and what was expected.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import jsonschema
import orjson

from pipeline.errors import UserError
from pipeline.files import atomic_write_bytes

# An installed wheel carries the schemas inside the package (setup.py); a source tree at its top.
SCHEMA_DIR = next(d for d in (Path(__file__).resolve().parent / "schemas",
                              Path(__file__).resolve().parent.parent / "schemas") if d.is_dir())


@functools.cache
def _validator(schema_name: str) -> jsonschema.Draft202012Validator:
    path = SCHEMA_DIR / f"{schema_name}.schema.json"
    schema = orjson.loads(path.read_bytes())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def json_path(parts) -> str:
    out = "$"
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else f".{p}"
    return out


def validate(obj: Any, schema_name: str, where: str | os.PathLike) -> None:
    """Raise UserError for the most relevant schema violation, naming `where` and the JSON path."""
    error = jsonschema.exceptions.best_match(_validator(schema_name).iter_errors(obj))
    if error is not None:
        raise UserError(f"{where}: {json_path(error.absolute_path)}: {error.message} "
                        f"(expected a valid {schema_name} file)")


def dumps(obj: Any, human: bool = True) -> bytes:
    option = orjson.OPT_SORT_KEYS | orjson.OPT_SERIALIZE_NUMPY
    if human:
        option |= orjson.OPT_INDENT_2
    return orjson.dumps(obj, option=option) + (b"\n" if human else b"")


def write_json(path: str | os.PathLike, obj: Any, schema: str | None, human: bool = True) -> Path:
    if schema is not None:
        validate(obj, schema, path)
    return atomic_write_bytes(path, dumps(obj, human))


def read_json(path: str | os.PathLike, schema: str | None) -> Any:
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise UserError(f"{path}: file not found") from None
    except IsADirectoryError:
        raise UserError(f"{path}: is a directory, expected a JSON file") from None
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise UserError(f"{path}: not valid JSON ({e})") from None
    if schema is not None:
        validate(obj, schema, path)
    return obj
