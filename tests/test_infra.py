"""infra/: what a platform team deploys, checked here without Docker, a cluster or Slurm.

Every file is headed by what it is and the command that applies it; every YAML and JSON
file parses; every command the files name (posttrain, mlflow, prefect, dvc, trl, ...)
exists in this environment and accepts the flags the files pass it (each tool's own
`--help`, one process per tool, all at once); the work pool's base job template passes the server's
validation and resolves with Prefect's own templating and the defaults of its variables;
the sbatch script passes `bash -n` and runs its plan against stand-ins for `srun` and
`scontrol`, and the per-job config it writes passes posttrain's config loader.
What runs only on a real cluster (the containers, the Jobs, the Slurm steps) is not run.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import jsonpatch
import pytest
import yaml

from posttrain.probe import free_port

REPO = Path(__file__).resolve().parents[1]
INFRA = REPO / "infra"
BIN = Path(sys.executable).parent
COMPOSE = INFRA / "compose.yaml"
ENV_EXAMPLE = INFRA / ".env.example"
VALUES = INFRA / "k8s" / "prefect-worker-values.yaml"
TEMPLATE = INFRA / "k8s" / "base-job-template.json"
TRAINJOB = INFRA / "k8s" / "trainjob.yaml"
SBATCH = INFRA / "slurm" / "train.sbatch"
FILES = [COMPOSE, VALUES, TEMPLATE, TRAINJOB, SBATCH]

# what each file's header must say to apply it
APPLY = {COMPOSE: "docker compose -f infra/compose.yaml up -d",
         VALUES: "helm install prefect-worker prefect/prefect-worker",
         TEMPLATE: "prefect work-pool create posttrain-k8s --type kubernetes --base-job-template "
                   "infra/k8s/base-job-template.json",
         TRAINJOB: "kubectl apply -f infra/k8s/trainjob.yaml",
         SBATCH: "sbatch --nodes=N infra/slurm/train.sbatch"}

# console scripts of this environment that the files may name, and how many words name a
# subcommand (`prefect work-pool create`, `dvc remote add`, `mlflow server`)
TOOLS = {"posttrain": 1, "mlflow": 1, "prefect": 2, "dvc": 1, "accelerate": 1, "torchrun": 0, "trl": 1}
DVC_GROUPS = {"remote", "exp", "cache", "stage", "plots", "metrics", "params", "config"}
SECRET_NAME = re.compile(r"PASSWORD|SECRET|TOKEN|AUTH", re.I)
LOCK = dict(line.split("==", 1) for line in (REPO / "requirements" / "cpu.lock").read_text().split()
            if "==" in line)
# prefect-kubernetes' `_get_base_job_manifest()`: what its job configuration requires of a
# manifest (missing paths and other values are refused when a flow run is prepared)
PREFECT_KUBERNETES_BASE_MANIFEST = {
    "apiVersion": "batch/v1", "kind": "Job", "metadata": {"annotations": {}, "labels": {}},
    "spec": {"template": {"spec": {"parallelism": 1, "completions": 1, "restartPolicy": "Never",
                                   "containers": [{"name": "prefect-job"}]}}}}
# Kubeflow Trainer's torch plugin sets these itself and refuses a TrainJob that sets them
# (pkg/constants/constants.go, TorchRunReservedEnvNames)
TRAINER_RESERVED_ENV = {"PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT"}


def load_yaml(path: Path):
    return yaml.safe_load(path.read_text())


def header(path: Path) -> str:
    """The file's leading comment block (JSON: its top-level description)."""
    if path.suffix == ".json":
        return json.loads(path.read_text())["description"]
    lines = path.read_text().splitlines()
    block = []
    for line in lines[1:] if lines[0].startswith("#!") else lines:
        if not line.startswith("#"):
            break
        block.append(line.lstrip("#").strip())
    return " ".join(block)


# --- the commands the files name --------------------------------------------------------
def strings(tree):
    """Every string in a parsed YAML / JSON document."""
    if isinstance(tree, str):
        yield tree
    elif isinstance(tree, dict):
        for value in tree.values():
            yield from strings(value)
    elif isinstance(tree, list):
        for value in tree:
            yield from strings(value)


