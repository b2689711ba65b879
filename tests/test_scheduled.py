"""Scheduled retraining against real servers on loopback.

`prefect server start` (on SQLite, and on the local PostgreSQL) and `posttrain serve`
registering the cron deployment and running its flow runs. Two runs are triggered at
once: the deployment's concurrency limit queues one behind the other; the first runs
the pipeline, the second finds nothing changed and says so quickly.

With PostgreSQL the workspace is new, new data waits in `incoming/` (the first run
versions it and trains on it), and the tracking server is `mlflow server` on PostgreSQL
with a proxied artifact store. With SQLite the workspace is a copy of the one
tests/test_flow.py ran (`flow_runs`), with a serving setting changed: only the serving stage reruns, so the
variant costs seconds of compute.
"""

import contextlib
import datetime
import json

import pytest
import yaml
from mlflow import MlflowClient

from conftest import SMALL, copy_workspace, make_workspace, sh
from posttrain.tracking.lineage import file_md5
from servers import (POSTGRES, api, mlflow_server, postgres_database, prefect_server, process_env, running,
                     wait_for)

pytestmark = pytest.mark.slow
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


@pytest.fixture(params=["sqlite", "postgresql"])
def served(request, tmp_path):
    """(workspace, Prefect API URL, MLflow URI or None, deployment) with `posttrain serve` running."""
    with contextlib.ExitStack() as stack:
        mlflow_uri = None
        if request.param == "sqlite":
            database_url = f"sqlite+aiosqlite:///{tmp_path / 'prefect.db'}"
            ws = copy_workspace(request.getfixturevalue("flow_runs")[0], tmp_path / "ws")
            params = ws / "configs" / "pipeline.yaml"
            config = yaml.safe_load(params.read_text())
            config["serving"]["gpu_memory_utilization"] = 0.6
            params.write_text(yaml.safe_dump(config, sort_keys=False))
        else:
            database_url = f"postgresql+asyncpg://{POSTGRES}/{stack.enter_context(postgres_database())}"
            mlflow_uri = stack.enter_context(mlflow_server(tmp_path, stack.enter_context(postgres_database())))
            ws = make_workspace(tmp_path / "ws", SMALL)
            (ws / "incoming").mkdir()
            (ws / "incoming" / "batch.jsonl").write_text(json.dumps({"prompt": "12+3=", "answer": "15"}) + "\n")
        api_url = stack.enter_context(prefect_server(tmp_path, database_url))
        env = process_env(PREFECT_API_URL=api_url, PREFECT_HOME=str(tmp_path / "client-home"),
                          **({"MLFLOW_TRACKING_URI": with_password(mlflow_uri)} if mlflow_uri else {}))
        log = tmp_path / "serve.log"
        serve = stack.enter_context(running(["posttrain", "serve", "--workdir", ws, "--cron", "0 3 * * *"],
                                            log=log, env=env, cwd=ws))
        deployment = wait_for(lambda: _deployment(api_url), 120, "the served deployment", serve, log)
        yield ws, api_url, mlflow_uri, deployment, log


PASSWORD = "pw-5e0c7d19aa"  # in the tracking URI the runs use: it must reach no output, log or artifact


def with_password(uri: str) -> str:
    """`uri` with user:password (a server without auth ignores them; MLflow prints them)."""
    return uri.replace("http://", f"http://posttrain:{PASSWORD}@", 1)


def _deployment(api_url):
    with contextlib.suppress(Exception):
        return api(api_url, "/deployments/name/retrain/nightly")


def _flow_run(api_url, run_id):
    return api(api_url, f"/flow_runs/{run_id}")


def _time(stamp: str) -> datetime.datetime:
    return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00"))


