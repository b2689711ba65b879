"""A tool environment through the whole pipeline, on a small chat model built offline:
`posttrain check` (tool checks, a dry episode), prepare (prompts with the tools' schemas),
SFT on the gold episodes (assistant tokens only), GRPO with TRL's environment_factory
(tool results masked out of the loss), the gates and the evaluation over whole episodes."""

from __future__ import annotations

import json

from pathlib import Path

import mlflow
import pytest
import yaml

from chat_model import build_chat_model, memorized_model
from conftest import check_and_run, make_workspace, sh
from posttrain.chat import TOOL_TEMPLATE
from posttrain.envs.calculator import CalculatorEnv

REPO = Path(__file__).resolve().parents[1]


def calculator_config(model: Path, **overrides) -> dict:
    config = {
        "extends": str(REPO / "configs" / "pipeline.yaml"),
        "model": {"path": str(model)},
        "data": {"env": "calculator", "chat": True, "options": {"heldout_size": 8, "train_size": 64}},
        "sft": {"trl": {"max_steps": 4, "per_device_train_batch_size": 8, "learning_rate": 1e-3,
                        "logging_steps": 2, "max_length": 512}, "stop_when": None},
        "grpo": {"dense": {"from": "sft", "rewards": {"correctness": 1.0}, "guardrails": [],
                           "pass_rate_filter": {"enabled": False, "max_prompts": 8},
                           "trl": {"max_steps": 2, "per_device_train_batch_size": 4, "num_generations": 4,
                                   "max_completion_length": 48, "logging_steps": 1, "save_steps": 100}}},
        "evaluate": {"n_samples": 2, "k": [1, 2], "max_new_tokens": 48, "backend": "transformers"},
        "serving": {"context_length": 1024, "session_lengths": [512, 1024], "load_test": {"enabled": False},
                    "vllm_check": {"enabled": False}},
        "gate": {"n_samples": 2, "k": 2, "tolerance": 1.0},
        "orchestration": {"retries": 0},
        "stats": {"bootstrap_resamples": 200},
    }
    for key, value in overrides.items():
        config[key] = {**config.get(key, {}), **value}
    return config


