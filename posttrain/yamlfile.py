"""Reading YAML a user wrote, safely, and turning a schema error into one line.

Safe loading only (no Python objects), a size limit checked before reading, a bound on
what aliases expand to and on nesting, UTF-8 only; every problem is a `UserError` that
never quotes more than `SHOWN_CHARS` of the content. The config loader and the GPU
profiles both read their files here.
"""

from __future__ import annotations

import reprlib
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from posttrain.errors import UserError

MAX_CONFIG_BYTES = 1_000_000   # a config is a few KiB; refuse a huge file before reading it
MAX_YAML_NODES = 100_000       # values a document may expand to through its aliases
MAX_YAML_DEPTH = 100           # levels of `[` / `{` a document may nest
SHOWN_CHARS = 60               # of a value quoted in an error line

_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = SHOWN_CHARS
_SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxdict = 2, 4, 4


def show(value: Any) -> str:
    """`repr(value)` cut to SHOWN_CHARS: an error line never carries a huge input
    (reprlib stops early, so a deeply shared structure is not walked whole)."""
    text = _SHORT.repr(value)
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS - 3] + "..."


def read_text(path: Path, *, limit: int = MAX_CONFIG_BYTES) -> str:
    """The file's text; `UserError` at once when it is over `limit` bytes (parsing a huge
    file takes minutes) or is not UTF-8."""
    size = path.stat().st_size
    if size > limit:
        raise UserError(str(path), f"the file is {size:,} bytes, over the {limit:,}-byte limit",
                        "point at the right file (a config is a few KiB)")
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise UserError(str(path), f"not UTF-8 text (byte {err.start})", "save the file as UTF-8") from None


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a document whose aliases expand past MAX_YAML_NODES
    (a "billion laughs" file is tiny but expands exponentially once anything walks it),
    or whose `[` / `{` nest past MAX_YAML_DEPTH (PyYAML's scanner is quadratic in it)."""

    def construct_document(self, node):
        if _expanded_size(node, {}, set()) > MAX_YAML_NODES:
            raise _TooLarge
        return super().construct_document(node)

    def fetch_flow_collection_start(self, TokenClass):
        if self.flow_level >= MAX_YAML_DEPTH:
            raise RecursionError  # reported as the composer's own: nested too deeply
        super().fetch_flow_collection_start(TokenClass)


class _TooLarge(Exception):
    pass


def _expanded_size(node, sizes: dict, open_: set) -> int:
    """Values under `node` with every alias expanded, counted once per node (memoised),
    stopping past the bound; a node that contains itself counts as unbounded."""
    key = id(node)
    if key in sizes or key in open_:
        return sizes.get(key, MAX_YAML_NODES + 1)
    open_.add(key)
    children = node.value if isinstance(node, yaml.SequenceNode) else (
        [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else [])
    total = 1
    for child in children:
        total += _expanded_size(child, sizes, open_)
        if total > MAX_YAML_NODES:
            break
    open_.discard(key)
    sizes[key] = total
    return total


def read_yaml(path: Path) -> Any:
    """A YAML file's content, safely: no Python objects, bounded size and expansion, and
    any problem a one-line `UserError` that never quotes the content."""
    text = read_text(path)
    try:
        return yaml.load(text, Loader=_BoundedLoader)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        line = f" at line {mark.line + 1}" if mark else ""
        raise UserError(str(path), f"not valid YAML{line}", "fix the YAML syntax") from None
    except _TooLarge:
        raise UserError(str(path), f"expands to over {MAX_YAML_NODES:,} values (each use of an alias counts)",
                        "write a smaller config, without aliases of aliases") from None
    except RecursionError:
        raise UserError(str(path), "nested too deeply", "flatten the YAML structure") from None


def _field_path(loc: tuple) -> str:
    parts = [str(p)[:SHOWN_CHARS] for p in loc]
    return "".join(f"[{p}]" if isinstance(q, int) else f".{p}" for p, q in zip(parts, loc)).lstrip(".")


def schema_error(where: str, err: ValidationError, prefix: tuple = (), options: list[str] | None = None) -> UserError:
    """The first schema error as a one-line `UserError` at `where: <prefix>.<field>`;
    `options`: the valid keys, named in the fix for an unknown one."""
    first = err.errors()[0]
    field = _field_path((*prefix, *first["loc"]))
    at = f"{where}: {field}" if where and field else where or field
    if first["type"] == "posttrain":
        return UserError(at, first["ctx"]["problem"], first["ctx"]["fix"])
    if first["type"] == "extra_forbidden":
        fix = f"use one of {options}" if options else "remove it or check its spelling (see README, Config)"
        return UserError(at, "unknown option" if options else "unknown key", fix)
    if first["type"] == "value_error":
        return UserError(at, first["msg"].removeprefix("Value error, "), "see README, Config")
    if first["type"] == "missing":
        return UserError(at, "required key is missing", "add it (see README, Config)")
    got = first.get("input")
    fix = f"set a valid value (got {show(got)})"
    if first["type"].startswith(("int_", "float_")) and isinstance(got, str):
        fix = f"write a number, not text (got {show(got)}; YAML reads 1e-4 as text, 1.0e-4 as a number)"
    return UserError(at, first["msg"].replace("\n", " ")[:200], fix)