def commands_in_yaml(tree):
    """Command lines of a parsed document: `command` / `entrypoint` / `args` lists joined,
    the script of `bash -c` / `sh -c` as its own lines."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            if key in ("command", "entrypoint", "args") and isinstance(value, list) and \
                    all(isinstance(v, str) for v in value):
                if len(value) >= 3 and value[0] in ("bash", "sh", "/bin/sh", "/bin/bash") and value[1] == "-c":
                    yield from value[2].splitlines()
                else:
                    yield shlex.join(value)
            elif key in ("command", "args") and isinstance(value, str):
                yield from value.splitlines()
            else:
                yield from commands_in_yaml(value)
    elif isinstance(tree, list):
        for value in tree:
            yield from commands_in_yaml(value)


def backticks(text: str) -> list[str]:
    return re.findall(r"`([^`]+)`", text)


LABEL = re.compile(r"^(?:[A-Z][\w ,()'/-]*:|e\.g\.)\s+")


def comment_commands(comment: str) -> list[str]:
    """A comment's commands: its `backtick` spans, and the whole line when it is laid out
    as a command (indented, or after a label such as `Apply:`)."""
    found = backticks(comment)
    body = comment.strip()
    if comment.startswith("  ") or LABEL.match(body):
        found.append(LABEL.sub("", body).replace("`", " "))
    return found


def command_lines(path: Path) -> list[str]:
    """The text of `path` that may name commands (prose aside)."""
    text = path.read_text()
    if path.suffix == ".json":
        return [span for s in strings(json.loads(text)) for span in backticks(s)]
    lines = re.sub(r"\\\n", " ", text).splitlines()  # shell line continuations
    comments = [line.strip()[1:] for line in lines if line.strip().startswith("#") and not
                line.startswith("#!")]
    found = [c for comment in comments for c in comment_commands(comment)]
    if path.suffix == ".yaml":
        return found + list(commands_in_yaml(load_yaml(path)))
    return found + [line for line in lines if not line.strip().startswith("#")]


SEPARATORS = re.compile(r"&&|\|\||[;|`()]|\$\(")
SHELL_WORDS = {"exec", "then", "do", "else", "if", "until", "while", "time", "!", "{", "nohup"}


def invocations(line: str) -> list[tuple[str, tuple[str, ...], tuple[str, ...], str]]:
    """(tool, subcommand words, flags, segment) of each command of `line` that runs one
    of TOOLS (also as `python -m TOOL`)."""
    found = []
    for segment in SEPARATORS.split(line):
        segment = re.sub(r"^.*\bcompose\b.*?\bexec\s+(-\S+\s+)*[\w-]+\s+", "", segment.strip())
        try:
            tokens = shlex.split(segment)
        except ValueError:
            tokens = segment.split()
        while tokens and (tokens[0] in SHELL_WORDS or re.fullmatch(r"[A-Za-z_]\w*=\S*", tokens[0])):
            tokens = tokens[1:]
        if tokens and tokens[0] == "srun":
            tokens = tokens[1:]
            while tokens and tokens[0].startswith("-"):
                tokens = tokens[1:]
        if len(tokens) >= 3 and re.fullmatch(r"python[\d.]*", Path(tokens[0]).name) and tokens[1] == "-m":
            tokens = tokens[2:]
        if not tokens or Path(tokens[0]).name not in TOOLS:
            continue
        tool, rest = Path(tokens[0]).name, tokens[1:]
        depth = TOOLS[tool] + (1 if tool == "dvc" and rest and rest[0] in DVC_GROUPS else 0)
        words = []
        while rest and len(words) < depth and not rest[0].startswith("-"):
            words.append(rest.pop(0))
        flags = tuple(t.split("=", 1)[0] for t in rest if re.fullmatch(r"--?[A-Za-z][\w-]*(=.*)?", t))
        found.append((tool, tuple(words), flags, segment))
    return found


def all_invocations():
    return [(path, *inv) for path in FILES for line in command_lines(path) for inv in invocations(line)]


# a subcommand whose existence needs no `--help` (accelerate's imports take ~8 s)
MODULE_OF = {("accelerate", ("launch",)): "accelerate.commands.launch", ("torchrun", ()): "torch.distributed.run"}

# `TOOL WORDS --help` for several WORDS in one process (one import of the tool, not one per
# subcommand): the console script's own entry point, each call between markers
HELP_DRIVER = """
import json, sys
from importlib.metadata import entry_points
tool, calls = sys.argv[1], json.loads(sys.argv[2])
main = tuple(entry_points(group="console_scripts", name=tool))[0].load()
for words in calls:
    print("\\n@@@help " + " ".join(words), flush=True)
    sys.argv = [tool, *words, "--help"]
    try:
        code = main()
    except SystemExit as exit:
        code = exit.code
    code = code if isinstance(code, int) else 0 if code is None else 1
    sys.stdout.flush()
    print("\\n@@@exit %d" % code, flush=True)
