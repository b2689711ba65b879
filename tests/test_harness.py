"""lm-evaluation-harness beside posttrain's evaluator (`evaluate.harness`, issue 46 item 2): real
lm-eval on the tiny model's held-out split, the user's own task folder beside it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlflow
import pytest
import yaml

from conftest import REPO, copy_workspace, sh
from hardening import assert_refused

from posttrain import preflight
from posttrain.config import load_config
from posttrain.envs import config_env
from posttrain.config import DataSection, HarnessSection
from posttrain.errors import UserError
from posttrain.scoring import harness

SUMS = [("2 + 3", "5"), ("4 + 4", "8"), ("1 + 6", "7"), ("9 + 0", "9")]


def write_user_task(folder: Path) -> None:
    """An lm-eval task of the user's own: local JSON rows, greedy generate_until, exact_match; its
    data path relative to the workspace (the evaluate stage runs there)."""
    folder.mkdir(parents=True)
    (folder / "sums.jsonl").write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in SUMS))
    (folder / "my_sums.yaml").write_text(yaml.safe_dump({
        "task": "my_sums", "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": f"{folder.name}/sums.jsonl"}}, "test_split": "test",
        "output_type": "generate_until", "doc_to_text": "{{question}}", "doc_to_target": "{{answer}}",
        "generation_kwargs": {"until": ["\n"], "do_sample": False, "max_gen_toks": 4},
        "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
        "metadata": {"version": 1.0}}))


@pytest.mark.slow
def test_lm_eval_figures_stand_beside_posttrains_own(flow_runs, tmp_path):
    """The trained workspace with `evaluate.harness` on and a task folder of the user's: only
    evaluate reruns; for base, SFT and GRPO lm-eval's exact_match on posttrain_heldout is within
    one prompt of posttrain's greedy accuracy, the user's task is scored, the summary shows both
    and the extra time, MLflow holds the figures and the task folder, and lm-eval reproduces
    posttrain_heldout from the folder left in reports/harness."""
    ws = copy_workspace(flow_runs[0], tmp_path / "ws")
    write_user_task(ws / "lm_tasks")
    params = ws / "configs" / "pipeline.yaml"
    config = yaml.safe_load(params.read_text())
    config["evaluate"]["harness"] = {"lm_eval": True, "tasks": ["lm_tasks"], "batch_size": 8}
    params.write_text(yaml.safe_dump(config, sort_keys=False))
    done = sh("posttrain", "run", "--workdir", ws, cwd=ws)
    mlflow.set_tracking_uri(f"sqlite:///{ws / 'mlflow.db'}")
    runs = mlflow.search_runs(search_all_experiments=True, order_by=["start_time ASC"])
    last_parent = runs[runs["tags.mlflow.parentRunId"].isna()].iloc[-1]["run_id"]
    children = runs[runs["tags.mlflow.parentRunId"] == last_parent].set_index("tags.mlflow.runName")
    assert {stage for stage, tag in children["tags.posttrain.cached"].items() if tag != "true"} == {"evaluate"}

    evaluate = json.loads((ws / "metrics" / "evaluate.json").read_text())
    n = evaluate["base"]["n_prompts"]
    for model in ("base", "sft", "grpo"):
        figures = evaluate[model]["harness"]
        assert abs(figures[harness.TASK]["exact_match"] - evaluate[model]["greedy_accuracy"]) <= 1 / n + 1e-9, model
        assert 0.0 <= figures["my_sums"]["exact_match.none"] <= 1.0 and figures["seconds"] > 0
    assert "lm-eval exact_match" in done.stdout and "more than posttrain's own" in done.stdout

    run = children.loc["evaluate"]
    assert run["metrics.sft.harness.posttrain_heldout.exact_match"] == evaluate["sft"]["harness"][harness.TASK][
        "exact_match"]
    listed = {a.path for a in mlflow.MlflowClient().list_artifacts(run.run_id, "harness/task")}
    assert "harness/task/posttrain_heldout.yaml" in listed and "harness/task/heldout.jsonl" in listed

    # the folder left behind is a task lm-eval runs on its own (its filter rebuilt from env.json)
    out = tmp_path / "lm_eval_out"
    sh(Path(sys.executable).parent / "lm_eval", "--model", "hf", "--model_args",
       f"pretrained={ws / 'artifacts' / 'models' / 'sft'},dtype=float32", "--include_path", ws / "reports" / "harness",
       "--tasks", harness.TASK, "--output_path", out, "--batch_size", "8", cwd=ws)
    results = json.loads(next(out.rglob("results_*.json")).read_text())
    assert results["results"][harness.TASK]["exact_match,posttrain"] == \
        evaluate["sft"]["harness"][harness.TASK]["exact_match"]


def test_the_filter_reads_replies_as_the_verifier_does():
    """A reply the verifier accepts becomes the answer; any other its parse (or ""), so
    exact_match counts exactly what posttrain's greedy accuracy counts."""
    read = harness.answer_filter({"env": "arithmetic", "options": {"answer": "last_number"}})
    docs = [{"answer": "12"}, {"answer": "7"}, {"answer": "3"}]
    assert read([["The sum is 12."], ["8"], ["no number"]], docs) == [["12"], ["8"], [""]]


