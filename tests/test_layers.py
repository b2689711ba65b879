"""The package's import graph, read from the source (`ast`: imports inside functions
count, as they run all the same): no circle among posttrain's modules, the config module
imports nothing above it, and the library never imports the flows or the tasks.

`from package import module` is an edge to that module (its package's `__init__` runs
first whatever is imported, which is no dependency on the package's own names).
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# what the config (posttrain/config.py, data only) may import of the package: leaves
CONFIG_IMPORTS = {"posttrain.errors", "posttrain.capacity.modelconfig", "posttrain.stageid", "posttrain.yamlfile"}


def modules(package: str = "posttrain") -> dict[str, Path]:
    """Module name -> file, for every module of `package`."""
    found = {}
    for path in sorted((REPO / package).rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules (of `known`, or top-level names outside it) that `name` imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(filter(None, [package.rsplit(".", node.level - 1)[0] if node.level else "", node.module]))
            subs = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in known]
            candidates = subs + ([base] if len(subs) < len(node.names) else [])
        else:
            continue
        for candidate in candidates:
            while candidate not in known and "." in candidate:
                candidate = candidate.rpartition(".")[0]
            targets.add(candidate)
    return targets - {name}


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imported(name, path, known) & known.keys() for name, path in known.items()}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on.add(node)
        for nxt in sorted(edges[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while not group or group[-1] != node:
                group.append(stack.pop())
                on.discard(group[-1])
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_no_import_circle_in_the_package():
    assert circles(graph()) == [], "modules that import each other (break the circle)"


def test_the_config_is_data():
    """posttrain.config parses, merges and validates: it imports no module above it
    (no environment, model, machine, TRL bridge or stage host)."""
    edges = graph()
    assert edges["posttrain.config"] <= CONFIG_IMPORTS, sorted(edges["posttrain.config"] - CONFIG_IMPORTS)


def test_the_library_never_imports_flows_or_tasks():
    known = modules()
    upward = {name: sorted(t for t in imported(name, path, known) if t.split(".")[0] in ("flows", "tasks"))
              for name, path in known.items()}
    assert {name: found for name, found in upward.items() if found} == {}


def test_the_circle_check_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# Where a process may change folder: a child that takes on its caller's folder and runs
# nothing else (a forked stage, a launched rank). The flow, the CLI and the library name
# the workspace instead (posttrain.plugins.workspace, explicit paths).
CHDIR_ALLOWED = {"posttrain/runtime/stagehost.py": "the host's forked child takes on its client's folder",
                 "posttrain/runtime/launch.py": "a rank process takes on the stage's folder"}


def test_no_chdir_outside_a_child_process():
    found = {}
    for package in ("posttrain", "flows", "tasks"):
        for path in sorted((REPO / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Attribute) and node.attr in ("chdir", "fchdir"):
                    found.setdefault(path.relative_to(REPO).as_posix(), node.lineno)
    assert {p: line for p, line in found.items() if p not in CHDIR_ALLOWED} == {}


# Who may import `ast` outside the tests: no module reads the project's own source to learn
# what it declares (a stage's flags are declared in posttrain.stages.STAGES).
AST_ALLOWED = {"posttrain/envs/calculator.py": "parses the model's arithmetic expression, never evaluates it"}


def test_no_module_parses_the_projects_source():
    found = sorted(path.relative_to(REPO).as_posix() for package in ("posttrain", "flows", "tasks")
                   for path in (REPO / package).rglob("*.py")
                   if any(isinstance(node, (ast.Import, ast.ImportFrom)) and "ast" in
                          [a.name for a in node.names] + [getattr(node, "module", None)]
                          for node in ast.walk(ast.parse(path.read_text()))))
    assert [p for p in found if p not in AST_ALLOWED] == []


def test_environments_are_imported_when_named():
    """posttrain.envs imports no built-in environment up front (each is imported when a config
    names it), and no environment imports scoring: the SQL sandbox is below both."""
    edges, known = graph(), modules()
    builtins = {name for name in known if name.startswith("posttrain.envs.")} - {"posttrain.envs.base"}
    assert edges["posttrain.envs"] & builtins == set()
    envs = {name: targets for name, targets in edges.items() if name.startswith("posttrain.envs")}
    assert {name: sorted(t for t in targets if t.startswith("posttrain.scoring")) for name, targets in envs.items()
            if any(t.startswith("posttrain.scoring") for t in targets)} == {}
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", "import sys, posttrain.envs as e; e.env_factory('arithmetic'); "
                           "print(sorted(m for m in sys.modules if m.startswith('posttrain.envs.')))"],
                          capture_output=True, text=True, check=True, cwd=REPO)
    assert done.stdout.split() == ["['posttrain.envs.arithmetic',", "'posttrain.envs.base']"]


def test_mlflow_is_imported_only_by_tracking():
    """The library reaches MLflow through posttrain.tracking (a stage's Recorder); flows/ and
    tasks/ open and close the runs and may import it themselves."""
    known = modules()
    found = sorted(name for name, path in known.items() if "mlflow" in imported(name, path, known)
                   and not name.startswith("posttrain.tracking"))
    assert found == []
    assert "mlflow" in imported("posttrain.tracking.recorder", known["posttrain.tracking.recorder"], known)


def test_the_retrain_flow_only_chains_tasks():
    """flows/retrain.py imports Prefect, the run lock and tasks/, nothing of the library: what
    it does beyond calling tasks in order lives in tasks/."""
    found = imported("flows.retrain", REPO / "flows" / "retrain.py", modules())
    assert sorted(name for name in found if name.split(".")[0] == "posttrain") == []
    assert {name.split(".")[0] for name in found} <= {"__future__", "pathlib", "prefect", "flows", "tasks"}


def test_the_commands_flow_side_reaches_the_library_through_the_cli_and_tasks():
    """flows/cli.py (`posttrain run`, `serve`, `replay`) parses arguments and starts flows; what
    a run checks before its flow starts (incoming rows, servers, whether anything is to do)
    lives in tasks/checks.py. Of the library it imports the CLI it extends, the config reader
    and the workspace it creates, and the names of errors and files."""
    found = imported("flows.cli", REPO / "flows" / "cli.py", modules())
    assert sorted(name for name in found if name.split(".")[0] == "posttrain") == [
        "posttrain.cli", "posttrain.config", "posttrain.errors", "posttrain.layout", "posttrain.workspace"]
