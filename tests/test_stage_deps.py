"""dvc.yaml's `deps` hold every library file a stage command runs (issue 12, stale results).

A stage's `cmd` is `posttrain stage <name>`: it runs posttrain/cli.py, which loads the
config (posttrain/config.py, which loads the environments and the rewards) and imports
posttrain/stages/<name>.py by name. From those files the walk below follows the imports
through the posttrain package statically (`ast`), lazy ones inside functions included,
and also `python -m posttrain.<module>` subprocesses, `posttrain.<module>:<name>` import
paths, every module of a plug-in folder (environments load by name) and data files a
module names beside itself ("gpus.yaml"). A file a stage can run and its deps miss is a
stale result: DVC would call the stage up to date after that file changed.

Of cli.py only what `posttrain stage` runs counts: its module body and the functions
reached from `main`, leaving out the branches of `args.command == "<another command>"`
(otherwise every stage would rerun when `posttrain compare` changes).
"""

from __future__ import annotations

import ast
import json
import re
from collections import deque
from importlib.metadata import entry_points
from pathlib import Path

import mlflow
import pytest
import yaml

from conftest import copy_workspace, sh

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "posttrain"
ENTRY = ("posttrain/__main__.py", "posttrain/cli.py", "posttrain/config.py")  # what every `python -m posttrain stage` runs
CLI_ENTRY = ("posttrain/cli.py", "main")              # pyproject: posttrain = "posttrain.cli:main"
PLUGINS = {"posttrain/envs": "posttrain.envs"}        # plug-in folder -> its entry-point group


def rel(path: Path, root: Path = REPO) -> str:
    return path.relative_to(root).as_posix()


def module_path(name: str, root: Path = REPO) -> str | None:
    """`posttrain.x.y` -> "posttrain/x/y.py" (or ".../y/__init__.py"); None outside the package."""
    if name.split(".")[0] != PACKAGE:
        return None
    base = root.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return rel(candidate, root)
    return None


def module_name(path: str) -> str:
    parts = path.removesuffix(".py").split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def other_command_branch(node: ast.AST) -> bool:
    """`if args.command == "compare":` and the like: code `posttrain stage` never runs."""
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
            and isinstance(node.test.left, ast.Attribute) and node.test.left.attr == "command"
            and len(node.test.ops) == 1 and isinstance(node.test.ops[0], ast.Eq)
            and isinstance(node.test.comparators[0], ast.Constant) and node.test.comparators[0].value != "stage")


def walk_pruned(node: ast.AST):
    """`ast.walk`, skipping the body of other commands' branches (their `elif`s stay)."""
    todo = [node]
    while todo:
        node = todo.pop()
        yield node
        todo.extend(node.orelse if other_command_branch(node) else ast.iter_child_nodes(node))


def stage_command_nodes(tree: ast.Module, entry: str) -> list[ast.AST]:
    """cli.py's code that `posttrain stage` runs: the module body, then each top-level
    function named (called or passed on) by code already reached, from `entry` on."""
    functions = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    reached = [n for n in tree.body if n not in functions.values()] + [functions[entry]]
    seen = {entry}
    for node in reached:   # grows while it is read
        for child in walk_pruned(node):
            if isinstance(child, ast.Name) and child.id in functions and child.id not in seen:
                seen.add(child.id)
                reached.append(functions[child.id])
    return reached


def references(path: str, root: Path = REPO) -> set[str]:
    """The package files that running `path` can run or read."""
    tree = ast.parse((root / path).read_text(), filename=path)
    here = module_name(path)
    package = here if path.endswith("__init__.py") else here.rpartition(".")[0]
    if path == CLI_ENTRY[0]:
        nodes = (child for top in stage_command_nodes(tree, CLI_ENTRY[1]) for child in walk_pruned(top))
    else:
        nodes = ast.walk(tree)
    names, found, folder = [], set(), (root / path).parent
    for node in nodes:
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(filter(None, [package.rsplit(".", node.level - 1)[0] if node.level else "", node.module]))
            names += [base] + [f"{base}.{alias.name}" for alias in node.names]
        elif isinstance(node, (ast.List, ast.Tuple)):   # [sys.executable, "-m", "posttrain.vllm_engine.sample", ...]
            values = [e.value if isinstance(e, ast.Constant) else None for e in node.elts]
            names += [value for flag, value in zip(values, values[1:]) if flag == "-m" and isinstance(value, str)]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if re.fullmatch(rf"{PACKAGE}(\.\w+)+:\w+", node.value):   # an import path "pkg.module:factory"
                names.append(node.value.partition(":")[0])
            elif (re.fullmatch(r"[\w.-]+(/[\w.-]+)*", node.value) and not node.value.endswith(".py")
                  and (folder / node.value).is_file()):
                found.add(rel(folder / node.value, root))   # package data beside the module
    return found | {p for p in map(lambda n: module_path(n, root), names) if p}


def package_inits(path: str, root: Path = REPO) -> list[str]:
    """The `__init__.py` files Python runs before `path`: its packages'."""
    parts = path.split("/")[:-1]
    inits = ["/".join(parts[:i] + ["__init__.py"]) for i in range(1, len(parts) + 1)]
    return [p for p in inits if p != path and (root / p).is_file()]