"""


@pytest.fixture(scope="module")
def helps():
    """{(tool, words): (exit code, output of `tool words --help`)} for every subcommand the
    files name, one process per tool, all at once."""
    wanted = {}
    for _, tool, words, flags, _ in all_invocations():
        if (BIN / tool).exists() and not ((tool, words) in MODULE_OF and not flags):
            wanted.setdefault(tool, set()).add(words)
    env = {**os.environ, "COLUMNS": "250", "NO_COLOR": "1", "TERM": "dumb"}
    procs = {tool: subprocess.Popen([sys.executable, "-c", HELP_DRIVER, tool, json.dumps(sorted(calls))],
                                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, cwd=REPO)
             for tool, calls in wanted.items()}
    results = {}
    for tool, proc in procs.items():
        out = proc.communicate(timeout=180)[0]
        for part in out.split("\n@@@help ")[1:]:
            head, _, rest = part.partition("\n")
            text, _, code = rest.rpartition("\n@@@exit ")
            results[(tool, tuple(head.split()))] = (int(code.split()[0]) if code else -1, text)
    for key, module in MODULE_OF.items():
        results.setdefault(key, (0 if importlib.util.find_spec(module) else 1, ""))
    return results


def test_every_file_is_headed_by_what_it_is_and_the_command_that_applies_it():
    for path, command in APPLY.items():
        text = header(path)
        assert len(text) > 200, f"{path.name}: no header saying what it is"
        assert command in text, f"{path.name}: the header does not give `{command}`"


def test_every_yaml_and_json_file_parses():
    for path in [COMPOSE, VALUES, TRAINJOB]:
        assert isinstance(load_yaml(path), dict), path
    assert set(json.loads(TEMPLATE.read_text())) >= {"job_configuration", "variables"}


def test_the_files_name_commands_of_every_layer():
    """The extraction below finds the commands that matter (so the next test checks them)."""
    named = {(tool, words) for _, tool, words, _, _ in all_invocations()}
    assert named >= {("mlflow", ("server",)), ("prefect", ("server", "start")), ("prefect", ("worker", "start")),
                     ("prefect", ("work-pool", "create")), ("posttrain", ("serve",)), ("posttrain", ("run",)),
                     ("posttrain", ("join",)), ("dvc", ("repro",)), ("trl", ("vllm-serve",)),
                     ("accelerate", ("launch",))}, named


def test_every_command_named_exists_here_and_takes_the_flags_given(helps):
    problems = []
    for path, tool, words, flags, segment in all_invocations():
        where = f"{path.relative_to(REPO)}: `{segment.strip()[:90]}`"
        if not (BIN / tool).exists():
            problems.append(f"{where}: no console script {tool} in {BIN}")
            continue
        code, text = helps.get((tool, words), (-1, "(the help process ended before it)"))
        if code != 0:
            problems.append(f"{where}: `{tool} {' '.join(words)} --help` exits {code}: {text.strip()[-200:]}")
            continue
        known = set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", text))
        problems += [f"{where}: {tool} {' '.join(words)} has no option {flag}" for flag in flags
                     if flag not in known]
    assert not problems, "\n".join(problems)


def test_every_repository_path_named_exists():
    missing = set()
    for path in FILES:
        for name in re.findall(r"(?<![\w/.-])((?:infra|configs|requirements)/[\w./-]*\w)", path.read_text()):
            if name != "infra/.env" and not (REPO / name).exists():  # .env: the user's copy of .env.example
                missing.add(f"{path.name}: {name}")
    assert not missing, sorted(missing)


# --- compose ------------------------------------------------------------------------------
def test_compose_runs_the_five_services_in_order_with_healthchecks():
    services = load_yaml(COMPOSE)["services"]
    assert set(services) >= {"postgres", "minio", "mlflow", "prefect-server", "prefect-worker"}
    buckets = [name for name, s in services.items() if "mc mb" in json.dumps(s.get("command", ""))]
    assert buckets, "no service creates the buckets"
    for name, service in services.items():
        for dependency, how in (service.get("depends_on") or {}).items():
            if how["condition"] == "service_healthy":
                assert "healthcheck" in services[dependency], f"{name} waits for {dependency}'s health: none"
    assert services["mlflow"]["depends_on"][buckets[0]]["condition"] == "service_completed_successfully"
    assert {"postgres", "minio-buckets"} <= set(services["mlflow"]["depends_on"])
    assert set(services["prefect-worker"]["depends_on"]) == {"prefect-server", "mlflow"}


def test_compose_servers_are_the_shared_setup_of_infra_readme():
    services = load_yaml(COMPOSE)["services"]
    mlflow = services["mlflow"]
    command = mlflow["command"]
    assert command[:2] == ["mlflow", "server"] and "--serve-artifacts" in command
    assert command[command.index("--artifacts-destination") + 1].startswith("s3://")
    # the backend store comes from the environment: what `mlflow server` reads for it
    assert mlflow["environment"]["MLFLOW_BACKEND_STORE_URI"].startswith("postgresql+psycopg2://")
    cli = Path(importlib.util.find_spec("mlflow").origin).parent / "cli" / "__init__.py"
    assert 'envvar="MLFLOW_BACKEND_STORE_URI"' in cli.read_text()
    assert mlflow["environment"]["MLFLOW_S3_ENDPOINT_URL"] == "http://minio:9000"
    prefect = services["prefect-server"]
    assert prefect["environment"]["PREFECT_API_DATABASE_CONNECTION_URL"].startswith("postgresql+asyncpg://")
    worker = services["prefect-worker"]
    assert worker["environment"]["PREFECT_API_URL"] == "http://prefect-server:4200/api"
    assert worker["environment"]["MLFLOW_TRACKING_URI"] == "http://mlflow:5000"
    pool = worker["command"][worker["command"].index("--pool") + 1]
    assert f"--work-pool {pool}" in COMPOSE.read_text()  # the header's deployment targets the worker's pool


def test_compose_holds_no_literal_secret():
    problems = []
    for value in strings(load_yaml(COMPOSE)):
        for user_password in re.findall(r"://[^/\s:@]+:([^@\s]+)@", value):
            if not re.fullmatch(r"\$\{\w+:\?[^}]*\}", user_password):
                problems.append(f"a password in a URL that is not ${{VAR:?...}}: {value}")
    for service in load_yaml(COMPOSE)["services"].values():
        environment = service.get("environment") or {}
        for key, value in (environment.items() if isinstance(environment, dict) else []):
            if SECRET_NAME.search(key) and not re.fullmatch(r"\$\{\w+:\?[^}]*\}", str(value)):
                problems.append(f"{key}: {value!r} is not taken from .env (${{VAR:?...}})")
    assert not problems, problems


def test_compose_interpolation_is_compose_syntax_and_env_example_names_every_required_variable():
    text = "\n".join(line for line in COMPOSE.read_text().splitlines() if not line.lstrip().startswith("#"))
    unescaped = text.replace("$$", "")
    bare = re.findall(r"\$(?!\{)\w+", unescaped)
    assert not bare, f"compose would substitute {bare}: write $${{VAR}} for the container's shell"
    expressions = re.findall(r"\$\{([^}]*)\}", unescaped)
    assert all(re.fullmatch(r"\w+(:?[-?].*)?", e) for e in expressions), expressions
    required = {e.split(":?")[0] for e in expressions if ":?" in e}
    example = dict(line.split("=", 1) for line in ENV_EXAMPLE.read_text().splitlines()
                   if line and not line.startswith("#"))
    assert required <= set(example), f"infra/.env.example lacks {required - set(example)}"
    assert all(example[name] == "" for name in required if SECRET_NAME.search(name)), \
        "infra/.env.example holds a password: leave the values empty"


def test_compose_server_versions_are_the_locked_clients():
    text = COMPOSE.read_text()
    for variable, package in (("MLFLOW_VERSION", "mlflow"), ("PREFECT_VERSION", "prefect")):
        defaults = set(re.findall(r"\$\{" + variable + r":-([^}]+)\}", text))
        assert defaults == {LOCK[package]}, f"{variable} defaults {defaults}, requirements/cpu.lock {LOCK[package]}"
    assert load_yaml(VALUES)["worker"]["image"]["prefectTag"].startswith(LOCK["prefect"] + "-")


def test_docker_compose_accepts_the_file_when_docker_compose_is_here():
    """`docker compose config` where the compose plugin is installed (it needs no daemon);
    without it, the tests above parse the file."""
    docker = shutil.which("docker")
    if not docker or subprocess.run([docker, "compose", "version"], capture_output=True).returncode != 0:
        return  # no compose plugin on this machine: the file was parsed above
    env = {**os.environ, "POSTGRES_PASSWORD": "x", "MINIO_ROOT_PASSWORD": "x"}
    done = subprocess.run([docker, "compose", "-f", str(COMPOSE), "config", "--quiet"], capture_output=True,
                          text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr


# --- Kubernetes: the work pool ---------------------------------------------------------------
def template() -> dict:
    return json.loads(TEMPLATE.read_text())


def resolved(values: dict | None = None) -> dict:
    """The job configuration as a worker renders it: the variables' defaults, then
    `values` (a deployment's job variables), through Prefect's own templating."""
    from prefect.utilities.templating import apply_values
    from prefect.workers.base import BaseJobConfiguration

    base = template()
    variables = BaseJobConfiguration._get_base_config_defaults(base["variables"]["properties"])
    return apply_values(base["job_configuration"], {**variables, **(values or {})})


def test_base_job_template_passes_the_servers_validation():
    """What `prefect work-pool create --base-job-template` sends, as the server checks it
    (every placeholder a declared variable)."""
    from prefect.server.schemas.actions import WorkPoolCreate

    created = WorkPoolCreate(name="posttrain-k8s", type="kubernetes", base_job_template=template())
    assert created.base_job_template == template()  # taken whole: nothing dropped or rewritten


def test_every_variable_is_used_and_every_placeholder_declared():
    from prefect.utilities.templating import find_placeholders

    base = template()
    used = {p.name for p in find_placeholders(base["job_configuration"])}
    assert used == set(base["variables"]["properties"])


def test_base_job_template_resolves_with_the_variables_defaults():
    from prefect.workers.base import BaseJobConfiguration

    config = resolved()
    assert "{{" not in json.dumps(config), "a placeholder without a value"
    BaseJobConfiguration(**config)  # command, env, labels, name as the worker reads them
    manifest = config["job_manifest"]
    metadata = manifest.setdefault("metadata", {})  # as prefect-kubernetes' validator fills them in
    for key, default in (("annotations", {}), ("labels", {}), ("namespace", config["namespace"])):
        metadata.setdefault(key, default)
    patch = jsonpatch.JsonPatch.from_diff(manifest, PREFECT_KUBERNETES_BASE_MANIFEST)
    assert not [op for op in patch if op["op"] in ("add", "replace")], list(patch)
    pod = manifest["spec"]["template"]["spec"]
    container = pod["containers"][0]
    defaults = {k: v.get("default") for k, v in template()["variables"]["properties"].items()}
    assert container["resources"]["limits"]["nvidia.com/gpu"] == defaults["gpus"] >= 1
    assert container["workingDir"] == defaults["workspace_path"]
    assert {"name": "workspace", "mountPath": defaults["workspace_path"]} in container["volumeMounts"]
    assert pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == defaults["workspace_claim"]
    assert "args" not in container, "no command: the worker supplies `prefect flow-run execute`"
    assert config["env"]["MLFLOW_TRACKING_URI"].startswith("http://")


def test_a_deployment_sets_the_gpus_and_the_schema_refuses_a_bad_value():
    import uuid

    import jsonschema
    from prefect.client.schemas.actions import DeploymentCreate

    limits = resolved({"gpus": 8})["job_manifest"]["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert limits["limits"]["nvidia.com/gpu"] == 8
    deployment = DeploymentCreate(name="nightly", flow_id=uuid.uuid4(), job_variables={"gpus": 8})
    deployment.check_valid_configuration(template())
    with pytest.raises(jsonschema.ValidationError):
        DeploymentCreate(name="nightly", flow_id=uuid.uuid4(), job_variables={"gpus": "eight"}
                         ).check_valid_configuration(template())


def test_the_worker_renders_the_job_from_the_template():
    """BaseJobConfiguration.from_template_and_values: what a worker calls for each flow run
    (no block or variable references here, so it asks the API for nothing)."""
    from prefect.workers.base import BaseJobConfiguration

    class NoClient:  # noqa: D401 - a client that must not be called
        pass

    config = asyncio.run(BaseJobConfiguration.from_template_and_values(
        template(), {"env": {"EXTRA": "1"}}, client=NoClient()))
    assert config.env["EXTRA"] == "1" and config.env["MLFLOW_TRACKING_URI"].startswith("http://")


def test_credentials_reach_the_job_from_a_secret_only():
    container = template()["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]["containers"][0]
    for entry in container["env"]:
        assert "value" not in entry and entry["valueFrom"]["secretKeyRef"]["name"] == "{{ secret_name }}", entry
    assert not any(SECRET_NAME.search(k) for k in resolved()["env"]), "a credential in plain env"


def test_helm_values_point_a_kubernetes_worker_at_the_pool_the_files_name():
    worker = load_yaml(VALUES)["worker"]
    assert worker["apiConfig"] == "selfHostedServer"
    assert worker["selfHostedServerApiConfig"]["apiUrl"].endswith("/api")
    assert worker["config"]["type"] == "kubernetes" and worker["image"]["prefectTag"].endswith("-kubernetes")
    assert "authString" not in worker["selfHostedServerApiConfig"].get("basicAuth", {})
    pool = worker["config"]["workPool"]
    named = set()
    for path in (VALUES, TEMPLATE):
        named |= set(re.findall(r"(?:--work-pool|--pool|work-pool create)\s+([\w-]+)", path.read_text()))
    assert named == {pool}, named
    assert worker["config"]["jobNamespace"] == resolved()["namespace"]


# --- Kubernetes: the multi-node TrainJob ---------------------------------------------------------
def test_trainjob_runs_one_stage_on_the_torch_runtime():
    job = load_yaml(TRAINJOB)
    assert (job["apiVersion"], job["kind"]) == ("trainer.kubeflow.org/v1alpha1", "TrainJob")
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", job["metadata"]["name"]) and len(job["metadata"]["name"]) <= 63
    assert job["spec"]["runtimeRef"] == {"apiGroup": "trainer.kubeflow.org", "kind": "ClusterTrainingRuntime",
                                         "name": "torch-distributed"}
    trainer = job["spec"]["trainer"]
    assert trainer["numNodes"] >= 2
    assert trainer["resourcesPerNode"]["limits"]["nvidia.com/gpu"] == trainer["numProcPerNode"]
    env = {e["name"]: e for e in trainer["env"]}
    assert not TRAINER_RESERVED_ENV & set(env), "Trainer refuses a TrainJob that sets its PET_* variables"
    assert re.fullmatch(r"sft|grpo@[\w-]+", env["POSTTRAIN_STAGE"]["value"])
    for name, entry in env.items():
        assert not SECRET_NAME.search(name) or "secretKeyRef" in entry.get("valueFrom", {}), name
    script = trainer["command"][2]
    assert trainer["command"][:2] == ["bash", "-c"]
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    for variable in ("PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT"):
        assert f"${variable}" in script
    assert 'POSTTRAIN_RDZV_ENDPOINT="$PET_MASTER_ADDR:$PET_MASTER_PORT"' in script


def test_trainjob_mounts_the_workspace_the_work_pool_mounts():
    patch = load_yaml(TRAINJOB)["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]
    pod = patch["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    defaults = {k: v.get("default") for k, v in template()["variables"]["properties"].items()}
    claims = {v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v}
    assert claims == {defaults["workspace_claim"]}
    mounts = {m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    assert defaults["workspace_path"] in mounts and "/dev/shm" in mounts
    assert pod["containers"][0]["name"] == "node"  # the torch runtime's trainer container


# --- Slurm ---------------------------------------------------------------------------------
def test_sbatch_script_is_valid_bash_with_its_directives_first():
    assert subprocess.run(["bash", "-n", str(SBATCH)]).returncode == 0
    lines = SBATCH.read_text().splitlines()
    first_code = next(i for i, line in enumerate(lines) if line.strip() and not line.startswith("#"))
    directives = [i for i, line in enumerate(lines) if line.startswith("#SBATCH")]
    assert directives and max(directives) < first_code, "sbatch reads #SBATCH lines only before the first command"
    done = subprocess.run(["bash", str(SBATCH), "--help"], capture_output=True, text=True)
    assert done.returncode == 0 and "sbatch --nodes=N infra/slurm/train.sbatch" in done.stdout



STUB_SRUN = """#!/bin/bash
# srun stand-in: records the step, then plays it: trl serves /health, posttrain run ends
# with HEAD_EXIT once the HELPERS other steps have started, anything else (the joiners)
# waits to be stopped
echo "srun $*" >> "$SIM/steps"
while [[ $1 == -* ]]; do shift; done
case "$1" in
  trl) echo $$ >> "$SIM/pids"; exec python -m http.server "$POSTTRAIN_VLLM_PORT" --bind 127.0.0.1 \
         --directory "$SIM/www" >/dev/null 2>&1 ;;
  posttrain) for _ in $(seq 100); do (( $(cat "$SIM/pids" 2>/dev/null | wc -l) >= HELPERS )) && break; sleep 0.1; done
             echo "env RDZV=$POSTTRAIN_RDZV_ENDPOINT" >> "$SIM/steps"; exit "$HEAD_EXIT" ;;
  *) echo $$ >> "$SIM/pids"; exec sleep 600 ;;
