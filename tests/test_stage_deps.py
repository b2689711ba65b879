"""dvc.yaml's `deps` hold every library file a stage command runs (issue 12, stale results).

A stage's `cmd` is `python -m posttrain stage <name>`: posttrain/__main__.py hands it to
posttrain/stage_entry.py (not the CLI), which loads the config (posttrain/config.py, which
loads the environments and the rewards) and imports posttrain/stages/<name>.py by name. From
those files the walk below follows the imports through the posttrain package statically
(`ast`), lazy ones inside functions included, and also `python -m posttrain.<module>`
subprocesses, `posttrain.<module>:<name>` import paths, every module of a plug-in folder
(environments load by name) and data files a module names beside itself ("gpus.yaml"). A file
a stage can run and its deps miss is a stale result: DVC would call the stage up to date
after that file changed.

Where a module routes `stage` apart from every other command (`if argv[1:2] == ["stage"]:
... else: the CLI`, in __main__.py and the stage host), the `else` is another command's code:
not a stage's (otherwise every stage would rerun when `posttrain compare`'s parser changes).
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
ENTRY = ("posttrain/__main__.py", "posttrain/config.py")  # what every `python -m posttrain stage` runs
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


def other_commands(node: ast.AST) -> list[ast.AST] | None:
    """In `if X == ["stage"]: ... else: ...`, the `else`: what runs for every other command.
    None for any other node."""
    if (isinstance(node, ast.If) and isinstance(node.test, ast.Compare) and len(node.test.ops) == 1
            and isinstance(node.test.ops[0], ast.Eq) and isinstance(node.test.comparators[0], ast.List)
            and [getattr(e, "value", None) for e in node.test.comparators[0].elts] == ["stage"]):
        return node.orelse
    return None


def walk_pruned(node: ast.AST):
    """`ast.walk`, skipping the `else` of a stage-or-another-command branch."""
    todo = [node]
    while todo:
        node = todo.pop()
        yield node
        skipped = other_commands(node) or []
        todo.extend(child for child in ast.iter_child_nodes(node) if child not in skipped)


def references(path: str, root: Path = REPO) -> set[str]:
    """The package files that running `path` can run or read."""
    tree = ast.parse((root / path).read_text(), filename=path)
    here = module_name(path)
    package = here if path.endswith("__init__.py") else here.rpartition(".")[0]
    nodes = walk_pruned(tree)
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


def builtin_envs(root: Path = REPO) -> dict[str, str]:
    """The built-in environments by name -> their modules' paths (posttrain.envs.ENVIRONMENTS)."""
    from posttrain.envs import ENVIRONMENTS

    return {name: module_path(target.partition(":")[0], root) for name, target in ENVIRONMENTS.items()}


def reach(stage: str, root: Path = REPO, env: str | None = "*") -> dict[str, str | None]:
    """Every package file `posttrain stage <stage>` can run -> the file that led to it.
    `env`: "*" for any config (every environment, as they load by name), a built-in's name
    for a config that names it (the others' modules are not run), None for none of them."""
    via: dict[str, str | None] = {}
    todo: deque[str] = deque()   # breadth first: `chain` gives a shortest import chain
    others = set() if env == "*" else set(builtin_envs(root).values()) - {builtin_envs(root).get(env)}

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
            if env == "*" and path.startswith(folder + "/"):
                found += plugin_modules(folder, group, root)
        for other in found:
            if not (path == f"{PACKAGE}/envs/__init__.py" and other in others):
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


def written(root: Path = REPO) -> str:
    """dvc.yaml as `make dvc-yaml` writes it: each stage's package files are what the walk
    reaches from its command, its own module first, the rest sorted; every other line (data,
    `custom`, params, comments) stays as it is."""
    commands = {name: stage for name, (_, stage, _) in dvc_stages(root).items()}
    out, stage, seen = [], None, 0
    for line in (root / "dvc.yaml").read_text().splitlines():
        if m := re.fullmatch(r"  (\w+):\s*", line):
            stage, seen = commands.get(m.group(1)), 0
        item = re.fullmatch(r"(\s+)- (" + PACKAGE + r"/\S+)(.*)", line)
        if not item or stage is None:
            out.append(line)
            continue
        seen += 1
        own = f"{PACKAGE}/stages/{stage}.py"
        if seen == 1:
            out.append(f"{item.group(1)}- {own}")
        elif seen == 2:
            out += [f"{item.group(1)}- {path}" for path in sorted(reach(stage, root)) if path != own]
    return "\n".join(out) + "\n"


if __name__ == "__main__":  # make dvc-yaml
    (REPO / "dvc.yaml").write_text(written())
    print("dvc.yaml: each stage's package deps written from the import walk")


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
    ("sft", "posttrain/cli.py", False),               # __main__.py hands a stage to stage_entry.py, not the CLI
    ("grpo", "posttrain/stage_entry.py", True),      # ... which reads the stage's flags and runs it
    ("sft", "posttrain/stages/grpo.py", False),       # cli.py imports the one stage it runs
])
def test_the_walk_finds_what_a_stage_runs(stage, path, reached):
    via = reach(stage)
    assert (path in via) is reached, chain(via, path) if path in via else f"{path} not reached"