def plugin_modules(folder: str, group: str, root: Path = REPO) -> list[str]:
    """What a plug-in folder can load by name: its own modules, and the installed entry
    points of its group that live in the package."""
    own = [rel(p, root) for p in (root / folder).rglob("*.py") if "__pycache__" not in p.parts]
    points = [module_path(point.module, root) for point in entry_points(group=group)]
    return own + [p for p in points if p]


def reach(stage: str, root: Path = REPO) -> dict[str, str | None]:
    """Every package file `posttrain stage <stage>` can run -> the file that led to it."""
    via: dict[str, str | None] = {}
    todo: deque[str] = deque()   # breadth first: `chain` gives a shortest import chain

    def add(path: str, parent: str | None) -> None:
        if path not in via:
            via[path] = parent
            todo.append(path)

    for entry in (*ENTRY, f"{PACKAGE}/stages/{stage}.py"):
        add(entry, None)
    while todo:
        path = todo.popleft()
        found = package_inits(path, root) + (sorted(references(path, root)) if path.endswith(".py") else [])
        for folder, group in PLUGINS.items():
            if path.startswith(folder + "/"):
                found += plugin_modules(folder, group, root)
        for other in found:
            add(other, path)
    return via


def chain(via: dict[str, str | None], path: str) -> str:
    """How the command comes to run `path`: "a -> b -> path"."""
    if via[path] is None:
        return "the command runs it directly"
    steps = [path]
    while via[steps[-1]]:
        steps.append(via[steps[-1]])
    return " -> ".join(reversed(steps))


def dvc_stages(root: Path = REPO) -> dict[str, tuple[str, str | None, list[str]]]:
    """dvc.yaml's stages: name -> (where their deps are, the `posttrain stage` they run, deps).
    A `foreach` stage (grpo: one DVC stage per GRPO stage) lists them under `do:`."""
    stages = {}
    for name, stage in yaml.safe_load((root / "dvc.yaml").read_text())["stages"].items():
        body, where = (stage["do"], f"stages.{name}.do.deps") if "foreach" in stage else (stage, f"stages.{name}.deps")
        command = re.search(r"\bposttrain stage (\w+)", body["cmd"])
        stages[name] = (where, command and command.group(1), [str(d).rstrip("/") for d in body.get("deps", [])])
    return stages


def covered(path: str, deps: list[str]) -> bool:
    return any(path == dep or path.startswith(dep + "/") for dep in deps)


def missing_deps(root: Path = REPO) -> list[str]:
    """One line per file a stage can run and its deps miss: which path to add where."""
    lines = []
    for name, (where, stage, deps) in dvc_stages(root).items():
        if stage is None:
            lines.append(f"dvc.yaml stages.{name}: its cmd is not `posttrain stage NAME`; teach {__file__} "
                         "which files it runs")
            continue
        via = reach(stage, root)
        lines += [f"dvc.yaml {where}: add `- {path}`  ({chain(via, path)})"
                  for path in sorted(via) if not covered(path, deps)]
    return lines


# --- the walk itself: one case per line -------------------------------------------------
@pytest.mark.parametrize("stage, path, reached", [
    ("sft", "posttrain/sandbox.py", True),            # stages/sft -> envs -> envs/sql -> sandbox
    ("sft", "posttrain/scoring/evaluation.py", True),         # a top-level import of the stage module
    ("grpo", "posttrain/config.py", True),            # every stage loads the config
    ("grpo", "posttrain/training/checkpoints.py", True),       # `from posttrain import checkpoints`
    ("prepare", "posttrain/scoring/rewards.py", True),        # config.py imports it inside a function
    ("prepare", "posttrain/envs/arithmetic.py", True),  # environments load by name
    ("evaluate", "posttrain/vllm_engine/sample.py", True),   # `python -m posttrain.vllm_engine.sample` subprocess
    ("serving", "posttrain/vllm_engine/loadtest.py", True),       # imported inside a function
    ("prepare", "posttrain/__init__.py", True),       # runs before any posttrain module
    ("serving", "posttrain/training/trainer.py", False),      # only the training stages import it
    ("sft", "posttrain/tracking/compare.py", False),           # cli.py imports it for `posttrain compare` only
    ("sft", "posttrain/stages/grpo.py", False),       # cli.py imports the one stage it runs
])
def test_the_walk_finds_what_a_stage_runs(stage, path, reached):
    via = reach(stage)
    assert (path in via) is reached, chain(via, path) if path in via else f"{path} not reached"


