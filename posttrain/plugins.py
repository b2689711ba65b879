"""Code a user plugs in by name: `package.module:attribute` import paths (as TRL's CLI
takes reward functions) and installed entry points.

Import paths resolve with the workspace's folder first on Python's path: a workspace
keeps its own modules in `custom/` (`custom.mytask:make_env`), versioned by git and a
DVC dependency of every stage that runs them (dvc.yaml), so editing one reruns them.
The workspace is the current folder of a stage process (DVC runs it there), and the one
a caller names with `workspace(root)` elsewhere (the flow, which never changes folder):
relative paths the config gives are resolved against it too (`resolve`).

A config is code the user runs, but an import path names a plug-in: a function or class
of the user's own module or of an installed package, never the standard library or
builtins (`os:system` would run a command at `posttrain check`) nor posttrain's own
internals (its built-ins go by name). A module is imported with a time limit, and what
plug-in code raises (at import, or later: `plugin_failures`) is one line naming the
plug-in and its own last frame.
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import functools
import importlib
import os
import re
import stat
import sys
import threading
import traceback
from importlib.metadata import entry_points
from pathlib import Path

from pydantic import ValidationError

from posttrain.errors import OptionError, UserError
from posttrain.yamlfile import show

CUSTOM_DIR = "custom"  # a workspace's own code: on the import path, a DVC dependency of the stages
_IMPORT_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
# a module that sleeps or waits on a server at import would block `posttrain check` for ever
IMPORT_SECONDS_ENV, IMPORT_SECONDS = "POSTTRAIN_PLUGIN_IMPORT_SECONDS", 60.0
NOT_PLUGINS = frozenset(sys.stdlib_module_names) | {"__main__"}  # what an import path may not name
WHAT_A_PLUGIN_IS = (f"name a function or class in your own module (e.g. {CUSTOM_DIR}.mytask:make_env, in "
                    f"{CUSTOM_DIR}/mytask.py) or in an installed package")
PLUGIN_PACKAGES: set[str] = set()  # top-level packages of the plug-ins loaded here: whose frames are plug-in code
_STUCK: dict[str, str] = {}  # modules whose import did not finish in time -> where it waited


_WORKSPACE: contextvars.ContextVar[Path | None] = contextvars.ContextVar("posttrain_workspace", default=None)


def workspace_root() -> Path:
    """The workspace whose code and files the config names: the one `workspace(root)`
    named, else the current folder (a stage process runs in its workspace)."""
    return _WORKSPACE.get() or Path.cwd()


@contextlib.contextmanager
def workspace(root: str | Path):
    """Within the block (this thread, and the Prefect tasks it runs), `root` is the
    workspace: its `custom/` is imported first, relative config paths are its."""
    token = _WORKSPACE.set(Path(root).resolve())
    try:
        yield
    finally:
        _WORKSPACE.reset(token)


def resolve(path: str | Path) -> Path:
    """A path the config gives, as the workspace sees it (relative ones are its)."""
    return workspace_root() / path


class PluginError(ValueError):
    """A name that does not load: what went wrong and the fix (the caller adds the field)."""

    def __init__(self, problem: str, fix: str):
        super().__init__(f"{problem}; fix: {fix}")
        self.problem, self.fix = problem, fix


# The ways the protocol lets a plug-in refuse its input (each its own one-line message), and
# a refusal already made here: not failures of the plug-in's code.
REFUSALS = (UserError, OptionError, PluginError, ValidationError)


def is_import_path(name: str) -> bool:
    """`package.module:attribute` (dotted on both sides)."""
    return bool(_IMPORT_PATH.fullmatch(name))


@contextlib.contextmanager
def _workspace_first():
    here = str(workspace_root())
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
    """The object `module:attribute` names; PluginError when it names no plug-in (the
    standard library, posttrain's internals), when the module does not import (its own
    error, one line) or does not finish importing in time, or has no such attribute."""
    if not is_import_path(path):
        raise PluginError(f"{show(path)} is not an import path", "write it as package.module:attribute")
    module_name, _, attribute = path.partition(":")
    _check_module_name(path, module_name)
    with _workspace_first():
        try:
            obj = import_in_time(module_name)
        except (UserError, PluginError):  # the time limit's
            raise
        except (Exception, SystemExit) as err:  # whatever the user's module raises on import, as one line
            where = f" (looked in {workspace_root()}, then sys.path)" if isinstance(err, ModuleNotFoundError) else ""
            frame = "" if isinstance(err, ImportError) else plugin_frame(err.__traceback__, module_name)
            raise PluginError(f"import of {show(module_name)} failed: {describe(err)}{frame}{where}",
                              f"make {show(module_name)} importable from the workspace (e.g. {CUSTOM_DIR}/...py) "
                              "or install its package") from None
    PLUGIN_PACKAGES.add(module_name.split(".")[0])
    for part in attribute.split("."):
        if not hasattr(obj, part):
            raise PluginError(f"module {show(module_name)} has no attribute {show(attribute)}",
                              f"name one of {sorted(n for n in vars(obj) if not n.startswith('_'))[:12]}")
        obj = getattr(obj, part)
    check_plugin(path, obj)
    return obj


def _check_module_name(path: str, module_name: str) -> None:
    """Refused before anything is imported: the standard library (or a module of yours
    named like one: Python finds either) and posttrain's own modules."""
    top = module_name.split(".")[0]
    if top in NOT_PLUGINS:
        raise PluginError(f"{show(path)} names Python's standard library ({top}), not a plug-in",
                          f"{WHAT_A_PLUGIN_IS} (a module of yours named like a standard one: rename it)")
    if top == __name__.split(".")[0]:
        raise PluginError(f"{show(path)} names posttrain's own internals, not a plug-in",
                          f"use a built-in by its name (e.g. data.env: arithmetic), or {WHAT_A_PLUGIN_IS}")


