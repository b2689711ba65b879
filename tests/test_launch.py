"""Training stages on several processes: torchrun with 2 ranks over gloo, on this CPU.

Real launches (slow): SFT and a GRPO stage each run as one 2-rank data-parallel job under
`posttrain stage` (via `dvc repro`); a rank that raises fails the stage in one line; a
second "node" joins with `posttrain join`. Fast: the `launcher:` section, the accelerate
configs in infra/accelerate (accelerate's own loader, `posttrain check`), and the vLLM
generation options against this machine.
"""

from __future__ import annotations

import http.server
import json
import threading
from pathlib import Path

import mlflow
import psutil
import pytest
import yaml

from conftest import REPO, SMALL, make_workspace, sh
from hardening import assert_refused, cli
from posttrain.runtime.launch import import_path, resolve, weights_digest
from posttrain.runtime.host_checks import vllm_problem

ACCELERATE_CONFIGS = sorted((REPO / "infra" / "accelerate").glob("*.yaml"))
TWO_RANKS = {"launcher": {"type": "torchrun", "processes": 2}}


def runs_by_name(ws: Path) -> dict[str, list]:
    mlflow.set_tracking_uri(f"sqlite:///{ws / 'mlflow.db'}")
    runs = mlflow.search_runs(search_all_experiments=True, output_format="list")
    found: dict[str, list] = {}
    for run in runs:
        found.setdefault(run.info.run_name, []).append(run)
    return found


def ranks_report(run) -> list[dict]:
    return json.loads(mlflow.artifacts.load_text(f"runs:/{run.info.run_id}/launch/ranks.json"))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """SFT and GRPO, each one 2-rank torchrun job, through `dvc repro` as the flow runs them."""
    ws = make_workspace(tmp_path_factory.mktemp("launch") / "ws", {**SMALL, **TWO_RANKS})
    return ws, sh("dvc", "repro", "grpo@dense", cwd=ws, timeout=900)


@pytest.mark.slow
def test_two_ranks_are_one_data_parallel_job(two_ranks):
    from transformers import AutoModelForCausalLM

    ws, done = two_ranks
    assert "training on 1 node(s) x 2 process(es) (torchrun)" in done.stdout
    runs = runs_by_name(ws)
    # one MLflow run per stage, whatever the number of ranks
    assert len(runs["sft"]) == 1 and len(runs["grpo@dense"]) == 1, {k: len(v) for k, v in runs.items()}
    for stage, model_dir in [("sft", "artifacts/models/sft"), ("grpo@dense", "artifacts/models/dense")]:
        run = runs[stage][0]
        assert run.info.status == "FINISHED"
        assert run.data.metrics["stage.world_size"] == 2.0
        assert run.data.tags["posttrain.launcher"] == "torchrun 1x2"
        report = ranks_report(run)
        assert [r["rank"] for r in report] == [0, 1] and {r["world_size"] for r in report} == {2}
        assert {r["backend"] for r in report} == {"gloo"}
        assert {r["distributed_type"] for r in report} == {"DistributedType.MULTI_CPU"}
        first, second = (set(r["example_digests"]) for r in report)
        assert first and second and first != second          # the ranks trained on different examples
        assert report[0]["examples"] == report[1]["examples"]  # each its share of every step
        # every rank ended with the same weights, and they are the ones saved
        saved = weights_digest(AutoModelForCausalLM.from_pretrained(ws / model_dir))
        assert report[0]["weights_sha256"] == report[1]["weights_sha256"] == saved, stage
        metrics = json.loads((ws / "metrics" / ("sft.json" if stage == "sft" else "grpo/dense.json")).read_text())
        assert metrics["world_size"] == 2.0
    # SFT, 2 epochs: each rank took its half of each epoch (accelerate pads the last batch to a
    # whole one), not the whole epoch; the rows repeat, so shards are compared by count
    sft, rows = ranks_report(runs["sft"][0]), len((ws / "data" / "train.jsonl").read_text().splitlines())
    per_epoch = rows - SMALL["sft"]["stop_when"]["validation_size"]
    assert 2 * per_epoch / 2 <= sft[0]["examples"] < 2 * per_epoch
    # one set of outputs: each model folder once, no rank's leftovers beside it
    assert sorted(p.name for p in (ws / "artifacts" / "models").iterdir()) == ["base", "dense", "sft"]


