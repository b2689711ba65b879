"""Shared fixtures: real git + DVC workspaces in temporary folders, a reduced config."""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# Every library's home, cache and config in one temporary folder for the session, set before
# any of them is imported (pytest imports this file first): the tests' flow runs would land
# in the user's own ~/.prefect/prefect.db (and show in their Prefect UI), their datasets and
# fonts in ~/.cache, telemetry ids in ~/.config. Every process a test starts inherits it.
TEST_HOME = Path(tempfile.mkdtemp(prefix="posttrain-tests-home-"))
atexit.register(shutil.rmtree, TEST_HOME, True)
HOMES = {"PREFECT_HOME": "prefect", "HF_HOME": "huggingface", "HF_DATASETS_CACHE": "huggingface/datasets",
         "MPLCONFIGDIR": "matplotlib", "XDG_CACHE_HOME": "cache", "XDG_CONFIG_HOME": "config",
         "XDG_DATA_HOME": "share", "XDG_STATE_HOME": "state", "VLLM_CACHE_ROOT": "cache/vllm",
         "DVC_SITE_CACHE_DIR": "dvc-site"}  # named even where XDG_* covers it: the user may have set it
os.environ.update({name: str(TEST_HOME / folder) for name, folder in HOMES.items()})
for name in ("PREFECT_API_URL", "PREFECT_API_KEY", "PREFECT_PROFILE", "PREFECT_PROFILES_PATH"):
    os.environ.pop(name, None)  # the user's Prefect server and profile: a test that needs a server starts one

import pytest  # noqa: E402 - after the homes are set
import yaml  # noqa: E402

from posttrain.command import OFFLINE_DEFAULTS
from posttrain import workspace
from posttrain.config import read_config_dict

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

# A config small enough for a stage smoke test: seconds, not minutes.
SMALL = {
    "model": {"tiny": {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1,
                       "intermediate_size": 64, "max_positions": 32}},
    "data": {"options": {"operand_max": 9, "heldout_size": 20}},
    # a target the 2-epoch warmup never reaches: the whole schedule runs, the curve is measured
    "sft": {"trl": {"num_train_epochs": 2, "per_device_train_batch_size": 16, "logging_steps": 2},
            "stop_when": {"greedy_accuracy": 0.95, "every_steps": 2, "validation_size": 10}},
    "grpo": {"dense": {"from": "sft", "rewards": {"correctness": 1.0, "digits": 0.5},
                       "guardrails": ["unparseable"], "pass_rate_filter": {"samples": 4},
                       "trl": {"max_steps": 4, "per_device_train_batch_size": 8, "num_generations": 4,
                               "max_completion_length": 4, "logging_steps": 2, "save_steps": 2}}},
    # vLLM's CPU kernels need head_dim >= 32; this model's is 16 (test_evaluation samples with vLLM)
    "evaluate": {"n_samples": 4, "k": [1, 4], "max_new_tokens": 4, "backend": "transformers"},
    # tests/test_serving.py starts the real engine and server once each
    "serving": {"vllm_check": {"enabled": False}, "load_test": {"enabled": False}},
    "gate": {"n_samples": 4, "k": 4, "tolerance": 1.0},
    "orchestration": {"retries": 0},
    "stats": {"bootstrap_resamples": 200},
}


os.environ.update(OFFLINE_DEFAULTS)
# mlflow.set_tracking_uri() exports MLFLOW_TRACKING_URI; a child process must not inherit
# the store of whichever test ran before it.
CHILD_ENV_DROP = ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_ID", "MLFLOW_EXPERIMENT_NAME")


# Credentials a user exports (unused by these local stores): no file a run writes may hold them.
SECRETS = {"MLFLOW_TRACKING_TOKEN": "tok-7f3a9c2e51", "MLFLOW_TRACKING_PASSWORD": "pw-b4d81e6f07",
           "AWS_SECRET_ACCESS_KEY": "aws-5c2e9a7d13", "PGPASSWORD": "pg-e61f0b3a98"}


