"""Code a user plugs in by name: `package.module:attribute` import paths (as TRL's CLI
takes reward functions) and installed entry points.

Import paths resolve with the current folder first on Python's path, as under
`python -m posttrain stage` (the stages' command, run in the workspace): a workspace
keeps its own modules in `custom/` (`custom.mytask:make_env`), versioned by git and a
DVC dependency of every stage that runs them (dvc.yaml), so editing one reruns them.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import sys
from importlib.metadata import entry_points

from posttrain.yamlfile import show

CUSTOM_DIR = "custom"  # a workspace's own code: on the import path, a DVC dependency of the stages
_IMPORT_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


class PluginError(ValueError):
    """A name that does not load: what went wrong and the fix (the caller adds the field)."""

    def __init__(self, problem: str, fix: str):
        super().__init__(f"{problem}; fix: {fix}")
        self.problem, self.fix = problem, fix


def is_import_path(name: str) -> bool:
    """`package.module:attribute` (dotted on both sides)."""
    return bool(_IMPORT_PATH.fullmatch(name))


@contextlib.contextmanager
def _current_folder_first():
    here = os.getcwd()
    added = here not in sys.path
    if added:
        sys.path.insert(0, here)
    try:
        yield
    finally:
        if added:
            with contextlib.suppress(ValueError):
                sys.path.remove(here)


def load_import_path(path: str):
    """The object `module:attribute` names; PluginError when the module does not import
    (its own error, one line) or has no such attribute."""
    if not is_import_path(path):
        raise PluginError(f"{show(path)} is not an import path", "write it as package.module:attribute")
    module_name, _, attribute = path.partition(":")
    with _current_folder_first():
        try:
            obj = importlib.import_module(module_name)
        except Exception as err:  # whatever the user's module raises on import, as one line
            detail = " ".join(str(err).split())[:200]
            where = f" (looked in {os.getcwd()}, then sys.path)" if isinstance(err, ModuleNotFoundError) else ""
            raise PluginError(f"import of {show(module_name)} failed: {type(err).__name__}: {detail}{where}",
                              f"make {show(module_name)} importable from the workspace (e.g. {CUSTOM_DIR}/...py) "
                              "or install its package") from None
    for part in attribute.split("."):
        if not hasattr(obj, part):
            raise PluginError(f"module {show(module_name)} has no attribute {show(attribute)}",
                              f"name one of {sorted(n for n in vars(obj) if not n.startswith('_'))[:12]}")
        obj = getattr(obj, part)
    return obj


def lookup(name: str, registry: dict, what: str, example: str, group: str | None = None):
    """`registry[name]`, else the object an import path names, else the entry point an
    installed package registered as `name` in `group`; PluginError listing the known
    names (`example`: the import path's form) when none of them has it."""
    if name in registry:
        return registry[name]
    if is_import_path(name):
        return load_import_path(name)
    found = entry_point(group, name) if group else None
    if found is None:
        known = sorted(registry) + (entry_point_names(group) if group else [])
        raise PluginError(f"unknown {what} {show(name)}", f"use one of {known}, or an import path {example}")
    return found


def entry_point(group: str, name: str):
    """The object an installed package registered as `name` in entry-point `group`, or
    None when none did."""
    found = list(entry_points(group=group, name=name))
    if not found:
        return None
    try:
        return found[0].load()
    except Exception as err:
        raise PluginError(f"entry point {show(name)} of group {show(group)} ({found[0].value}) does not load: "
                          f"{type(err).__name__}: {' '.join(str(err).split())[:200]}",
                          f"reinstall the package that registers it ({found[0].value.split(':')[0]})") from None


def entry_point_names(group: str) -> list[str]:
    return sorted({point.name for point in entry_points(group=group)})