def check_plugin(name: str, obj) -> None:
    """PluginError unless `obj` comes from a plug-in: functions and classes are defined in
    their module (not the standard library, builtins or posttrain, which a module of yours
    may have imported: `from os import system`), other callables by their class."""
    if not callable(obj):  # a Channel, or no plug-in at all: the caller says what it needs
        return
    while isinstance(obj, functools.partial):
        obj = obj.func
    routine = hasattr(obj, "__qualname__")  # a function, class, method or builtin; else an object with __call__
    module = getattr(obj, "__module__", None) if routine else type(obj).__module__
    top = (module or "builtins").split(".")[0]
    if top in NOT_PLUGINS or (routine and top == __name__.split(".")[0]):
        kind = "posttrain's own" if top == __name__.split(".")[0] else "Python's standard library"
        raise PluginError(f"{show(name)} is {getattr(obj, '__qualname__', type(obj).__name__)} of {kind} ({module}), "
                          "not a plug-in", WHAT_A_PLUGIN_IS)


def import_in_time(module_name: str):
    """`importlib.import_module`, on a daemon thread joined for at most
    POSTTRAIN_PLUGIN_IMPORT_SECONDS: a module that blocks at import (a sleep, a server that
    never answers) ends in PluginError naming the line it waits at, never a hang. Ctrl-C
    still interrupts the wait (the join is the main thread's)."""
    limit = import_seconds()
    if module_name in _STUCK:  # still importing on its thread: a second wait would be as long
        raise _too_slow(module_name, limit, _STUCK[module_name])
    if sys.modules.get(module_name) is not None:
        return importlib.import_module(module_name)
    outcome: dict = {}

    def run():
        try:
            outcome["module"] = importlib.import_module(module_name)
        except BaseException as err:  # SystemExit included: handed to the caller, not lost with the thread
            outcome["error"] = err

    thread = threading.Thread(target=run, name=f"import {module_name}", daemon=True)
    thread.start()
    thread.join(limit)
    if thread.is_alive():
        _STUCK[module_name] = _waiting_at(thread, module_name)
        raise _too_slow(module_name, limit, _STUCK[module_name])
    if "error" in outcome:
        raise outcome["error"]
    return outcome["module"]


def _too_slow(module_name: str, limit: float, where: str) -> PluginError:
    return PluginError(f"import of {show(module_name)} did not finish in {limit:g} s{where}",
                       f"do no slow work at import (move it into the factory or function), or raise "
                       f"{IMPORT_SECONDS_ENV}")


