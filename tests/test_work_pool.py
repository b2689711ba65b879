"""`posttrain serve --work-pool`: the retrain deployment on a `process` work pool of a real
`prefect server start` (SQLite) on loopback, its run picked up by a real `prefect worker`.

The workspace is tests/test_scheduled.py's SQLite one: a copy of the workspace
tests/test_flow.py ran (`flow_runs`) with a serving setting changed, so the worker's run
reruns the serving stage only and publishes the same summary as a served run.
"""

import pytest
import yaml

from conftest import copy_workspace, sh
from posttrain.vllm_engine.loadtest import free_port
from servers import api, prefect_server, process_env, running, wait_for

pytestmark = pytest.mark.slow
POOL = "posttrain-test"
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


def test_deployment_on_work_pool_runs_on_a_worker(flow_runs, tmp_path):
    ws = copy_workspace(flow_runs[0], tmp_path / "ws")
    params = ws / "configs" / "pipeline.yaml"
    config = yaml.safe_load(params.read_text())
    config["serving"]["gpu_memory_utilization"] = 0.6
    params.write_text(yaml.safe_dump(config, sort_keys=False))
    serve = ["posttrain", "serve", "--workdir", ws, "--work-pool", POOL]

    dead = sh(*serve, cwd=ws, check=False, env={"PREFECT_API_URL": f"http://127.0.0.1:{free_port()}/api"})
    assert (dead.returncode, dead.stderr.count("\n")) == (2, 1) and "no Prefect API answers" in dead.stderr

    with prefect_server(tmp_path, f"sqlite+aiosqlite:///{tmp_path / 'prefect.db'}") as api_url:
        env = process_env(PREFECT_API_URL=api_url, PREFECT_HOME=str(tmp_path / "client-home"))
        missing = sh(*serve, cwd=ws, env=env, check=False)  # refused, not created: the pool's owner sets it up
        assert (missing.returncode, missing.stderr.count("\n")) == (2, 1), missing.stderr
        assert f"`prefect work-pool create {POOL} --type process`" in missing.stderr
        assert not api(api_url, "/deployments/filter", {})

        sh("prefect", "work-pool", "create", POOL, "--type", "process", cwd=tmp_path, env=env)
        deployed = sh(*serve, cwd=ws, env=env)
        assert deployed.stdout.count("\n") == 1 and f"prefect worker start --pool {POOL}" in deployed.stdout
        deployment = api(api_url, "/deployments/name/retrain/nightly")
        assert deployment["work_pool_name"] == POOL and deployment["parameters"] == {"workdir": str(ws)}
        assert [s["schedule"]["cron"] for s in deployment["schedules"]] == ["0 3 * * *"]
        assert deployment["global_concurrency_limit"]["limit"] == 1

        run_id = api(api_url, f"/deployments/{deployment['id']}/create_flow_run", {})["id"]
        log = tmp_path / "worker.log"
        with running(["prefect", "worker", "start", "--pool", POOL], log=log, cwd=tmp_path,
                     env={**env, "PREFECT_WORKER_QUERY_SECONDS": "1"}) as worker:
            run = wait_for(lambda: (lambda r: r if r["state_type"] in TERMINAL else None)(
                api(api_url, f"/flow_runs/{run_id}")), 600, "the worker's flow run", worker, log)
        assert run["state_type"] == "COMPLETED", log.read_text()[-3000:]
        artifacts = api(api_url, "/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [run_id]}}})
    summary = [a["data"] for a in artifacts if a["key"] == "retrain-summary"][0]
    assert "| model | greedy accuracy |" in summary and "MLflow run:" in summary and "#/experiments/" in summary
    assert "Gates: dense accepted" in summary and "Model registry: posttrain version" in summary