def test_scheduled_runs_queue_and_skip_unchanged_inputs(served):
    ws, api_url, mlflow_uri, deployment, log = served
    assert [s["schedule"]["cron"] for s in deployment["schedules"]] == ["0 3 * * *"]
    assert deployment["global_concurrency_limit"]["limit"] == 1

    ids = [api(api_url, f"/deployments/{deployment['id']}/create_flow_run", {})["id"] for _ in range(2)]
    runs = wait_for(lambda: (lambda rs: rs if all(r["state_type"] in TERMINAL for r in rs) else None)(
        [_flow_run(api_url, i) for i in ids]), 900, "both flow runs to finish", log=log)
    assert [r["state_type"] for r in runs] == ["COMPLETED", "COMPLETED"], log.read_text()[-3000:]
    first, second = sorted(runs, key=lambda r: _time(r["start_time"]))
    assert _time(second["start_time"]) >= _time(first["end_time"]) - datetime.timedelta(seconds=1)  # queued

    artifacts = {r["id"]: api(api_url, "/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [r["id"]]}}})
                 for r in (first, second)}
    # one task run per stage, named after it, and a link to the MLflow run
    names = {t["name"] for t in api(api_url, "/task_runs/filter", {"flow_runs": {"id": {"any_": [first["id"]]}}})}
    assert {"prepare", "sft", "grpo@dense", "serving", "evaluate"} <= names, names
    link = [a for a in artifacts[first["id"]] if a["key"] == "mlflow-run"][0]
    assert "#/experiments/" in link["data"] and "MLflow run" in link["data"], link  # Prefect keeps it as markdown
    summary = [a["data"] for a in artifacts[first["id"]] if a["key"] == "retrain-summary"][0]
    assert "| model | greedy accuracy |" in summary and "MLflow run:" in summary
    assert "Gates: dense accepted" in summary and "Model registry: posttrain version" in summary
    assert "Nothing to do" in [a["data"] for a in artifacts[second["id"]] if a["key"] == "retrain-summary"][0]
    assert "in sync" in sh("dvc", "status", "--cloud", cwd=ws).stdout
    if not mlflow_uri:
        assert "#/experiments/" in summary
        return
    assert f"{mlflow_uri}/#/experiments/" in summary and "is the champion" in summary  # credentials left out
    # the new data is a DVC version: committed .dvc file, data in the remote, rows in training
    assert "data: 1 rows from batch.jsonl" in sh("git", "log", "--format=%s", cwd=ws).stdout
    assert json.loads((ws / "metrics" / "prepare.json").read_text())["datasets_rows"] == 1
    _check_tracking_server(mlflow_uri, ws)
    _check_password_nowhere(mlflow_uri, ws, log)


def _check_tracking_server(uri, ws):
    """The run, its child runs, artifacts (through the proxy) and the registry on `mlflow server`."""
    client = MlflowClient(uri)
    parent = client.search_runs([client.get_experiment_by_name("posttrain").experiment_id],
                                filter_string="tags.`posttrain.flow` = 'retrain'")
    assert len(parent) == 1
    run = parent[0]
    assert run.info.artifact_uri.startswith("mlflow-artifacts:")
    assert run.data.tags["posttrain.workspace"] == str(ws) and run.data.tags["git.commit"]
    assert {"params", "dvc.lock"} <= {a.path for a in client.list_artifacts(run.info.run_id)}
    champion = client.get_model_version_by_alias("posttrain", "champion")
    assert champion.run_id == run.info.run_id
    # through the REST API, as the UI reads it: the datasets the run read, with their DVC md5 as digest
    rest = f"{uri}/api/2.0/mlflow"
    inputs = api(rest, f"/runs/get?run_id={run.info.run_id}")["run"]["inputs"]["dataset_inputs"]
    datasets = {i["dataset"]["name"]: i for i in inputs}
    assert {"data/train.jsonl", "data/heldout.jsonl"} <= set(datasets), datasets
    assert [n for n in datasets if n.startswith("datasets/") and n.endswith("-batch.jsonl")], datasets  # versioned
    assert {"training", "evaluation", "incoming"} == {t["value"] for i in inputs for t in i["tags"]}
    for name, entry in datasets.items():
        assert entry["dataset"]["digest"] == file_md5(ws / name) and entry["dataset"]["source_type"] == "dvc"
        assert json.loads(entry["dataset"]["source"]) == {"path": name, "git_commit": run.data.tags["git.commit"]}
    # the final model: a logged model of the run, its metrics linked, the registry version made from it
    models = api(rest, "/logged-models/search", {"experiment_ids": [run.info.experiment_id]})["models"]
    final = [m for m in models if m["info"]["source_run_id"] == run.info.run_id][0]
    assert final["info"]["status"] == "LOGGED_MODEL_READY"
    linked = {m["key"]: m["value"] for m in final["data"]["metrics"]}
    assert linked["evaluate.grpo.greedy_accuracy"] == run.data.metrics["evaluate.grpo.greedy_accuracy"]
    version = api(rest, f"/model-versions/get?name=posttrain&version={champion.version}")["model_version"]
    assert version["source"] == f"models:/{final['info']['model_id']}" and version["run_id"] == run.info.run_id
    tags = {t["key"]: t["value"] for t in final["info"]["tags"]}
    assert json.loads(tags["mlflow.modelVersions"]) == [{"name": "posttrain", "version": str(champion.version)}]
    assert "config.json" in {f.path for f in client.list_logged_model_artifacts(final["info"]["model_id"])}
    outputs = api(rest, f"/runs/get?run_id={run.info.run_id}")["run"]["outputs"]["model_outputs"]
    assert final["info"]["model_id"] in {o["model_id"] for o in outputs}  # the run page's "Logged models"
    # the SFT and GRPO checkpoints, linked the same way (their bytes in DVC)
    stage_models = {t["value"]: m for m in models for t in m["info"].get("tags", []) if t["key"] == "posttrain.stage"}
    assert {"sft", "grpo@dense", "final"} <= set(stage_models)
    assert any(t["key"] == "dvc.md5" for t in stage_models["sft"]["info"]["tags"])
    experiment = api(rest, f"/experiments/get?experiment_id={run.info.experiment_id}")["experiment"]
    assert {"key": "mlflow.experimentKind", "value": "custom_model_development"} in experiment["tags"]
    stages = client.search_runs([run.info.experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{run.info.run_id}'")
    assert {s.data.tags["mlflow.runName"] for s in stages} == {"prepare", "sft", "grpo@dense", "serving", "evaluate"}


def test_a_failed_stage_shows_on_its_task_run(flow_runs, tmp_path):
    """`posttrain run` against a real Prefect server, with a GRPO reward function that
    raises: the flow run fails, the stage's task run (named after it) carries the stage's
    last log lines in its state message and in a markdown artifact."""
    ws = copy_workspace(flow_runs[0], tmp_path / "ws")
    (ws / "custom" / "boom.py").write_text("def reward(completions, **_):\n"
                                           "    raise RuntimeError('boom: this reward function fails')\n")
    params = ws / "configs" / "pipeline.yaml"
    config = yaml.safe_load(params.read_text())
    config["grpo"]["dense"]["rewards"] = {"custom.boom:reward": 1.0}
    config["grpo"]["dense"]["audit"] = "off"  # else `run` refuses the reward before any stage (tests/test_audit.py)
    params.write_text(yaml.safe_dump(config, sort_keys=False))
    with prefect_server(tmp_path, f"sqlite+aiosqlite:///{tmp_path / 'prefect.db'}") as api_url:
        env = process_env(PREFECT_API_URL=api_url, PREFECT_HOME=str(tmp_path / "client-home"))
        done = sh("posttrain", "run", cwd=ws, env=env, check=False)
        # one line at the end, naming the stage, the plug-in's own frame and the stage's log (issue 25)
        last = done.stderr.strip().splitlines()[-1]
        assert done.returncode == 1 and "Traceback" not in done.stdout + done.stderr, done.stderr[-3000:]
        assert last.startswith("posttrain: stage failed: grpo@dense (dvc exit"), last
        assert "boom: this reward function fails at custom/boom.py:2" in last and "logs/grpo@dense.log" in last, last
        flow_run, = api(api_url, "/flow_runs/filter", {})
        assert flow_run["state_type"] == "FAILED"
        tasks = {t["name"]: t for t in api(api_url, "/task_runs/filter",
                                           {"flow_runs": {"id": {"any_": [flow_run["id"]]}}})}
        failed = tasks["grpo@dense"]
        assert failed["state_type"] == "FAILED" and "boom: this reward function fails" in failed["state"]["message"]
        assert tasks["sft"]["state_type"] == "COMPLETED" and "serving" not in tasks
        artifacts = api(api_url, "/artifacts/filter", {"artifacts": {"task_run_id": {"any_": [failed["id"]]}}})
        assert any("boom: this reward function fails" in a["data"] for a in artifacts), artifacts


def _check_password_nowhere(uri, ws, log):
    """MLflow prints "View run ... at <tracking URI>" when a run ends (issue 25): the
    password must reach neither the run's output, nor a stage log, nor the logs uploaded
    as artifacts (the proxied artifact store's files), nor `posttrain compare`'s output."""
    champion = MlflowClient(uri).get_model_version_by_alias("posttrain", "champion").run_id
    compare = sh("posttrain", "compare", champion, "champion", "--out", ws.parent / "compare.png", cwd=ws,
                 env={"MLFLOW_TRACKING_URI": with_password(uri)})  # it logs a `compare` run: MLflow's line
    assert "View run" in log.read_text() and "View run" in compare.stdout  # printed, password masked
    artifacts = ws.parent / "mlflow-artifacts"
    files = [log, *(ws / "logs").glob("*.log"), *(p for p in artifacts.rglob("*") if p.is_file())]
    assert len(files) > 5 and any(p.suffix == ".log" and artifacts in p.parents for p in files)
    leaked = [str(p) for p in files if PASSWORD.encode() in p.read_bytes()]
    assert not leaked and PASSWORD not in compare.stdout + compare.stderr, leaked