esac
"""


def simulate(tmp_path: Path, nodes: list[str], *args: str, helpers: int, head_exit: int = 0):
    """Run the sbatch script as Slurm would start it, with `srun` / `scontrol` stand-ins;
    `helpers`: the steps besides the head's (joiners, vLLM). (completed process, steps)."""
    sim = tmp_path / "sim"
    (sim / "bin").mkdir(parents=True)
    (sim / "www").mkdir()
    (sim / "www" / "health").write_text("ok")
    (sim / "bin" / "srun").write_text(STUB_SRUN)
    (sim / "bin" / "scontrol").write_text('#!/bin/bash\necho "$3" | tr , "\\n"\n')
    for stub in (sim / "bin").iterdir():
        stub.chmod(0o755)
    env = {**os.environ, "PATH": f"{sim / 'bin'}{os.pathsep}{os.environ['PATH']}", "SIM": str(sim),
           "SLURM_SUBMIT_DIR": str(REPO), "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": ",".join(nodes),
           "SLURM_GPUS_ON_NODE": "8", "HEAD_EXIT": str(head_exit), "HELPERS": str(helpers), "POSTTRAIN_VLLM_PORT": str(free_port())}
    proc = subprocess.Popen(["bash", str(SBATCH), "--workdir", str(tmp_path / "ws"), *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=60)
        pids = (sim / "pids").read_text().split() if (sim / "pids").exists() else []
        alive = [pid for pid in pids if Path(f"/proc/{pid}").exists() and
                 "zombie" not in Path(f"/proc/{pid}/status").read_text()]
    finally:
        try:  # whatever the script left (nothing, when it works)
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    assert not alive, f"steps still running after the head ended: {alive}"
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return done, (sim / "steps").read_text() if (sim / "steps").exists() else ""


def test_sbatch_head_runs_the_pipeline_the_others_join_the_last_serves_vllm(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    done, steps = simulate(tmp_path, ["gpu1", "gpu2", "gpu3", "localhost"], "--vllm", "--vllm-model", str(model),
                           "--tp", "4", helpers=2, head_exit=3)
    assert done.returncode == 3, done.stderr  # the job's exit code is the head's
    job_config = tmp_path / "slurm-jobs" / "4242.yaml"
    lines = steps.splitlines()
    vllm = next(line for line in lines if " trl vllm-serve " in line)
    assert "--nodelist=localhost" in vllm and f"--model {model} --tensor-parallel-size 4" in vllm
    joiners = next(line for line in lines if "bash -c" in line)
    assert "--nodes=2" in joiners and "--nodelist=gpu2,gpu3" in joiners
    head = next(line for line in lines if " posttrain run " in line)
    assert "--nodelist=gpu1" in head and head.endswith(f"posttrain run --config {job_config} --workdir {tmp_path / 'ws'}")
    assert "env RDZV=gpu1:29500" in lines
    variant = load_yaml(job_config)
    assert variant["extends"] == str(REPO / "configs" / "pipeline.yaml")
    # the head's endpoint reaches every step from the environment, not from the config
    # (`launcher` is a DVC param: the head changes from job to job)
    assert variant["launcher"] == {"type": "accelerate", "nodes": 3, "processes": 8,
                                   "accelerate_config": str(REPO / "infra" / "accelerate" / "zero3.yaml")}
    port = re.search(r"--port (\d+)", vllm).group(1)
    assert variant["grpo"]["dense"]["trl"] == {"use_vllm": True, "vllm_mode": "server",
                                               "vllm_server_base_url": f"http://localhost:{port}"}
    assert "training stages: sft grpo@dense" in done.stdout


def test_sbatch_without_vllm_trains_on_every_node_and_refuses_vllm_on_one(tmp_path):
    done, steps = simulate(tmp_path, ["n1", "n2"], helpers=1)
    assert done.returncode == 0, done.stderr
    assert "trl" not in steps and "--nodelist=n2" in steps
    assert load_yaml(tmp_path / "slurm-jobs" / "4242.yaml")["launcher"]["nodes"] == 2
    refused, _ = simulate(tmp_path / "one", ["n1"], "--vllm", helpers=0)
    assert refused.returncode == 2 and "at least 2 nodes" in refused.stderr


def test_the_per_job_config_passes_posttrains_config_loader(tmp_path):
    """What the head and the joiners read: the launcher and the vLLM server options, as
    `posttrain check --elsewhere` checks them (TRL's own check of the `trl:` blocks aside:
    it imports TRL; the options' names are checked against TRL's source below)."""
    import ast

    from posttrain.config import load_config

    done, _ = simulate(tmp_path, ["n1", "n2", "localhost"], "--vllm", "--vllm-model", str(tmp_path), helpers=2)
    assert done.returncode == 0, done.stderr
    config = load_config(tmp_path / "slurm-jobs" / "4242.yaml")
    assert (config.launcher.type, config.launcher.nodes, config.launcher.processes) == ("accelerate", 2, 8)
    assert config.launcher.rdzv_endpoint is None  # POSTTRAIN_RDZV_ENDPOINT, set for every step
    options = config.grpo["dense"].trl
    assert (options["use_vllm"], options["vllm_mode"]) == (True, "server")
    assert options["vllm_server_base_url"].startswith("http://localhost:")
    source = Path(importlib.util.find_spec("trl.trainer.grpo_config").origin).read_text()
    grpo_config = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "GRPOConfig")
    fields = {n.target.id for n in grpo_config.body if isinstance(n, ast.AnnAssign)}
    assert {"use_vllm", "vllm_mode", "vllm_server_base_url"} <= fields