@pytest.fixture
def tool_model(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rows = CalculatorEnv().generate(0)["train"][:200]
    texts = [r["prompt"] for r in rows] + [TOOL_TEMPLATE.read_text()] * 5
    return build_chat_model(tmp_path / "chat-model", texts, vocab_size=600, positions=1024)


@pytest.mark.slow
def test_the_calculator_runs_every_stage_with_tools(tmp_path, tool_model):
    path = tmp_path / "configs" / "tools.yaml"
    path.parent.mkdir()
    served = {"load_test": {"requests": 4, "concurrency": 2, "max_num_seqs": 2}, "vllm_check": {"kv_memory_mib": 64}}
    gate = {"episodes_backend": "vllm"}  # the gates' episodes in a vLLM process (the TRL-class test keeps transformers)
    path.write_text(yaml.safe_dump(calculator_config(tool_model, serving=served, gate=gate), sort_keys=False))
    checked = sh("posttrain", "check", "--config", path, cwd=tmp_path)
    assert "posttrain's tool-capable ChatML" in checked.stdout + checked.stderr
    ws = tmp_path / "ws"
    sh("posttrain", "run", "--config", path, "--workdir", ws, cwd=tmp_path, timeout=1500)

    rows = [json.loads(line) for line in (ws / "data" / "train.jsonl").read_text().splitlines()]
    assert len(rows) == 64 and '"name": "calc"' in rows[0]["prompt"]    # the tools' schema in the prompt
    assert rows[0]["trace"][0]["tool_calls"][0]["function"]["name"] == "calc"
    sft = ws / "artifacts" / "models" / "sft"
    saved = json.loads((sft / "tokenizer_config.json").read_text())
    assert saved.get("response_template") and "<tool_call>" in (sft / "chat_template.jinja").read_text()
    grpo = json.loads((ws / "metrics" / "grpo" / "dense.json").read_text())
    assert grpo["steps"] == 2 and grpo["accepted"] in (0.0, 1.0)
    report = json.loads((ws / "metrics" / "evaluate.json").read_text())
    for model in ("base", "sft", "grpo"):
        episodes = report[model]["episodes"]
        assert set(episodes) == {"turns", "tool_calls", "tool_errors", "tokens", "truncated_rate"}
        assert episodes["turns"] >= 1 and episodes["tokens"] > 0
    serving = json.loads((ws / "reports" / "serving.json").read_text())  # a session is a whole episode, replayed
    assert serving["episode_max_tokens"] == serving["episode_prompt_tokens_max"] + 48  # evaluate.max_new_tokens
    assert serving["episode_max_concurrency"] >= serving["max_concurrency"]
    assert serving["load_sessions"] == 4 and serving["load_failed_sessions"] == 0
    assert 1 <= serving["load_turns_per_session"] and serving["load_peak_session_tokens"] <= serving["episode_max_tokens"]
    mlflow.set_tracking_uri(f"sqlite:///{ws / 'mlflow.db'}")
    runs = mlflow.search_runs(search_all_experiments=True, output_format="list")
    evaluate = next(r for r in runs if r.data.tags.get("posttrain.stage") == "evaluate")
    tables = {f.path for f in mlflow.MlflowClient().list_artifacts(evaluate.info.run_id, "episodes")}
    assert {"episodes/base.json", "episodes/sft.json"} <= tables, tables


@pytest.mark.slow
def test_retrieval_passes_check_and_prepare_writes_its_index_beside_the_splits(tmp_path, tool_model):
    """The retrieval built-in through `check` (its dry episode searches) and the prepare stage:
    the index lands in data/index (an output DVC versions), named in the manifest."""
    config = calculator_config(tool_model, data={"env": "retrieval", "options": {"towns": 40, "heldout_size": 8}})
    path = tmp_path / "retrieval.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    sh("posttrain", "check", "--config", path, cwd=tmp_path)
    ws = make_workspace(tmp_path / "ws", {k: v for k, v in config.items() if k != "extends"})
    sh("posttrain", "stage", "prepare", "--config", "configs/pipeline.yaml", "--data-dir", "data", "--datasets-dir",
       "datasets", "--model-dir", "artifacts/models/base", "--metrics-path", "metrics/prepare.json", cwd=ws)
    manifest = json.loads((ws / "data" / "manifest.json").read_text())
    assert manifest["index"]["documents"] == 40 and (ws / "data" / "index" / "corpus.sha256").is_file()
    row = json.loads((ws / "data" / "train.jsonl").read_text().splitlines()[0])
    assert '"name": "search"' in row["prompt"] and row["trace"][0]["tool_calls"][0]["function"]["name"] == "search"


def test_check_refuses_a_tool_env_without_chat_in_one_line(tmp_path, tool_model):
    config = calculator_config(tool_model)
    config["data"]["chat"] = False
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    done = sh("posttrain", "check", "--config", path, cwd=tmp_path, check=False)
    assert done.returncode == 2 and "data.chat" in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_check_refuses_a_user_tool_env_whose_tool_is_untyped(tmp_path, tool_model):
    (tmp_path / "custom").mkdir()
    (tmp_path / "custom" / "badtools.py").write_text(
        "from posttrain.envs.calculator import CalculatorEnv\n\n"
        "class Episode:\n"
        "    def reset(self, **row):\n        return None\n\n"
        "    def calc(self, expression):\n"
        "        \"\"\"Evaluate.\n\n        Args:\n            expression: it\n        \"\"\"\n"
        "        return '1'\n\n"
        "class Env(CalculatorEnv):\n    episode = Episode\n")
    config = calculator_config(tool_model)
    config["data"]["env"] = "custom.badtools:Env"
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    done = sh("posttrain", "check", "--config", path, cwd=tmp_path, check=False)
    assert done.returncode == 2 and "calc" in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


@pytest.mark.slow
def test_grpo_gives_no_tool_result_token_a_loss_weight(tmp_path):
    """TRL's own tool loop, through posttrain's guarded episode, on a model that calls the
    calculator: the tokens of the tool's reply are in the completion (the model reads them)
    and out of the loss mask; the model's own tokens, before and after, are in it."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from posttrain.chat import grpo_rows, render
    from posttrain.envs.tools import guard
    from posttrain.scoring.rewards import build_rewards

    env = CalculatorEnv()
    row = env.generate(0)["train"][0]
    folder = memorized_model(tmp_path / "model", row, env)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    rows = render([row], tokenizer, env.system)
    funcs, _ = build_rewards(env, {"correctness": 1.0}, [])
    args = GRPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, max_steps=1, report_to=[],
                      per_device_train_batch_size=2, num_generations=2, max_completion_length=96,
                      temperature=0.01, max_tool_calling_iterations=env.max_turns)
    trainer = GRPOTrainer(model=str(folder), reward_funcs=funcs, args=args,
                          train_dataset=Dataset.from_list(grpo_rows(rows * 2)), processing_class=tokenizer,
                          environment_factory=guard(env.episode))
    out = trainer._generate_and_score_completions(grpo_rows(rows * 2))
    for ids, mask, model_mask in zip(out["completion_ids"].tolist(), out["tool_mask"].tolist(),
                                     out["completion_mask"].tolist()):
        tool_part = tokenizer.decode([t for t, m, c in zip(ids, mask, model_mask) if c and not m])
        model_part = tokenizer.decode([t for t, m, c in zip(ids, mask, model_mask) if c and m])
        assert f"<tool_response>\n{row['answer']}\n</tool_response>" in tool_part, tool_part
        assert "<tool_call>" in model_part and "<tool_response>" not in model_part, model_part
        assert row["answer"] in model_part.split("</tool_call>")[-1]  # the answer after the result is trained
    assert out["advantages"].shape[0] == 2


INVENTORY = '''
STOCK = {"bolts": 12, "nuts": 40, "gears": 7, "belts": 19, "chains": 3, "levers": 25}


class Inventory:
    """A warehouse behind one lookup tool, as TRL's environment_factory takes it."""

    def reset(self, **row):
        self.looked = False
        return None

    def stock(self, item: str) -> int:
        """How many of an item the warehouse holds.

        Args:
            item: The item's name, e.g. "bolts".
        """
        self.looked = True
        return STOCK[item]

    def get_reward(self) -> float:
        return 0.5 if self.looked else 0.0
'''


@pytest.mark.slow
def test_a_trl_environment_class_runs_through_the_pipeline_with_no_other_code(tmp_path, monkeypatch):
    """A TRL environment (reset, a typed tool, get_reward) in custom/, the user's rows in
    JSONL, and the config: `posttrain run` does the rest (TRL adds get_reward as a reward
    channel; the verdict is the dataset verifier's on the last reply)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "custom").mkdir()
    (tmp_path / "custom" / "inventory.py").write_text(INVENTORY)
    stock = {"bolts": 12, "nuts": 40, "gears": 7, "belts": 19, "chains": 3, "levers": 25}
    rows = [{"question": f"How many {item} are in stock?{' ' * i}", "answer": str(count), "completion": str(count)}
            for i in range(6) for item, count in stock.items()]
    for name, part in (("train", rows[:30]), ("heldout", rows[30:])):
        (tmp_path / "custom" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    model = build_chat_model(tmp_path / "chat-model", [r["question"] for r in rows] + [TOOL_TEMPLATE.read_text()] * 5,
                             vocab_size=600, positions=1024)
    config = calculator_config(model)
    config["data"] = {"env": "dataset", "chat": True, "episode": "custom.inventory:Inventory",
                      "options": {"train": "custom/train.jsonl", "heldout": "custom/heldout.jsonl",
                                  "verifier": "numeric", "prompt_field": "question",
                                  "system": "Look the count up, then reply with the number only."}}
    ws = check_and_run(tmp_path, "inventory", config)
    log = (ws / "logs" / "grpo@dense.log").read_text()
    assert "'rewards/Inventory/mean'" in log  # TRL's channel of get_reward, named after the class
    report = json.loads((ws / "metrics" / "evaluate.json").read_text())
    assert report["grpo"]["episodes"]["turns"] >= 1


@pytest.mark.slow
def test_vllm_runs_the_same_episodes_as_transformers(tmp_path):
    """The evaluation's episodes on vLLM (its own process, the environment built again from
    the config's data section) and on transformers: the same greedy episode of a model that
    calls the calculator, turn by turn; sampled episodes come back with their counts."""
    from posttrain.config import DataSection
    from posttrain.scoring.evaluation import sample_tool_models

    env = CalculatorEnv()
    row = env.generate(0)["train"][0]
    folder = str(memorized_model(tmp_path / "model", row, env))
    runs = {backend: sample_tool_models({"m": folder}, env, [row], n=2, temperature=1.0, max_tokens=96, seed=0,
                                        backend=backend, data=DataSection(env="calculator", chat=True))
            for backend in ("transformers", "vllm")}
    (greedy, sampled), episodes = runs["vllm"][0]["m"], runs["vllm"][1]["m"]
    assert env.verify(greedy[0], row["answer"]) and len(sampled[0]) == 2
    assert episodes[0].messages == runs["transformers"][1]["m"][0].messages
    assert (episodes[0].turns, episodes[0].tool_calls, episodes[0].instance.tool_calls) == (2, 1, 1)