@pytest.mark.slow
def test_a_failing_rank_fails_the_stage_in_one_line(two_ranks, tmp_path):
    """Rank 1's reward function raises mid-step while rank 0 waits for it in a collective:
    the launcher ends rank 0, the stage exits with the rank's reason as its last line."""
    ws, _ = two_ranks
    (ws / "custom" / "flaky.py").write_text(
        "import os\n\n\ndef reward(completions, **kwargs):\n"
        "    if os.environ.get('RANK') == '1':\n        raise RuntimeError('rank one broke')\n"
        "    return [0.0] * len(completions)\n")
    params = ws / "configs" / "pipeline.yaml"
    config = yaml.safe_load(params.read_text())
    config["grpo"]["dense"]["rewards"] = {"correctness": 1.0, "custom.flaky:reward": 0.5}
    params.write_text(yaml.safe_dump(config, sort_keys=False))
    done = sh("dvc", "repro", "grpo@dense", cwd=ws, check=False, timeout=600)
    assert done.returncode != 0
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.startswith("posttrain: training failed")]
    assert lines == ["posttrain: training failed: grpo@dense: rank 1 of 2 failed: RuntimeError: rank one broke"], \
        (done.stdout + done.stderr)[-3000:]
    runs = runs_by_name(ws)["grpo@dense"]
    assert sorted(r.info.status for r in runs) == ["FAILED", "FINISHED"]  # the earlier run, and this one
    assert not [p for p in psutil.process_iter(["cmdline"]) if "posttrain.runtime.launch" in " ".join(p.info["cmdline"] or [])]


@pytest.mark.slow
def test_a_second_node_joins_with_posttrain_join(tmp_path):
    """Two "nodes" of one process each on this machine: node 0 runs the SFT stage, node 1
    joins it; one job of world size 2 over a static rendezvous."""
    from posttrain.probe import free_port

    port = free_port()
    launcher = {"type": "torchrun", "processes": 1, "nodes": 2, "rdzv_endpoint": f"127.0.0.1:{port}"}
    sft = {"trl": {**SMALL["sft"]["trl"], "num_train_epochs": 1}, "stop_when": None, "launcher": launcher}
    ws = make_workspace(tmp_path / "ws", {**SMALL, "sft": sft})
    import subprocess
    import sys

    joiner = subprocess.Popen([str(Path(sys.executable).parent / "posttrain"), "join", "--config",
                               "configs/pipeline.yaml", "--stage", "sft", "--node-rank", "1"],
                              cwd=ws, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        sh("dvc", "repro", "sft", cwd=ws, timeout=600)
        out, _ = joiner.communicate(timeout=120)
    finally:
        joiner.kill()
    assert joiner.returncode == 0, out[-2000:]
    assert "join sft: node 1 done" in out
    report = ranks_report(runs_by_name(ws)["sft"][0])
    assert [r["rank"] for r in report] == [0, 1] and report[0]["weights_sha256"] == report[1]["weights_sha256"]


# --- fast: what is checked before any compute --------------------------------------------------
@pytest.mark.parametrize("path", ACCELERATE_CONFIGS, ids=lambda p: p.name)
def test_each_accelerate_config_loads_and_checks(path, tmp_path):
    from accelerate.commands.config.config_args import load_config_from_file

    assert load_config_from_file(str(path)).distributed_type.value in {"MULTI_GPU", "DEEPSPEED", "FSDP"}
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"extends": str(REPO / "configs" / "pipeline.yaml"), "launcher": {
        "type": "accelerate", "processes": 8, "accelerate_config": str(path)}}))
    done = cli("check", "--config", config, "--elsewhere", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    import torch

    if not torch.cuda.is_available():  # here, accelerate would start one process instead of 8
        assert_refused(cli("check", "--config", config, cwd=tmp_path), "launcher", "CUDA", "torchrun")


@pytest.mark.parametrize("launcher, needles", [
    ({"type": "in_process", "processes": 2}, ["launcher", "in_process runs one process", "torchrun"]),
    ({"type": "torchrun", "accelerate_config": "infra/accelerate/ddp.yaml"}, ["accelerate_config", "type: accelerate"]),
    ({"type": "accelerate"}, ["launcher", "needs an accelerate config file"]),
    ({"type": "torchrun", "processes": 0}, ["launcher.processes"]),
    ({"type": "torchrun", "nodes": 2, "rdzv_endpoint": "node0"}, ["rdzv_endpoint", "HOST:PORT"]),
    ({"type": "mpirun"}, ["launcher.type"]),
    ({"type": "accelerate", "accelerate_config": "nowhere.yaml"}, ["launcher.accelerate_config", "not a file"]),
])
def test_bad_launchers_are_one_line(launcher, needles, tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"extends": str(REPO / "configs" / "pipeline.yaml"), "launcher": launcher}))
    assert_refused(cli("check", "--config", config, "--elsewhere", cwd=tmp_path), str(config), *needles)


