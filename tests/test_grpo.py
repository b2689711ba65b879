"""GRPO stages on real TRL: guardrails, the gate, and resuming after kill -9."""

from __future__ import annotations

import json

import pytest

from conftest import SMALL, copy_workspace, kill_stage_at, make_workspace, sh

pytestmark = pytest.mark.slow

# SMALL, trained long enough that the SFT model is clearly better than chance: a
# harmful stage then has something to destroy.
LEARNED = {**SMALL,
           "model": {"tiny": {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1,
                              "intermediate_size": 128, "max_positions": 32}},
           # 60 epochs is the cap: the warmup stops once 16 validation rows reach 60% greedy
           "sft": {"trl": {"num_train_epochs": 60, "per_device_train_batch_size": 16, "learning_rate": 3e-3,
                           "logging_steps": 50},
                   "stop_when": {"greedy_accuracy": 0.6, "every_steps": 10, "validation_size": 16}},
           "gate": {"n_samples": 4, "k": 4, "tolerance": 0.0}}


def length_channel(env):
    """Test-only channel that prefers long completions: what a guardrail must overrule."""
    def length(completions, **_):
        return [min(1.0, len(c) / 12) for c in completions]
    return length


@pytest.mark.parametrize("aggregation", ["sum_then_normalize", "normalize_then_sum"])
def test_guardrail_gets_the_minimum_whatever_the_channels_say(tmp_path, monkeypatch, aggregation):
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from posttrain.scoring import rewards
    from posttrain.training.trl_bridge import device_defaults
    from posttrain.envs import get_env
    from posttrain.training.tiny_model import save_tiny_model

    monkeypatch.setitem(rewards.REWARDS, "length", rewards.Channel(length_channel, 0.0, 1.0))
    model_dir = tmp_path / "model"
    save_tiny_model(model_dir, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64,
                    max_positions=32, seed=0)
    env = get_env("arithmetic", operand_max=9, heldout_size=20)
    funcs, weights = rewards.build_rewards(env, {"length": 1.0, "correctness": 1.0}, guardrails=["overlong"])
    rows = env.generate(0)["train"][:8]
    args = GRPOConfig(output_dir=str(tmp_path / "out"), max_steps=1, per_device_train_batch_size=32,
                      num_generations=8, max_completion_length=12, temperature=1.5, reward_weights=weights,
                      multi_objective_aggregation=aggregation, report_to=[], save_strategy="no", seed=0,
                      log_completions=True, logging_steps=1, **device_defaults())
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=funcs, args=args,
                          train_dataset=Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]}
                                                           for r in rows]),
                          processing_class=AutoTokenizer.from_pretrained(model_dir))
    trainer.train()
    # TRL's own completion log (`log_completions`): per completion, each channel's reward and the advantage
    import pandas as pd

    logs = pd.read_parquet(tmp_path / "out" / "completions" / "completions_00001.parquet")
    completions, advantages = list(logs["completion"]), list(logs["advantage"])
    length, correct = list(logs["length"]), list(logs["correctness"])
    broken = [len(c) > 8 for c in completions]
    mixed_groups = 0
    for start in range(0, len(completions), 8):
        group = range(start, start + 8)
        if not any(broken[i] for i in group) or all(broken[i] for i in group):
            continue
        mixed_groups += 1
        lowest = min(advantages[i] for i in group)
        for i in group:
            if broken[i]:
                # the longest completions would top the length channel; the guardrail overrules it
                assert length[i] == 0.0 and correct[i] == 0.0
                assert advantages[i] == pytest.approx(lowest)
    assert mixed_groups > 0, "no group mixed violators and non-violators; the test proves nothing"


def run_repro(ws, *targets, check=True):
    return sh("dvc", "repro", *targets, cwd=ws, check=check)


@pytest.fixture(scope="module")
def learned_workspace(tmp_path_factory):
    ws = make_workspace(tmp_path_factory.mktemp("gate") / "ws", LEARNED)
    run_repro(ws, "sft")
    return ws


def test_the_sft_warmup_stops_on_its_target(learned_workspace):
    sft = json.loads((learned_workspace / "metrics" / "sft.json").read_text())
    assert sft["greedy_accuracy"] >= 0.2, sft
    # 64 rows / 16 a batch = 4 steps an epoch: the cap is 240 steps
    curve = json.loads((learned_workspace / "plots" / "sft_validation.json").read_text())
    assert sft["stop_target_reached"] == 1.0 and sft["stopped_at_step"] == curve[-1]["step"] < 240
    assert curve[-1]["greedy_accuracy"] >= 0.6 > max(p["greedy_accuracy"] for p in curve[:-1])