def import_seconds() -> float:
    """The import time limit: POSTTRAIN_PLUGIN_IMPORT_SECONDS, else 60 s."""
    text = os.environ.get(IMPORT_SECONDS_ENV, "")
    try:
        seconds = float(text) if text.strip() else IMPORT_SECONDS
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < 86_400:
        raise UserError(IMPORT_SECONDS_ENV, f"{show(text)} is not a number of seconds",
                        f"set it between 0 and 86400, or unset it (default {IMPORT_SECONDS:g})")
    return seconds


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
    check_plugin(name, found)
    return found


def entry_point(group: str, name: str):
    """The object an installed package registered as `name` in entry-point `group`, or
    None when none did."""
    found = list(entry_points(group=group, name=name))
    if not found:
        return None
    module_name = found[0].value.split(":")[0].strip()
    _check_module_name(f"{name} = {found[0].value}", module_name)
    try:
        import_in_time(module_name)
        PLUGIN_PACKAGES.add(module_name.split(".")[0])
        return found[0].load()
    except (UserError, PluginError):  # the time limit's
        raise
    except (Exception, SystemExit) as err:
        raise PluginError(f"entry point {show(name)} of group {show(group)} ({found[0].value}) does not load: "
                          f"{describe(err)}", f"reinstall the package that registers it ({module_name})") from None


def entry_point_names(group: str) -> list[str]:
    return sorted({point.name for point in entry_points(group=group)})


# --- custom/: the user's code, read by imports, DVC, git and the copy into a workspace -----
# what a file in custom/ may not be: reading one blocks (a FIFO), fails or never ends (a device)
MAX_CUSTOM_ENTRIES = 100_000  # the walk's bound (links can multiply what a copy reads)
SPECIAL_FILES = {stat.S_IFIFO: "a named pipe (FIFO)", stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a character device",
                 stat.S_IFBLK: "a block device"}


def check_custom(root: Path) -> None:
    """`root/custom/` (the user's code, imported, hashed by DVC, copied and committed into
    workspaces) holds only files and folders of `root`: UserError naming the first link
    that leads outside `root` (/etc/passwd would be committed as the user's data), to
    nothing or into a loop, and the first special file, before anything reads them. Links
    within `root` are fine: they are copied as what they point at."""
    root, pending, walked = Path(root).resolve(), [(Path(root) / CUSTOM_DIR, frozenset(), None)], 0
    if not os.path.lexists(pending[0][0]):
        return
    while pending:
        # above: the folders (real paths) the copy passes through to reach it; via: the last link on the way
        path, above, via = pending.pop()
        via = path if path.is_symlink() else via
        mode, real = _custom_entry_mode(path, root), Path(os.path.realpath(path))
        if stat.S_ISDIR(mode) and real in above:
            raise UserError(_shown(via or path), f"leads back to {_shown(real)}, a folder that holds it (a loop: "
                            "copying it would never end)", f"remove the link {_shown(via or path)}")
        walked += 1
        if walked > MAX_CUSTOM_ENTRIES:
            raise UserError(_shown(root / CUSTOM_DIR), f"holds over {MAX_CUSTOM_ENTRIES:,} files and folders "
                            "(links included)", "keep code and small files there; version data with DVC (datasets/)")
        if stat.S_ISDIR(mode):
            pending.extend((p, above | {real}, via) for p in sorted(path.iterdir(), reverse=True) if p.name != "__pycache__")
        elif stat.S_IFMT(mode) in SPECIAL_FILES:
            raise UserError(_shown(path), f"is {SPECIAL_FILES[stat.S_IFMT(mode)]}, not a file: reading it blocks or "
                            "fails", f"remove it from {CUSTOM_DIR}/ ({CUSTOM_DIR}/ holds your code and its small files)")