def test_a_broken_accelerate_config_and_a_stage_launcher_name_their_field(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("distributed_type: MULTI_GPU\nnum_gpus_typo: 3\n")
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"extends": str(REPO / "configs" / "pipeline.yaml"), "grpo": {"dense": {
        "launcher": {"type": "accelerate", "accelerate_config": str(broken)}}}}))
    assert_refused(cli("check", "--config", config, "--elsewhere", cwd=tmp_path),
                   "grpo.dense.launcher.accelerate_config", "accelerate cannot load", "num_gpus_typo")


def test_join_is_refused_where_there_is_nothing_to_join(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"extends": str(REPO / "configs" / "pipeline.yaml"), **TWO_RANKS}))
    assert_refused(cli("join", "--config", config, "--stage", "sft", "--node-rank", "1", cwd=tmp_path),
                   "one node", "launcher.nodes")
    assert_refused(cli("join", "--config", config, "--stage", "grpo@nope", "--node-rank", "1", cwd=tmp_path),
                   "--stage", "grpo@dense")
    config.write_text(yaml.safe_dump({"extends": str(REPO / "configs" / "pipeline.yaml"), "launcher": {
        "type": "torchrun", "nodes": 2}}))
    assert_refused(cli("join", "--config", config, "--stage", "sft", "--node-rank", "1", cwd=tmp_path,
                       env={"POSTTRAIN_RDZV_ENDPOINT": ""}), "rdzv_endpoint", "POSTTRAIN_RDZV_ENDPOINT")
    config.write_text(yaml.safe_dump({"extends": str(REPO / "configs" / "pipeline.yaml"), "launcher": {
        "type": "torchrun", "nodes": 2, "rdzv_endpoint": "127.0.0.1:29999"}}))
    assert_refused(cli("join", "--config", config, "--stage", "sft", "--node-rank", "2", cwd=tmp_path),
                   "--node-rank", "1..1")


def test_what_a_launch_needs_is_checked_with_its_world_size(tmp_path):
    """GRPO's whole-group rule at the launcher's world size; LoRA under sharded weights;
    several nodes without a rendezvous endpoint."""
    def check(overrides, *args, env=None):
        config = tmp_path / "c.yaml"
        config.write_text(yaml.safe_dump({"extends": str(REPO / "configs" / "pipeline.yaml"), **overrides}))
        return cli("check", "--config", config, *args, cwd=tmp_path, env=env)

    groups = {"grpo": {"dense": {"trl": {"per_device_train_batch_size": 2, "num_generations": 4}}}}
    assert check({**groups, **TWO_RANKS}).returncode == 0          # 2 x 2 completions: one group of 4
    assert_refused(check(groups), "grpo.dense.trl", "divisible by num_generations")  # 1 rank: half a group
    zero3 = {"launcher": {"type": "accelerate", "accelerate_config": str(REPO / "infra/accelerate/zero3.yaml")},
             "sft": {"peft": {"r": 8}}}
    assert_refused(check(zero3, "--elsewhere"), "launcher.accelerate_config", "LoRA", "zero2.yaml")
    two_nodes = {"launcher": {"type": "torchrun", "nodes": 2}}
    assert_refused(check(two_nodes, env={"POSTTRAIN_RDZV_ENDPOINT": ""}), "launcher.rdzv_endpoint")
    assert check(two_nodes, env={"POSTTRAIN_RDZV_ENDPOINT": "node0:29500"}).returncode == 0