def test_gate_rejects_a_harmful_stage_and_keeps_the_previous_model(learned_workspace):
    import yaml

    ws = learned_workspace
    config = yaml.safe_load((ws / "configs" / "pipeline.yaml").read_text())
    config["grpo"]["dense"]["trl"].update(learning_rate=5.0, max_steps=6)   # far too high: wrecks the model
    config["grpo"]["after"] = {**config["grpo"]["dense"], "from": "dense"}
    config["grpo"]["after"]["trl"] = {**config["grpo"]["dense"]["trl"], "learning_rate": 1e-5, "max_steps": 2}
    (ws / "configs" / "pipeline.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    done = run_repro(ws)
    assert "gate rejected stage dense" in done.stdout
    dense = json.loads((ws / "metrics" / "grpo" / "dense.json").read_text())
    sft = json.loads((ws / "metrics" / "sft.json").read_text())
    assert dense["accepted"] == 0.0 and dense["candidate_greedy_accuracy"] < sft["greedy_accuracy"]
    # the rejected stage's output is the SFT model, byte for byte
    weights = "model.safetensors"
    assert (ws / "artifacts/models/dense" / weights).read_bytes() == (ws / "artifacts/models/sft" / weights).read_bytes()
    report = json.loads((ws / "metrics" / "evaluate.json").read_text())
    assert report["grpo.dense"]["greedy_accuracy"] == report["sft"]["greedy_accuracy"]
    import mlflow
    mlflow.set_tracking_uri(f"sqlite:///{ws / 'mlflow.db'}")
    runs = mlflow.search_runs(search_all_experiments=True, filter_string="tags.`posttrain.stage` = 'grpo@dense'")
    assert runs.iloc[0]["tags.posttrain.scoring.gate"] == "rejected"
    assert "greedy accuracy fell" in runs.iloc[0]["tags.posttrain.gate_reason"]


def test_killed_stage_resumes_from_its_checkpoint(tmp_path):
    overrides = {**LEARNED, "sft": {**LEARNED["sft"], "trl": {**LEARNED["sft"]["trl"], "num_train_epochs": 30}},
                 "grpo": {"dense": {"from": "sft", "pass_rate_filter": {"enabled": False},
                                    "trl": {"max_steps": 60, "save_steps": 10, "logging_steps": 10,
                                            "save_total_limit": None,   # every checkpoint stays until the end
                                            "per_device_train_batch_size": 8, "num_generations": 4}}}}
    killed = make_workspace(tmp_path / "killed", overrides)
    run_repro(killed, "sft")
    whole = copy_workspace(killed, tmp_path / "whole")   # the same SFT model: one warmup, not two
    # with every checkpoint kept, checkpoint-20 stays from step 20 until the stage clears its
    # checkpoints at the very end (a fast CPU ran the ten steps from checkpoint-20 to checkpoint-30,
    # which used to delete it, between two polls)
    kill_stage_at(killed, "grpo@dense", "checkpoints/grpo/dense/*/checkpoint-20")
    assert not (killed / "metrics" / "grpo" / "dense.json").exists()
    done = run_repro(killed, "grpo@dense")
    assert "posttrain: resuming from" in done.stdout
    run_repro(whole, "grpo@dense")
    resumed, reference = (json.loads((ws / "metrics" / "grpo" / "dense.json").read_text()) for ws in (killed, whole))
    assert resumed["resumed_from_step"] >= 20 and resumed["steps"] == reference["steps"] == 60
    assert reference["resumed_from_step"] == 0
    # the same run, interrupted or not: the same held-out result within sampling noise
    assert abs(resumed["candidate_greedy_accuracy"] - reference["candidate_greedy_accuracy"]) <= 0.1
    assert abs(resumed["reward_last"] - reference["reward_last"]) <= 0.2


def test_on_reject_stop_passes_the_model_through_later_stages(learned_workspace):
    import yaml

    ws = learned_workspace      # after the harmful-stage test: dense is harmful, `after` follows it
    config = yaml.safe_load((ws / "configs" / "pipeline.yaml").read_text())
    assert config["grpo"]["dense"]["trl"]["learning_rate"] == 5.0
    config["gate"]["on_reject"] = "stop"
    (ws / "configs" / "pipeline.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    run_repro(ws)
    after = json.loads((ws / "metrics" / "grpo" / "after.json").read_text())
    assert after == {"skipped": 1.0, "accepted": 0.0}
    weights = "model.safetensors"
    assert (ws / "artifacts/models/after" / weights).read_bytes() == (ws / "artifacts/models/sft" / weights).read_bytes()


def test_a_stage_the_filter_leaves_too_few_prompts_for_one_step_passes_the_model_on_loudly(learned_workspace):
    """Seen on SmolLM2's SQL recipe: the warmed-up model solved 99.9% of the sampled prompts,
    the filter kept 1, a step takes 2, and TRL trained 0 steps while the gate 'accepted'."""
    import yaml

    ws = learned_workspace
    config = yaml.safe_load((ws / "configs" / "pipeline.yaml").read_text())
    config["grpo"]["dense"]["pass_rate_filter"]["max_prompts"] = 1
    config["grpo"]["dense"]["trl"].update(per_device_train_batch_size=8, num_generations=4)   # 2 prompts a step
    (ws / "configs" / "pipeline.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    done = run_repro(ws, "grpo@dense")
    assert "fewer than the 2 one step takes" in done.stdout
    dense = json.loads((ws / "metrics" / "grpo" / "dense.json").read_text())
    assert dense["skipped"] == 1.0 and dense["prompts_kept"] == 1.0 and dense["prompts_per_step"] == 2.0
    weights = "model.safetensors"
    assert (ws / "artifacts/models/dense" / weights).read_bytes() == (ws / "artifacts/models/sft" / weights).read_bytes()