def _custom_entry_mode(path: Path, root: Path) -> int:
    """The mode of what `path` is (a link's target's): UserError when it is a link out of
    `root` or to nothing, or cannot be read."""
    real = Path(os.path.realpath(path))
    link = f"is a link to {os.readlink(path)}" if path.is_symlink() else "is inside a linked folder"
    if not real.is_relative_to(root):
        raise UserError(_shown(path), f"{link}, outside {root} (it would be read and committed as your own)",
                        f"copy the file into {CUSTOM_DIR}/ instead of linking it")
    try:
        mode = path.stat().st_mode
        if stat.S_ISDIR(mode):
            os.listdir(path)
        elif stat.S_ISREG(mode) and not os.access(path, os.R_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
        return mode
    except OSError as err:
        problem = f"{link}, which does not exist" if isinstance(err, FileNotFoundError) else \
            f"cannot be read: {err.strerror}{' (' + link + ')' if path.is_symlink() else ''}"
        raise UserError(_shown(path), problem, f"remove it from {CUSTOM_DIR}/, or copy in what it should hold") from None


def _shown(path: Path) -> str:
    """`path` relative to the workspace when it is under it (how the user names it)."""
    with contextlib.suppress(ValueError):
        return str(path.relative_to(workspace_root()))
    return str(path)


# --- what plug-in code raises --------------------------------------------------------------
def describe(err: BaseException) -> str:
    """`Type: message` on one line, cut short (a plug-in's message may be huge)."""
    if isinstance(err, SystemExit):
        return f"SystemExit: sys.exit({show(err.code)})"
    detail = " ".join(str(err).split())
    return f"{type(err).__name__}: {detail[:200]}{'...' if len(detail) > 200 else ''}"


def plugin_frame(tb, module_name: str | None = None) -> str:
    """` at custom/words.py:12 in generate`: the deepest frame of traceback `tb` in plug-in
    code (a module of `module_name`'s top-level package, or of any plug-in loaded in this
    process), or "" when none is."""
    return _deepest_plugin_frame(list(traceback.walk_tb(tb)), module_name)


def _waiting_at(thread: threading.Thread, module_name: str) -> str:
    """Where `thread` is now, in the plug-in's code (as `plugin_frame`)."""
    frame = sys._current_frames().get(thread.ident)
    return _deepest_plugin_frame(list(traceback.walk_stack(frame))[::-1] if frame else [], module_name)


def _deepest_plugin_frame(frames, module_name: str | None) -> str:
    packages = PLUGIN_PACKAGES | ({module_name.split(".")[0]} if module_name else set())
    mine = [(f, line) for f, line in frames if str(f.f_globals.get("__name__", "")).split(".")[0] in packages]
    if not mine:
        return ""
    frame, line = mine[-1]
    path = Path(frame.f_code.co_filename)
    with contextlib.suppress(ValueError):
        path = path.relative_to(workspace_root())
    return f" at {path}:{line} in {frame.f_code.co_name} ({frame.f_globals['__name__']})"


@contextlib.contextmanager
def plugin_failures(name: str | None = None):
    """Run plug-in code: an exception raised in it (a frame of its traceback is a plug-in's,
    or in `name`'s module) becomes a PluginError naming the plug-in, what it raised and its
    own last frame, in one line. Anything else passes unchanged, as do the refusals the
    protocol provides (REFUSALS) and Ctrl-C."""
    try:
        yield
    except REFUSALS:
        raise
    except (Exception, SystemExit) as err:
        frame = plugin_frame(err.__traceback__, name.partition(":")[0] if name and is_import_path(name) else None)
        if not frame:
            raise
        raise PluginError(f"{show(name) if name else 'a plug-in'} raised {describe(err)}{frame}",
                          "correct the plug-in's code there (its protocol: posttrain/envs/base.py)") from None


@contextlib.contextmanager
def plugin_refusal(where: str, name: str | None = None, log: str | None = None):
    """Plug-in code run for a command: what it raises (`plugin_failures`), and a plug-in
    that does not load, end the command as a UserError at `where` (one line, exit 2),
    naming the `log` that holds its output when there is one."""
    try:
        with plugin_failures(name):
            yield
    except PluginError as err:
        kept = f" (the stage's output: {log})" if log and os.path.isfile(log) else ""
        raise UserError(where, err.problem + kept, err.fix) from None

