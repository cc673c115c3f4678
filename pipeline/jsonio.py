"""JSON in and out: orjson, schema-validated on read and write, atomic writes.

Every file the project reads or writes has a draft 2020-12 schema under `schemas/`; a file that
does not match is a UserError naming the file, the JSON path and what was expected. Reading is
strict: regular files only, a size limit, no duplicate keys (orjson would keep the last one).
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, Callable

import jsonschema
import orjson

from pipeline.errors import UserError
from pipeline.files import atomic_write_bytes, read_regular, shown

# An installed wheel carries the schemas inside the package (setup.py); a source tree at its top.
SCHEMA_DIR = next(d for d in (Path(__file__).resolve().parent / "schemas",
                              Path(__file__).resolve().parent.parent / "schemas") if d.is_dir())
MAX_JSON_BYTES = 256 << 20  # the largest JSON file read (network exports of big models: ~10 MB)
EXCERPT_CHARS = 200         # a schema message quotes at most this much of the offending value
# (schema, sha256 of the bytes) of files that validated in this process: the same bytes validate
# the same way, and `gate verify` or a stage reads a graph or a manifest many times; forgotten
# past this many
VALIDATED_MAX = 4096
_validated: set[tuple[str, bytes]] = set()
_PLAIN_KEY = re.compile(r"[A-Za-z0-9_.:@/-]+")


@functools.cache
def _ecma(pattern: str) -> re.Pattern:
    r"""JSON Schema patterns are ECMA-262: `$` ends the string. Python's `$` also matches before a
    final newline ('a\n' would pass '^a$'), so a trailing `$` becomes `\Z`."""
    return re.compile(pattern[:-1] + r"\Z" if re.search(r"(?<!\\)\$$", pattern) else pattern)


def _pattern(validator, pattern, instance, schema):
    if validator.is_type(instance, "string") and not _ecma(pattern).search(instance):
        yield jsonschema.ValidationError(f"{instance!r} does not match {pattern!r}")


def _is_integer(checker, instance) -> bool:
    """A JSON integer is written without a fraction or exponent: 2.0 is not one (nor an integer
    past 64 bits, which orjson reads as a float), though draft 2020-12 lets such floats pass."""
    return isinstance(instance, int) and not isinstance(instance, bool)


_Validator = jsonschema.validators.extend(
    jsonschema.Draft202012Validator, {"pattern": _pattern},
    type_checker=jsonschema.Draft202012Validator.TYPE_CHECKER.redefine("integer", _is_integer))


def _inlined(node: Any, defs: dict, inside: tuple = ()) -> Any:
    """`node` with every `{"$ref": "#/$defs/NAME"}` (nothing beside it) replaced by that entry,
    itself inlined, unless the entry refers back to itself. The same schema, but a large file
    (a network export of thousands of layers) no longer resolves a reference per value: a
    third of its validation time."""
    if isinstance(node, list):
        return [_inlined(v, defs, inside) for v in node]
    if not isinstance(node, dict):
        return node
    ref = node.get("$ref") if len(node) == 1 else None
    name = ref[len("#/$defs/"):] if isinstance(ref, str) and ref.startswith("#/$defs/") else None
    if name in defs and name not in inside:
        return _inlined(defs[name], defs, inside + (name,))
    return {k: v if k == "$defs" else _inlined(v, defs, inside) for k, v in node.items()}


@functools.cache
def _validator(schema_name: str):
    """`NAME` (schemas/NAME.schema.json) or `NAME#DEF`, that schema's `$defs` entry DEF: a
    section of a file checked on its own; its local references inlined (`_inlined`). The schemas
    ship with the package, and a test checks them against the metaschema: no process checks them
    again."""
    name, _, part = schema_name.partition("#")
    schema = orjson.loads((SCHEMA_DIR / f"{name}.schema.json").read_bytes())
    if part:
        schema = {"$defs": schema["$defs"], "$ref": f"#/$defs/{part}"}
    return _Validator(_inlined(schema, schema.get("$defs", {})))


def json_path(parts) -> str:
    """`$.a[0].b`; a key that is not plain is quoted (JSON, ASCII), so the path is one line."""
    out = "$"
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        else:
            out += f".{excerpt(p, 80)}" if _PLAIN_KEY.fullmatch(p) else \
                f"[{excerpt(json.dumps(p), 80)}]"
    return out


def excerpt(text: str, limit: int = EXCERPT_CHARS) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


# a branch of a oneOf/anyOf failing with one of these at its top is not the one the value meant
_SHAPE_VALIDATORS = frozenset({"required", "additionalProperties", "type", "const", "enum"})


def _intended(error):
    """For a value that matches no branch of a oneOf/anyOf: the error inside the one branch
    whose shape it has (its keys and type), e.g. `$.kernel.function`, not the whole `$.kernel`;
    the error itself when no single branch is meant."""
    while error.validator in ("oneOf", "anyOf") and error.context:
        branches: dict[int, list] = {}
        for e in error.context:
            branches.setdefault(e.relative_schema_path[0], []).append(e)
        meant = [errors for errors in branches.values() if not any(
            e.validator in _SHAPE_VALIDATORS and not e.relative_path for e in errors)]
        if len(meant) != 1:
            break
        error = jsonschema.exceptions.best_match(meant[0])
    return error


def validate(obj: Any, schema_name: str, where: str | os.PathLike) -> None:
    """Raise UserError for the most relevant schema violation, naming `where` and the JSON path;
    the offending value is quoted only up to EXCERPT_CHARS."""
    error = jsonschema.exceptions.best_match(_validator(schema_name).iter_errors(obj))
    if error is not None:
        error = _intended(error)
        value = repr(error.instance)
        message = error.message.replace(value, excerpt(value)) if len(value) > EXCERPT_CHARS \
            else error.message
        raise UserError(f"{shown(where)}: {json_path(error.absolute_path)}: "
                        f"{excerpt(message, 2 * EXCERPT_CHARS)} "
                        f"(expected a valid {schema_name} file)")


def validate_written(obj: Any, schema_name: str, where: str | os.PathLike) -> None:
    """`validate` on `obj` as its file will read back (a non-finite figure is null there)."""
    validate(orjson.loads(dumps(obj, human=False)), schema_name, where)


def dumps(obj: Any, human: bool = True, sort_keys: bool = True) -> bytes:
    """Sorted keys unless the order of a file's keys means something (`sort_keys=False`: a
    FlashInfer-Bench Definition's inputs are its reference's arguments, in order)."""
    option = (orjson.OPT_SORT_KEYS if sort_keys else 0) | orjson.OPT_SERIALIZE_NUMPY
    if human:
        option |= orjson.OPT_INDENT_2
    return orjson.dumps(obj, option=option) + (b"\n" if human else b"")


def write_json(path: str | os.PathLike, obj: Any, schema: str | None, human: bool = True,
               sort_keys: bool = True) -> Path:
    if schema is not None:
        validate(obj, schema, path)
    return atomic_write_bytes(path, dumps(obj, human, sort_keys))


class _DuplicateKey(Exception):
    pass


def _unique_pairs(pairs: list) -> dict:
    out = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


# A quote then `:` only follows a key, or an escaped quote inside a string; these break counting.
_HIDDEN_KEY = re.compile(rb'"\s+:|\\u00(?:22|3[aA])')


def _check_depth_and_keys(path: Path, data: bytes, obj: Any) -> None:
    """Refuse nesting deeper than orjson writes (255 levels) and a repeated key in any object.
    Fast path: with no whitespace before a colon and no \\u-escaped quote or colon, every `":`
    in the text is a key or sits inside a string, as in orjson's own compact output, so equal
    counts prove no key was dropped. Otherwise (or on a difference) parse again with a hook that
    sees every pair."""
    try:
        compact = orjson.dumps(obj)
    except orjson.JSONEncodeError:
        raise UserError(f"{shown(path)}: JSON nested more than 255 levels deep") from None
    if not _HIDDEN_KEY.search(data) and data.count(b'":') == compact.count(b'":'):
        return
    try:
        json.loads(data, object_pairs_hook=_unique_pairs)
    except _DuplicateKey as e:
        raise UserError(f"{shown(path)}: duplicate key {excerpt(json.dumps(e.args[0]))} in a JSON "
                        f"object (each key may appear once)") from None


def _nul_path(obj: Any, parts: tuple = ()) -> tuple | None:
    """The JSON path of the first key or string holding U+0000, or None."""
    if isinstance(obj, str):
        return parts if "\0" in obj else None
    items = obj.items() if isinstance(obj, dict) else \
        enumerate(obj) if isinstance(obj, list) else ()
    for key, value in items:
        if isinstance(key, str) and "\0" in key:
            return (*parts, key)
        found = _nul_path(value, (*parts, key))
        if found is not None:
            return found
    return None


def _check_no_nul(path: Path, data: bytes, obj: Any) -> None:
    """Refuse a NUL character anywhere: no path or name of ours holds one, and the OS refuses a
    path with one (a ValueError deep inside os calls). JSON can only write it escaped."""
    if b"\\u0000" not in data:
        return
    at = _nul_path(obj)
    if at is not None:
        raise UserError(f"{shown(path)}: {json_path(at)}: holds a NUL character (\\u0000); "
                        f"trtmc reads no JSON string with one")


def read_json(path: str | os.PathLike, schema: str | None, *,
              before: Callable[[Any], None] | None = None) -> Any:
    path = Path(path)
    return parse_json(read_regular(path, MAX_JSON_BYTES, "pipeline.jsonio.MAX_JSON_BYTES"),
                      schema, path, before=before)


def parse_json(data: bytes, schema: str | None, path: str | os.PathLike, *,
               before: Callable[[Any], None] | None = None) -> Any:
    """`data`, read from `path` (which errors name), as JSON: unique keys, bounded depth, then
    `before` (a cheaper check that should speak first, every time), and valid against `schema`
    when one is given (bytes that validated before in this process are not validated again:
    `_validated`)."""
    path = Path(path)
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise UserError(f"{shown(path)}: not valid JSON ({excerpt(str(e))})") from None
    _check_depth_and_keys(path, data, obj)
    _check_no_nul(path, data, obj)
    if before is not None:
        before(obj)
    if schema is not None:
        key = (schema, hashlib.sha256(data).digest())
        if key not in _validated:
            validate(obj, schema, path)
            if len(_validated) >= VALIDATED_MAX:
                _validated.clear()
            _validated.add(key)
    return obj


def parse_object(text: str, where: str, what: str) -> dict:
    """`text`, a JSON object of `what` given as a flag's or an environment variable's value
    (`where` names it in errors), read as strictly as a file is (`parse_json`)."""
    value = parse_json(text.encode("utf-8", "surrogateescape"), None, where)
    if not isinstance(value, dict):
        raise UserError(f"{where}: expected a JSON object of {what}, got {type(value).__name__}")
    return value