def test_the_walk_follows_import_paths_and_package_data(tmp_path):
    (tmp_path / PACKAGE / "stages").mkdir(parents=True)
    for path, text in {
        "posttrain/__init__.py": "", "posttrain/__main__.py": "", "posttrain/stages/__init__.py": "",
        "posttrain/config.py": "", "posttrain/cli.py": ('def main():\n    if args.command == "compare":\n        import posttrain.compare\n'
                             '    elif args.command == "stage":\n        import posttrain.errors\n'),
        "posttrain/stages/x.py": 'PLUGIN = "posttrain.plugin:make"\nfrom . import helper\n',
        "posttrain/plugin.py": 'PROFILES = "profiles.yaml"\n', "posttrain/profiles.yaml": "",
        "posttrain/stages/helper.py": "", "posttrain/compare.py": "", "posttrain/errors.py": "",
    }.items():
        (tmp_path / path).write_text(text)
    assert set(reach("x", tmp_path)) == {
        "posttrain/__init__.py", "posttrain/__main__.py", "posttrain/stages/__init__.py", "posttrain/config.py",
        "posttrain/cli.py", "posttrain/errors.py", "posttrain/stages/x.py", "posttrain/plugin.py", "posttrain/stages/helper.py",
        "posttrain/profiles.yaml"}


# --- dvc.yaml against the walk ----------------------------------------------------------
def test_every_stage_depends_on_all_the_code_it_runs():
    missing = missing_deps()
    assert not missing, "dvc.yaml misses code its stages run (stale results):\n" + "\n".join(missing)


def test_no_stage_depends_on_code_it_never_runs():
    extra = []
    for name, (where, stage, deps) in dvc_stages().items():
        reached = reach(stage) if stage else {}
        extra += [f"dvc.yaml {where}: remove `- {dep}` (`posttrain stage {stage}` never runs it)"
                  for dep in deps if dep.split("/")[0] == PACKAGE and not any(covered(p, [dep]) for p in reached)]
    assert not extra, "\n".join(extra)


def test_folder_deps_in_the_package_ignore_bytecode():
    """A folder dep hashes every file under it: Python's `__pycache__` would change it
    whenever the interpreter or a copy (posttrain.workspace.copy_code) differs."""
    folders = [dep for where, _, deps in dvc_stages().values() for dep in deps
               if dep.split("/")[0] == PACKAGE and (REPO / dep).is_dir()]
    ignored = (REPO / ".dvcignore").read_text().split() if (REPO / ".dvcignore").is_file() else []
    assert not folders or "__pycache__/" in ignored, (
        f"dvc.yaml lists package folders {folders}: add `__pycache__/` to .dvcignore, or list their files")


# --- the same in a real workspace, through DVC and the flow --------------------------------
def dvc_changed(ws: Path) -> dict[str, set[str]]:
    """`dvc status`: DVC stage name -> its changed deps."""
    status = json.loads(sh("dvc", "status", "--json", cwd=ws).stdout or "{}")
    return {stage: {path for change in changes if isinstance(change, dict)
                    for path in change.get("changed deps", {})} for stage, changes in status.items()}


@pytest.mark.slow
def test_a_changed_module_reruns_the_stages_that_run_it(flow_runs, tmp_path):
    # a copy of the workspace tests/test_flow.py ran: every stage is up to date
    ws = copy_workspace(flow_runs[0], tmp_path / "ws")
    assert dvc_changed(ws) == {}

    # every library file changed at once: each DVC stage sees all the code its command runs
    sources = {p: p.read_text() for p in (ws / PACKAGE).rglob("*.py")}
    for path, text in sources.items():
        path.write_text(text + "\n# changed by the stale-results test\n")
    changed = dvc_changed(ws)
    for path, text in sources.items():
        path.write_text(text)
    stages = dvc_stages(ws)
    for name in ("prepare", "sft", "grpo@dense", "serving", "evaluate"):
        via = reach(stages[name.partition("@")[0]][1], ws)
        unseen = [p for p in via if p.endswith(".py") and not covered(p, sorted(changed.get(name, ())))]
        assert not unseen, f"dvc status misses changes to {unseen} in stage {name}"

    # the evaluator changed: DVC finds sft, grpo and evaluate stale, not prepare or serving
    evaluation = ws / PACKAGE / "scoring" / "evaluation.py"
    original = evaluation.read_text()
    evaluation.write_text(original + "# a changed evaluator\n")
    assert set(dvc_changed(ws)) == {"sft", "grpo@dense", "evaluate"}
    evaluation.write_text(original)
    assert dvc_changed(ws) == {}

    # the KV arithmetic changed: DVC finds serving stale, and the flow reruns it alone
    kv = ws / PACKAGE / "capacity" / "kv.py"
    kv.write_text(kv.read_text() + "# a changed KV estimator\n")
    assert set(dvc_changed(ws)) == {"serving"}
    sh("posttrain", "run", "--workdir", ws, cwd=ws)
    mlflow.set_tracking_uri(f"sqlite:///{ws / 'mlflow.db'}")
    runs = mlflow.search_runs(search_all_experiments=True, order_by=["start_time DESC"])
    last = runs[runs["tags.posttrain.flow"] == "retrain"].iloc[0].run_id       # the rerun's parent run
    children = runs[runs["tags.mlflow.parentRunId"] == last].set_index("tags.mlflow.runName")
    cached = {stage: tag == "true" for stage, tag in children["tags.posttrain.cached"].items()}
    assert cached == {"prepare": True, "sft": True, "grpo@dense": True, "serving": False, "evaluate": True}
    assert dvc_changed(ws) == {}