def test_agreement_tolerates_one_prompt_and_no_more():
    ours = [True, False, True, False]
    assert harness.check_agreement("sft", ours, [True, False, False, False]) is None       # one prompt apart
    assert harness.check_agreement("sft", ours, [True, True, False, True]) is None         # 3 differ, same count
    problem = harness.check_agreement("sft", ours, [False, False, False, False])
    assert "sft" in problem and "2 prompts" in problem
    assert "scored 3 prompts" in harness.check_agreement("sft", ours, ours[:3])


def test_a_missing_task_folder_is_refused_before_compute(tmp_path):
    """`posttrain check`: a harness task folder that is not there, or holds no task config,
    is one line naming the list entry, exit 2; so is a task list with lm_eval off."""
    (tmp_path / "pipeline.yaml").write_text((REPO / "configs" / "pipeline.yaml").read_text())
    (tmp_path / "gpus.yaml").write_text((REPO / "configs" / "gpus.yaml").read_text())
    (tmp_path / "empty").mkdir()
    for harness_section, needles in [
        ({"lm_eval": True, "tasks": ["nowhere"]}, ("evaluate.harness.tasks[0]", "no such folder", "task YAML")),
        ({"lm_eval": True, "tasks": ["empty"]}, ("evaluate.harness.tasks[0]", "no lm-eval task config")),
        ({"tasks": ["empty"]}, ("evaluate.harness.tasks", "lm_eval: true")),
    ]:
        path = tmp_path / "variant.yaml"
        path.write_text("extends: pipeline.yaml\n" + yaml.safe_dump({"evaluate": {"harness": harness_section}}))
        assert_refused(sh("posttrain", "check", "--config", path, cwd=tmp_path, check=False), "variant.yaml",
                       *needles)


def test_a_tool_environment_is_refused(tmp_path):
    """lm-eval runs single replies: a tool environment's episodes are posttrain's alone."""
    config = load_config(REPO / "configs" / "pipeline.yaml")
    config = config.model_copy(update={"evaluate": config.evaluate.model_copy(
        update={"harness": HarnessSection(lm_eval=True)})})
    env = config_env(DataSection.model_validate({"env": "calculator"}))
    with pytest.raises(UserError) as err:
        preflight.harness_tasks(tmp_path / "c.yaml", config, env)
    assert "evaluate.harness.lm_eval" in str(err.value) and "episodes" in str(err.value)


def test_the_summary_shows_lm_eval_beside_posttrains_figures():
    from posttrain.tracking.summary import render

    figures = {"greedy_accuracy": 0.5, "greedy_accuracy_ci95": [0.45, 0.55], "pass_at_k": {"1": 0.4}, "n_prompts": 500}
    evaluate = {"base": {**figures, "harness": {harness.TASK: {"exact_match": 0.5}, "seconds": 9.0}},
                "grpo": {**figures, "harness": {harness.TASK: {"exact_match": 0.498}, "seconds": 8.0}}}
    table = render(evaluate, {}, "H100-80GB", "run", "sqlite:///m.db", "1")
    assert "| model | greedy accuracy | pass@1 | lm-eval exact_match |" in table
    assert "| base | 0.500 [0.450, 0.550] | 0.400 | 0.500 |" in table and "| grpo |" in table and "0.498 |" in table
    assert "9.0 s more than posttrain's own" in table  # the final model (grpo) is counted once, as its stage