def sh(*cmd, cwd, env=None, check=True, timeout=900) -> subprocess.CompletedProcess:
    """Run a command as a user would: the venv on PATH, no MLflow state inherited.

    The timeout turns a hang into a failure: a server a killed flow leaves behind (a
    Prefect ephemeral API) can hold the output pipes open forever.
    """
    base = {k: v for k, v in os.environ.items() if k not in CHILD_ENV_DROP}
    env = {**base, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", **(env or {})}
    done = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise AssertionError(f"{cmd} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done


def make_workspace(dest: Path, overrides: dict) -> Path:
    """A git + DVC workspace (`posttrain.workspace`) running the default config with
    `overrides` merged in."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    overrides_file = dest.parent / f"{dest.name}-overrides.yaml"
    overrides_file.write_text(yaml.safe_dump({"extends": str(REPO / "configs" / "pipeline.yaml"), **overrides},
                                             sort_keys=False))
    return workspace.create(dest, read_config_dict(overrides_file))


def kill_stage_at(ws: Path, stage: str, checkpoint: str) -> None:
    """`dvc repro STAGE` in `ws`, killed with -9 (DVC and the stage process together) once
    `checkpoint` (a glob under ws, e.g. checkpoints/grpo/dense/*/checkpoint-20) holds its
    trainer state. Bounded by the stage, not a clock: the checkpoint must stay until the
    stage ends (`save_total_limit: null`), and a stage that ends first fails the wait."""
    import signal
    import time

    env = {k: v for k, v in os.environ.items() if k not in CHILD_ENV_DROP}
    env["PATH"] = f"{BIN}{os.pathsep}{env['PATH']}"
    proc = subprocess.Popen(["dvc", "repro", stage], cwd=ws, env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while not list(ws.glob(f"{checkpoint}/trainer_state.json")):
        assert proc.poll() is None, f"the stage ended before {checkpoint} was seen"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def copy_workspace(src: Path, dest: Path) -> Path:
    """A copy of a workspace (git, DVC cache, MLflow store) that a test may change without
    changing what other tests of a shared fixture see, whatever order they run in."""
    import shutil

    shutil.copytree(src, dest, symlinks=True, ignore=shutil.ignore_patterns("posttrain-retrain.lock"))
    return dest


@pytest.fixture(autouse=True)
def _no_inherited_mlflow(monkeypatch):
    for key in CHILD_ENV_DROP:
        monkeypatch.delenv(key, raising=False)


@pytest.fixture
def small_workspace(tmp_path) -> Path:
    return make_workspace(tmp_path / "ws", SMALL)


@pytest.fixture(scope="session")
def flow_runs(tmp_path_factory):
    """`posttrain run` three times on one workspace (Prefect's ephemeral API, the local
    MLflow store): the second after an evaluation setting changed (DVC reruns evaluate
    only), the third with nothing changed. Session-wide: tests/test_flow.py checks the
    runs, tests/test_scheduled.py serves the same workspace from a Prefect server."""
    import mlflow

    ws = make_workspace(tmp_path_factory.mktemp("flow") / "ws", SMALL)
    first = sh("posttrain", "run", "--workdir", ws, cwd=ws, env=SECRETS)  # must reach no file (test_flow)
    params = ws / "configs" / "pipeline.yaml"
    config = yaml.safe_load(params.read_text())
    config["evaluate"]["temperature"] = 0.7
    params.write_text(yaml.safe_dump(config, sort_keys=False))
    second = sh("posttrain", "run", "--workdir", ws, cwd=ws)
    third = sh("posttrain", "run", "--workdir", ws, cwd=ws, env={"PYTHONPROFILEIMPORTTIME": "1"})  # what it imported
    mlflow.set_tracking_uri(f"sqlite:///{ws / 'mlflow.db'}")
    runs = mlflow.search_runs(search_all_experiments=True, order_by=["start_time ASC"])
    return ws, first, second, runs, third


def check_and_run(project: Path, name: str, config: dict) -> Path:
    """`config` written to project/configs/<name>.yaml, then `posttrain check` and `posttrain
    run` on it in project; the workspace (project/ws)."""

    path = project / "configs" / f"{name}.yaml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    sh("posttrain", "check", "--config", path, cwd=project)
    ws = project / "ws"
    sh("posttrain", "run", "--config", path, "--workdir", ws, cwd=project, timeout=1500)
    return ws