def test_the_walk_follows_import_paths_and_package_data(tmp_path):
    (tmp_path / PACKAGE / "stages").mkdir(parents=True)
    for path, text in {
        "posttrain/__init__.py": "", "posttrain/stages/__init__.py": "", "posttrain/config.py": "",
        "posttrain/__main__.py": ('if sys.argv[1:2] == ["stage"]:\n    import posttrain.errors\n'
                                  'else:\n    import posttrain.cli\n'),
        "posttrain/cli.py": "import posttrain.compare\n",
        "posttrain/stages/x.py": 'PLUGIN = "posttrain.plugin:make"\nfrom . import helper\n',
        "posttrain/plugin.py": 'PROFILES = "profiles.yaml"\n', "posttrain/profiles.yaml": "",
        "posttrain/stages/helper.py": "", "posttrain/compare.py": "", "posttrain/errors.py": "",
    }.items():
        (tmp_path / path).write_text(text)
    assert set(reach("x", tmp_path)) == {
        "posttrain/__init__.py", "posttrain/__main__.py", "posttrain/stages/__init__.py", "posttrain/config.py",
        "posttrain/errors.py", "posttrain/stages/x.py", "posttrain/plugin.py", "posttrain/stages/helper.py",
        "posttrain/profiles.yaml"}


# --- dvc.yaml against the walk ----------------------------------------------------------
def test_every_stage_depends_on_all_the_code_it_runs():
    missing = missing_deps()
    assert not missing, "dvc.yaml misses code its stages run (stale results; `make dvc-yaml` writes them):\n" + \
        "\n".join(missing)


def test_dvc_yaml_is_what_the_walk_writes():
    """Its package deps come from the walk (`make dvc-yaml`), in one order: no hand-kept list."""
    assert (REPO / "dvc.yaml").read_text() == written(), "dvc.yaml's code deps are not the walk's: run `make dvc-yaml`"


def test_no_stage_depends_on_code_it_never_runs():
    extra = []
    for name, (where, stage, deps) in dvc_stages().items():
        reached = reach(stage) if stage else {}
        extra += [f"dvc.yaml {where}: remove `- {dep}` (`posttrain stage {stage}` never runs it; `make dvc-yaml`)"
                  for dep in deps if dep.split("/")[0] == PACKAGE and not any(covered(p, [dep]) for p in reached)]
    assert not extra, "\n".join(extra)


def test_each_builtin_environment_declares_the_modules_it_runs():
    """posttrain.envs.MODULES: what a built-in runs beyond every stage's code, as the walk finds it."""
    from posttrain.envs import MODULES

    shared = set(reach("prepare", env=None))
    assert set(MODULES) == set(builtin_envs())
    for env, paths in MODULES.items():
        assert {f"{PACKAGE}/{p}" for p in paths} == set(reach("prepare", env=env)) - shared, env


def test_a_workspace_depends_on_its_environments_code_alone():
    """A workspace's dvc.yaml (posttrain.workspace.dvc_yaml): for a built-in environment, each
    stage depends on all it runs and on no other built-in's module; for your own, on all."""
    from posttrain.workspace import dvc_yaml

    assert dvc_yaml("custom.mytask:make_env") == (REPO / "dvc.yaml").read_text()
    for env in builtin_envs():
        stages = yaml.safe_load(dvc_yaml(env))["stages"]
        for name, (where, stage, _) in dvc_stages().items():
            body = stages[name]["do"] if "foreach" in stages[name] else stages[name]
            deps = [str(d) for d in body["deps"]]
            runs = reach(stage, env=env)
            assert not [p for p in runs if not covered(p, deps)], (env, name)
            assert not [d for d in deps if d.startswith(f"{PACKAGE}/") and d not in runs], (env, name)


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
    stages, env = dvc_stages(ws), yaml.safe_load((ws / "configs" / "pipeline.yaml").read_text())["data"]["env"]
    for name in ("prepare", "sft", "grpo@dense", "serving", "evaluate"):
        via = reach(stages[name.partition("@")[0]][1], ws, env=env)   # the config's environment, no other
        unseen = [p for p in via if p.endswith(".py") and not covered(p, sorted(changed.get(name, ())))]
        assert not unseen, f"dvc status misses changes to {unseen} in stage {name}"

    # the evaluator changed: DVC finds sft, grpo and evaluate stale, not prepare or serving
    evaluation = ws / PACKAGE / "scoring" / "evaluation.py"
    original = evaluation.read_text()
    evaluation.write_text(original + "# a changed evaluator\n")
    assert set(dvc_changed(ws)) == {"sft", "grpo@dense", "evaluate"}
    evaluation.write_text(original)
    assert dvc_changed(ws) == {}

    # another command changed (the CLI's parser, `posttrain compare`'s code), or an environment
    # the config does not use (it names arithmetic): no stage is stale
    assert env == "arithmetic"
    for path in (ws / PACKAGE / "cli.py", ws / PACKAGE / "tracking" / "compare.py", ws / PACKAGE / "envs" / "sql.py"):
        text = path.read_text()
        path.write_text(text + "# a changed command\n")
        assert dvc_changed(ws) == {}, f"an edit to {path.name} reruns stages"
        path.write_text(text)

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
