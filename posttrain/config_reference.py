"""The config reference (docs/config.md), written from the schema in posttrain/config.py.

    python -m posttrain.config_reference > docs/config.md     # what `make docs` runs
    python -m posttrain.config_reference --check docs/config.md

Every section of `PipelineConfig` becomes a heading with its class docstring and a table
of its fields: YAML key, type, default, constraints and the field's `description`. The
schema is the one source: a field added without a description is listed by
`undocumented()` (and fails tests/test_docs.py), and a reference that no longer matches
the schema fails the same test, naming the command that rewrites it. Imports only the
schema module, pydantic and the standard library, so it runs without TRL or torch.
"""

from __future__ import annotations

import argparse
import inspect
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from posttrain.config import GRPOStage, PipelineConfig

COMMAND = "python -m posttrain.config_reference > docs/config.md"
# How a dict of sections is addressed in YAML: `grpo.<name>.rewards`.
ENTRY = {GRPOStage: "<name>"}
# pydantic keeps each bound as an annotated_types object holding one of these attributes.
BOUNDS = (("gt", "> {}"), ("ge", ">= {}"), ("lt", "< {}"), ("le", "<= {}"),
          ("min_length", "length >= {}"), ("max_length", "length <= {}"))

HEADER = f"""# Config reference

Generated from the field descriptions in `posttrain/config.py` by `{COMMAND}`
(`make docs`); do not edit by hand: tests/test_docs.py fails when this page and the
schema differ. How a config file is read (`extends`, limits, the options of each
environment, TRL's blocks) is in [configuring.md](configuring.md).

Every section and every field is optional unless its default says *required*; unknown
keys are errors. `<name>` stands for a GRPO stage's name.
"""


def sections(model: type[BaseModel] = PipelineConfig, path: str = "",
             found: list[tuple[str, type[BaseModel]]] | None = None) -> list[tuple[str, type[BaseModel]]]:
    """Every section of the schema as (YAML path, class), depth first, each class once
    (`sft.launcher` refers to `launcher`'s table instead of repeating it)."""
    found = [] if found is None else found
    found.append((path, model))
    for name, field in model.model_fields.items():
        inner, suffix = nested(field.annotation)
        if inner is not None and all(inner is not seen for _, seen in found):
            sections(inner, f"{path}.{key(name, field)}{suffix}".lstrip("."), found)
    return found


def nested(annotation: Any) -> tuple[type[BaseModel] | None, str]:
    """The section class inside a field's type (`X`, `X | None`, `dict[str, X]`) and the
    path suffix its fields take (`.<name>` for a dict of sections)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, ""
    args = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
    if typing.get_origin(annotation) is dict and len(args) == 2:
        inner, _ = nested(args[1])
        return inner, "." + ENTRY.get(inner, "<key>") if inner is not None else ""
    if is_union(annotation) and len(args) == 1:
        return nested(args[0])
    return None, ""


def is_union(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType)


def key(name: str, field: FieldInfo) -> str:
    """The key a YAML file writes: the alias when there is one (`from`, not `from_`)."""
    return field.alias or name


def type_name(annotation: Any) -> str:
    """A field's type as a reader of YAML thinks of it: `int`, `str or null`, `one of a, b`."""
    if annotation is type(None):
        return "null"
    if typing.get_origin(annotation) is Literal:
        return "one of " + ", ".join(str(value) for value in typing.get_args(annotation))
    if is_union(annotation):
        return " or ".join(type_name(arg) for arg in typing.get_args(annotation))
    if annotation is Any:
        return "any"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (list, dict):
        return f"{origin.__name__} of " + " to ".join(type_name(arg) for arg in args)
    return getattr(annotation, "__name__", str(annotation))


def default_text(field: FieldInfo) -> str:
    if field.is_required():
        return "*required*"
    value = field.default_factory() if field.default_factory is not None else field.default
    return "(section)" if isinstance(value, BaseModel) else f"`{yaml_value(value)}`"


def yaml_value(value: Any) -> str:
    """A default as YAML writes it (flow style): null, true, [1, 4], {correctness: 1.0}."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(yaml_value(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {yaml_value(v)}" for k, v in value.items()) + "}"
    return str(value)


def constraints(field: FieldInfo) -> str:
    """The bounds pydantic enforces on a field (`>= 1, <= 1024`), from its metadata."""
    shown = [text.format(getattr(item, attribute))
             for item in field.metadata for attribute, text in BOUNDS if hasattr(item, attribute)]
    return ", ".join(shown)


def cell(text: str) -> str:
    """Text safe in a Markdown table cell: pipes escaped, and `<...>` outside code spans
    written as entities so a renderer does not take `<name>` for an HTML tag."""
    parts = text.replace("|", "\\|").replace("\n", " ").split("`")
    return "`".join(part if odd else part.replace("<", "&lt;").replace(">", "&gt;")
                    for odd, part in ((i % 2 == 1, part) for i, part in enumerate(parts)))


def section_text(path: str, model: type[BaseModel], titles: dict[type[BaseModel], str]) -> str:
    """One section: its heading, its docstring, and a table of its fields."""
    lines = [f"## `{path}`" if path else "## Top level", ""]
    doc = inspect.getdoc(model) if model.__doc__ else None
    if doc:
        lines += [cell(" ".join(doc.split())), ""]
    lines += ["| key | type | default | constraints | meaning |", "|---|---|---|---|---|"]
    for name, field in model.model_fields.items():
        inner, _ = nested(field.annotation)
        meaning = field.description or ""
        if inner is not None:
            meaning += f" Fields: section `{titles[inner]}`."
        lines.append(f"| `{key(name, field)}` | {cell(type_name(field.annotation))} | {default_text(field)} "
                     f"| {constraints(field)} | {cell(meaning)} |")
    return "\n".join(lines) + "\n"


def render(model: type[BaseModel] = PipelineConfig) -> str:
    """The whole reference, as docs/config.md holds it."""
    found = sections(model)
    titles = {cls: path or "top level" for path, cls in found}
    return HEADER + "".join("\n" + section_text(path, cls, titles) for path, cls in found)


def undocumented(model: type[BaseModel] = PipelineConfig) -> list[str]:
    """Fields of any section without a `description` (each would show an empty meaning)."""
    return [f"{path or 'top level'}: {name}" for path, cls in sections(model)
            for name, field in cls.model_fields.items() if not (field.description or "").strip()]


def stale(path: Path) -> str | None:
    """Why the reference at `path` is out of date, or None when it matches the schema."""
    if not path.is_file():
        return f"{path} does not exist; write it with `{COMMAND}` (make docs)"
    if path.read_text(encoding="utf-8") != render():
        return f"{path} differs from the schema in posttrain/config.py; rewrite it with `{COMMAND}` (make docs)"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m posttrain.config_reference", description=__doc__.split("\n")[0])
    parser.add_argument("--check", type=Path, metavar="FILE", help="exit 1 if FILE differs from the reference")
    args = parser.parse_args(argv)
    if args.check is None:
        sys.stdout.write(render())
        return 0
    problem = stale(args.check)
    if problem:
        print(f"posttrain: {problem}", file=sys.stderr)
        return 1
    print(f"{args.check} is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