def test_a_rank_that_only_lost_its_peers_is_not_named_the_cause(tmp_path):
    from posttrain.runtime.launch import failure

    errors = tmp_path / "errors"
    errors.mkdir()
    (errors / "rank-0.secondary.txt").write_text("rank 0 of 2 failed: DistBackendError: Connection closed by peer\n")
    assert "no rank raised an error of its own" in failure("sft", tmp_path, -9)
    (errors / "rank-1.error.txt").write_text("rank 1 of 2 failed: ValueError: bad row\n")
    assert failure("sft", tmp_path, 1) == "sft: rank 1 of 2 failed: ValueError: bad row"


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_vllm_generation_options_against_the_machine():
    """Each refusal with the facts of a machine: no CUDA, no vLLM, one outside TRL's range,
    a server that does not answer, and one that does (a real HTTP server on loopback)."""
    from posttrain.probe import free_port
    from posttrain.runtime.host_checks import trl_vllm_requirement

    supported = trl_vllm_requirement()
    assert supported == "<=0.31.0,>=0.22.0" or supported  # TRL's own `vllm` extra
    colocate = {"use_vllm": True, "vllm_mode": "colocate"}
    assert vllm_problem(colocate, cuda=False, vllm="0.31.0", supported=supported)[0] == "use_vllm"
    assert "not installed" in vllm_problem(colocate, cuda=True, vllm=None, supported=supported)[1]
    assert "outside" in vllm_problem(colocate, cuda=True, vllm="0.32.0", supported="<=0.31.0,>=0.22.0")[1]
    assert vllm_problem(colocate, cuda=True, vllm="0.31.0+cpu", supported="<=0.31.0,>=0.22.0") is None
    dead = {"use_vllm": True, "vllm_mode": "server", "vllm_server_base_url": f"http://127.0.0.1:{free_port()}"}
    option, problem, _ = vllm_problem(dead, cuda=True, vllm="0.31.0", supported=supported, timeout=2)
    assert option == "vllm_server_base_url" and "does not answer" in problem
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        alive = {"use_vllm": True, "vllm_mode": "server", "vllm_server_host": "127.0.0.1",
                 "vllm_server_port": server.server_address[1]}
        assert vllm_problem(alive, cuda=True, vllm="0.31.0", supported=supported) is None
    finally:
        server.shutdown()


def test_vllm_generation_is_refused_here_before_any_compute(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: vLLM generation is allowed here")  # reported by -ra, never silent
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"extends": str(REPO / "configs" / "pipeline.yaml"), "grpo": {"dense": {
        "trl": {"use_vllm": True, "vllm_mode": "server"}}}}))
    assert_refused(cli("check", "--config", config, cwd=tmp_path), "grpo.dense.trl.use_vllm", "CUDA")
    assert cli("check", "--config", config, "--elsewhere", cwd=tmp_path).returncode == 0


def test_a_stage_hands_the_launcher_its_function_and_a_rank_finds_it_by_name():
    from posttrain.stages import grpo, sft

    for stage in (sft, grpo):
        assert resolve(import_path(stage.train_job)) is stage.train_job

    def nested(config, job):
        return {}

    with pytest.raises(ValueError, match="not a module-level function"):
        import_path(nested)
