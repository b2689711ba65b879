"""A pipeline without the SFT warmup (`sft: off`, the first GRPO stage `from: base`) on the
tiny model: the stage behaviours of a warmed-up pipeline, each once more: the flow with its
gates, lineage and promotion, a second run that reruns only what changed, replay, compare,
`dvc repro` alone with a rejected stage rolled back to the base model, resume after kill -9,
and the config checks that come before any compute."""

from __future__ import annotations

import json
import sys

import mlflow
import pytest
import yaml

from conftest import REPO, SMALL, copy_workspace, kill_stage_at, make_workspace, sh

WEIGHTS = "model.safetensors"


def zero(model_path, **grpo) -> dict:
    """SMALL with no warmup: GRPO starts from the model at `model_path` (a real model's
    place in the config: prepare writes a pointer to it, not a copy)."""
    dense = {**SMALL["grpo"]["dense"], "from": "base", **grpo}
    return {**SMALL, "model": {"path": str(model_path)}, "sft": False, "grpo": {"dense": dense},
            "gate": {"n_samples": 4, "k": 4, "tolerance": 0.0}}


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A base model that already solves some sums: the tiny model after a warmup in a
    workspace of its own (a harmful stage then has something to lose)."""
    from test_grpo import LEARNED, run_repro

    ws = make_workspace(tmp_path_factory.mktemp("pretrained") / "ws", LEARNED)
    run_repro(ws, "sft")
    assert json.loads((ws / "metrics" / "sft.json").read_text())["greedy_accuracy"] >= 0.2
    return ws / "artifacts" / "models" / "sft"


@pytest.fixture(scope="module")
def zero_runs(pretrained, tmp_path_factory):
    """`posttrain run` twice on one no-SFT workspace: the second after an evaluation setting
    changed (DVC reruns evaluate alone)."""
    ws = make_workspace(tmp_path_factory.mktemp("zero") / "ws", zero(pretrained))
    first = sh("posttrain", "run", "--workdir", ws, cwd=ws)
    params = ws / "configs" / "pipeline.yaml"
    config = yaml.safe_load(params.read_text())
    config["evaluate"]["temperature"] = 0.7
    params.write_text(yaml.safe_dump(config, sort_keys=False))
    second = sh("posttrain", "run", "--workdir", ws, cwd=ws)
    mlflow.set_tracking_uri(f"sqlite:///{ws / 'mlflow.db'}")
    runs = mlflow.search_runs(search_all_experiments=True, order_by=["start_time ASC"])
    return ws, first, second, runs


def parents(runs):
    return runs[runs["tags.mlflow.parentRunId"].isna()]


@pytest.mark.slow
def test_grpo_trains_from_the_base_model_and_its_gate_compares_against_it(zero_runs):
    ws, first, _, _ = zero_runs
    out = first.stdout + first.stderr                          # Prefect's log lines: stderr
    assert "sft: off (the first GRPO stage starts from the base model)" in out
    assert json.loads((ws / "metrics" / "sft.json").read_text()) == {"off": 1.0}
    assert [p.name for p in (ws / "artifacts" / "models" / "sft").iterdir()] == ["posttrain_card.json"]
    dense = json.loads((ws / "metrics" / "grpo" / "dense.json").read_text())
    report = json.loads((ws / "metrics" / "evaluate.json").read_text())
    assert set(report) == {"base", "grpo.dense", "grpo"}       # no SFT model to evaluate
    # the gate's starting point is the base model, measured on the same held-out prompts
    assert dense["start_greedy_accuracy"] == report["base"]["greedy_accuracy"] > 0
    card = json.loads((ws / "artifacts" / "models" / "dense" / "posttrain_card.json").read_text())
    assert card["base"]["greedy_accuracy"] == report["base"]["greedy_accuracy"]   # the sentinel's floor
    assert f"grpo@dense: {'accepted' if dense['accepted'] else 'rejected'}, greedy " \
           f"{report['base']['greedy_accuracy']:.3f} -> " in out


@pytest.mark.slow
def test_lineage_promotion_and_a_second_run_that_reruns_only_evaluate(zero_runs):
    ws, _, second, runs = zero_runs
    first_id, second_id = parents(runs)["run_id"]
    children = runs[runs["tags.mlflow.parentRunId"] == second_id].set_index("tags.mlflow.runName")
    cached = {stage: tag == "true" for stage, tag in children["tags.posttrain.cached"].items()}
    assert cached == {"prepare": True, "sft": True, "grpo@dense": True, "serving": True, "evaluate": False}
    client = mlflow.MlflowClient()
    assert list(parents(runs)["tags.posttrain.tracking.promotion"]) == ["champion", "challenger"]
    assert client.get_model_version_by_alias("posttrain", "champion").run_id == first_id
    first_children = runs[runs["tags.mlflow.parentRunId"] == first_id]
    logged = client.search_logged_models(experiment_ids=list(set(runs["experiment_id"])))
    stages = {m.tags.get("posttrain.stage") for m in logged if m.source_run_id in set(first_children["run_id"])}
    assert stages == {"grpo@dense"}                             # `sft: off` logs no model of its own
    assert "Model registry: posttrain version 2 is the challenger" in second.stdout


@pytest.mark.slow
def test_replay_and_compare(zero_runs, tmp_path):
    ws, _, _, runs = zero_runs
    first_id, second_id = parents(runs)["run_id"]
    uri = f"sqlite:///{ws / 'mlflow.db'}"
    done = sh("posttrain", "replay", first_id, "--tracking-uri", uri, "--scratch", tmp_path / "replay", cwd=ws,
              check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert ", 0 DIFFERENT," in done.stdout and "evaluate.sft." not in done.stdout
    done = sh(sys.executable, "-m", "posttrain", "compare", first_id, second_id, "--tracking-uri", uri,
              "--out", tmp_path / "compare.png", cwd=ws, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "evaluate.grpo.greedy_accuracy" in done.stdout


@pytest.mark.slow
def test_dvc_repro_alone_rolls_a_harmful_stage_back_to_the_base_model(zero_runs, pretrained, tmp_path):
    ws = copy_workspace(zero_runs[0], tmp_path / "ws")
    params = ws / "configs" / "pipeline.yaml"
    config = yaml.safe_load(params.read_text())
    config["grpo"]["dense"]["trl"].update(learning_rate=5.0, max_steps=6)   # far too high: wrecks the model
    params.write_text(yaml.safe_dump(config, sort_keys=False))
    done = sh("dvc", "repro", cwd=ws)
    assert "Stage 'sft' didn't change, skipping" in done.stdout and "gate rejected stage dense" in done.stdout
    dense = json.loads((ws / "metrics" / "grpo" / "dense.json").read_text())
    assert dense["accepted"] == 0.0 and dense["candidate_greedy_accuracy"] < dense["start_greedy_accuracy"]
    assert (ws / "artifacts/models/dense" / WEIGHTS).read_bytes() == (pretrained / WEIGHTS).read_bytes()
    report = json.loads((ws / "metrics" / "evaluate.json").read_text())
    assert report["grpo"]["greedy_accuracy"] == report["base"]["greedy_accuracy"]


@pytest.mark.slow
def test_a_killed_stage_from_the_base_model_resumes_from_its_checkpoint(pretrained, tmp_path):
    ws = make_workspace(tmp_path / "ws", zero(pretrained, pass_rate_filter={"enabled": False},
                                              trl={"max_steps": 30, "save_steps": 10, "logging_steps": 10,
                                                   "save_total_limit": None, "per_device_train_batch_size": 8,
                                                   "num_generations": 4, "max_completion_length": 4}))
    sh("dvc", "repro", "sft", cwd=ws)
    kill_stage_at(ws, "grpo@dense", "checkpoints/grpo/dense/*/checkpoint-10")
    assert not (ws / "metrics" / "grpo" / "dense.json").exists()
    done = sh("dvc", "repro", "grpo@dense", cwd=ws)
    assert "posttrain: resuming from" in done.stdout
    dense = json.loads((ws / "metrics" / "grpo" / "dense.json").read_text())
    assert dense["resumed_from_step"] >= 10 and dense["steps"] == 30


@pytest.mark.parametrize("override, field, needle", [
    # the warmup on, but the first stage skips it: its model would go unused
    ({"grpo": {"dense": {"from": "base"}}}, "grpo.dense.from", "set `sft: off`"),
    # the warmup off, but the first stage starts from it
    ({"sft": False}, "grpo.dense.from", "set `from: base`"),
])
def test_the_warmup_and_the_first_stage_agree(tmp_path, override, field, needle):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"extends": str(REPO / "configs" / "pipeline.yaml"), **override}))
    done = sh("posttrain", "check", "--config", path, cwd=tmp_path, check=False)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert f"{path}: {field}" in done.stderr and needle in done.stderr


def test_a_task_without_sft_targets_runs_with_sft_off_only(tmp_path):
    """Prompts and answers only: check refuses the warmup (it would train on the bare
    answer) and names the way to run GRPO alone; with `sft: off` the same task passes."""
    (tmp_path / "custom").mkdir()
    for split, numbers in (("train", range(0, 60)), ("heldout", range(60, 80))):
        rows = [{"prompt": f"{n} plus 1?", "answer": str(n + 1)} for n in numbers]
        (tmp_path / "custom" / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = {"env": "dataset", "options": {"train": "custom/train.jsonl", "heldout": "custom/heldout.jsonl",
                                          "verifier": "exact"}}
    base = {"extends": str(REPO / "configs" / "pipeline.yaml"), "data": data, "sft": {"stop_when": None}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(base))
    done = sh("posttrain", "check", "--config", path, cwd=tmp_path, check=False)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert f"{path}: data.options.completion_field" in done.stderr and "`sft: off`" in done.stderr
    path.write_text(yaml.safe_dump({**base, "sft": False, "grpo": {"dense": {"from": "base"}}}))
    done = sh("posttrain", "check", "--config", path, cwd=tmp_path, check=False)
    assert done.returncode == 0, done.stderr
