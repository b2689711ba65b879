"""Your own data and a real model's shape (issue 13): the `dataset` environment over local
JSONL / Parquet files with a named verifier, conversational prompts through the model's
chat template, LoRA stages; bad input refused in one line before any compute; and the
whole pipeline (`posttrain run`) on a Qwen2-shaped model with a BPE tokenizer built here."""

from __future__ import annotations

import json
import random

import mlflow
import pytest
import yaml

from chat_model import build_chat_model
from conftest import REPO, check_and_run, sh
from hardening import assert_nothing_left, assert_refused, cli, state
from posttrain.envs import get_env


def math_rows(n: int, seed: int, start: int = 0) -> list[dict]:
    """Sums as a math task: the answer `\\boxed{}`ed, as open-r1's verifier reads it."""
    rng = random.Random(seed)
    pairs = rng.sample([(a, b) for a in range(start, start + 40) for b in range(40)], n)
    return [{"question": f"What is {a} + {b}?", "solution": str(a + b), "completion": f"\\boxed{{{a + b}}}"}
            for a, b in pairs]


def write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A folder holding custom/train.jsonl and custom/heldout.jsonl, the current folder."""
    write_jsonl(tmp_path / "custom" / "train.jsonl", math_rows(60, 0))
    write_jsonl(tmp_path / "custom" / "heldout.jsonl", [{k: r[k] for k in ("question", "solution")}
                                                        for r in math_rows(20, 1, start=40)])
    monkeypatch.chdir(tmp_path)
    return tmp_path


OPTIONS = {"train": "custom/train.jsonl", "heldout": "custom/heldout.jsonl", "verifier": "math",
           "prompt_field": "question", "answer_field": "solution"}


# --- verifiers: one case per line --------------------------------------------------------
@pytest.mark.parametrize("verifier, extra, completion, answer, right", [
    ("math", {}, "\\boxed{7}", "7", True),
    ("math", {}, "so \\boxed{\\frac{2}{4}}", "1/2", True),          # fractions and LaTeX, open-r1's verifier
    ("math", {}, "\\boxed{0.5}", "\\frac{1}{2}", True),
    ("math", {}, "\\boxed{8}", "7", False),
    ("math", {}, "", "7", False),
    ("exact", {}, " Paris ", "Paris", True),
    ("exact", {}, "paris", "Paris", False),
    ("numeric", {"tolerance": 0.01}, "1,000.4", "1000", True),
    ("numeric", {}, "3.0", "3", True),
    ("numeric", {}, "three", "3", False),
    ("choice", {}, "(B)", "B", True),
    ("choice", {}, "b.", "B", True),
    ("choice", {}, "The answer is B", "B", False),                 # prose is not a letter
    ("choice", {}, "E", "E", False),                                # not one of ABCD
    ("regex", {}, "order-1234", r"order-\d{4}", True),
    ("regex", {}, "order-12", r"order-\d{4}", False),
    ("exact", {"answer_pattern": "<answer>(.*?)</answer>"}, "<think>hm</think><answer>42</answer>", "42", True),
    ("exact", {"answer_pattern": "<answer>(.*?)</answer>"}, "42", "42", False),  # the format is the contract
    ("numeric", {}, "1e999", "2e999", False),                      # not finite: not a number
    ("regex", {}, "1" * 40 + "x", r"(\d+,?)+$", False),           # catastrophic backtracking: cut at 0.1 s
])
def test_verifiers(project, verifier, extra, completion, answer, right):
    env = get_env("dataset", **{**OPTIONS, "verifier": verifier, **extra})
    assert env.verify(completion, answer) is right


def test_a_verifier_on_hostile_output_is_bounded(project):
    """A catastrophically backtracking reference pattern on a long reply: the match is cut at its
    time limit (counted as a pattern timeout), and the reply scores wrong."""
    env = get_env("dataset", **{**OPTIONS, "verifier": "regex"})
    assert not env.verify("1" * 5000 + "x", r"(\d+,?)+$")
    assert env.timeout_counts()["pattern_timeouts"] == 1


def test_the_files_other_columns_reach_the_rewards(project):
    """A custom reward reading a column of the user's file, in GRPO's rows and in evaluation."""
    from posttrain.chat import grpo_rows
    from posttrain.scoring.evaluation import score

    rows = [{**r, "difficulty": i % 3} for i, r in enumerate(math_rows(60, 0))]
    write_jsonl(project / "custom" / "train.jsonl", rows)
    env = get_env("dataset", **OPTIONS)
    train = env.generate(0)["train"]
    assert grpo_rows(train)[4] == {"prompt": rows[4]["question"], "answer": rows[4]["solution"], "difficulty": 1}

    def harder_is_worth_more(completions, difficulty, answer, **_):
        return [float(d) if env.verify(c, a) else 0.0 for c, d, a in zip(completions, difficulty, answer)]

    result, samples = score(env, train[:3], [r["completion"] for r in train[:3]], [[r["completion"]] for r in train[:3]],
                            ks=[1], resamples=10, seed=0, channels={"harder": harder_is_worth_more})
    assert [s["reward.harder"] for s in samples] == [0.0, 1.0, 2.0]


def test_the_files_become_the_splits(project):
    rows = math_rows(60, 0)
    env = get_env("dataset", **OPTIONS)
    splits = env.generate(0)
    assert [r["prompt"] for r in splits["train"]] == [r["question"] for r in rows]
    assert splits["train"][0]["completion"] == rows[0]["completion"] and splits["train"][0]["answer"] == rows[0]["solution"]
    assert splits["heldout"][0]["completion"] == splits["heldout"][0]["answer"]  # no completion field: the answer
    import datasets
    datasets.Dataset.from_list(rows).to_parquet(str(project / "custom" / "train.parquet"))
    parquet = get_env("dataset", **{**OPTIONS, "train": "custom/train.parquet"}).generate(0)
    assert parquet["train"] == splits["train"]


def test_format_and_length_channels(project):
    from posttrain.scoring.rewards import build_rewards

    env = get_env("dataset", **{**OPTIONS, "verifier": "exact", "answer_pattern": "<answer>(.*?)</answer>",
                                "format_pattern": r"<think>.*?</think>\s*<answer>.*?</answer>"})
    (fmt, length), _ = build_rewards(env, {"format": 1.0, "length": 0.1})
    completions = ["<think>x</think> <answer>1</answer>", "<answer>1</answer>", "x" * 2000]
    assert fmt(completions, answer=["1"] * 3) == [1.0, 0.0, 0.0]
    assert length(completions, answer=["1"] * 3) == [-0.035, -0.018, -1.0]  # -characters / 1000
    # conversational completions (TRL passes messages): the same scores
    chat = [[{"role": "assistant", "content": c}] for c in completions]
    assert fmt(chat, answer=["1"] * 3) == [1.0, 0.0, 0.0]


# --- bad input: one line, before any compute ---------------------------------------------
def bad_configs(project) -> list[tuple[dict, list[str]]]:
    model = project / "model"
    (model).mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"num_attention_heads": 2, "num_key_value_heads": 1,
                                                   "max_position_embeddings": 512}))
    (model / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))   # no chat template
    write_jsonl(project / "custom" / "nofield.jsonl", [{"q": "a", "solution": "1"}])
    write_jsonl(project / "custom" / "mc.jsonl", [{"q": "a"}])    # no answer column
    write_jsonl(project / "custom" / "leak.jsonl", math_rows(20, 1, start=40)[:3])
    (project / "outside.jsonl").write_text("{}\n")
    # 60 training rows: no validation split carved for stop_when
    data = lambda **o: {"data": {"env": "dataset", "options": {**OPTIONS, **o}}, "sft": {"stop_when": None}}
    return [
        (data(train="custom/missing.jsonl"), ["data.options.train", "custom/missing.jsonl not found"]),
        (data(train="outside.jsonl"), ["data.options.train", "not inside the workspace's custom/"]),
        (data(train="custom/nofield.jsonl"), ["data.options.prompt_field", "no field 'question'", "'q'"]),
        (data(verifier="maths"), ["data.options.verifier", "math"]),
        (data(answer_pattern="<a>.*</a>"), ["data.options.answer_pattern", "has 0 groups"]),
        (data(train="custom/leak.jsonl"), ["data.options.heldout", "3 held-out prompts are also in"]),
        ({**data(), "data": {**data()["data"], "chat": True}}, ["data.chat", "tiny built-in model has no chat template"]),
        ({**data(), "data": {**data()["data"], "chat": True}, "model": {"path": str(model)}},
         ["data.chat", "has no chat template"]),
        ({**data(), "sft": {"stop_when": None, "peft": {"lora_alhpa": 8}}}, ["sft.peft.lora_alhpa", "unknown LoraConfig option", "'lora_alpha'"]),
        ({**data(), "sft": {"stop_when": None, "peft": {"rank": 8}}}, ["sft.peft.rank", "'r'"]),
        ({**data(), "sft": {"stop_when": None, "peft": {"r": "eight"}}}, ["sft.peft"]),
        ({**data(), "sft": {"stop_when": None, "peft": {"r": 0}}}, ["sft.peft.r", "greater than or equal to 1"]),
        (data(verifier="choice", train="custom/mc.jsonl", prompt_field="q", answer_field="a"), ["data.options", "mc.jsonl"]),
    ]


def test_bad_dataset_chat_and_lora_settings_are_refused_in_one_line(project):
    for override, needles in bad_configs(project):
        path = project / "configs" / "bad.yaml"
        path.parent.mkdir(exist_ok=True)
        path.write_text(yaml.safe_dump({"extends": str(REPO / "configs" / "pipeline.yaml"), **override}))
        before = state(project)
        for command in ("check", "run"):
            done = cli(command, "--config", path, *(["--workdir", project / "ws"] if command == "run" else []),
                       cwd=project)
            assert_refused(done, str(path), *needles)
        assert_nothing_left(project, before)


def test_a_chat_template_that_fails_is_one_line(project):
    model = build_chat_model(project / "chat-model", ["What is 1 + 1?"] * 20, vocab_size=300)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "chat_template.jinja").unlink(missing_ok=True)
    config["chat_template"] = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not "
                               "supported') }}{% endif %}{{ messages[0]['content'] }}")
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    path = project / "configs" / "chat.yaml"
    path.parent.mkdir()
    path.write_text(yaml.safe_dump({"extends": str(REPO / "configs" / "pipeline.yaml"), "model": {"path": str(model)},
                                    "sft": {"stop_when": None},
                                    "data": {"env": "dataset", "chat": True, "options": {**OPTIONS, "system": "Be brief."}}}))
    assert_refused(cli("check", "--config", path, cwd=project), "chat template", "System role not supported",
                   "drop data.options.system")


def test_incoming_rows_are_checked_by_the_dataset_verifier(project):
    from posttrain.ingest import check_row

    env = get_env("dataset", **{**OPTIONS, "verifier": "choice"})
    assert check_row(env, {"prompt": "Pick one", "answer": "B"}, set()) is None
    assert "'E'" in check_row(env, {"prompt": "Pick one", "answer": "E"}, set())  # not a choice: refused
    assert "not one of ABCD" in env.check_row({"prompt": "Pick one", "answer": "AB"})  # one letter, not a substring
    assert "not one of ABCD" in env.check_row({"prompt": "Pick one", "answer": "E"})
    assert "does not parse" in check_row(env, {"prompt": "Pick", "answer": "B", "completion": "I think B"}, set())


# --- the whole pipeline on a real model's shape ---------------------------------------------
@pytest.mark.slow
def test_the_pipeline_runs_a_chat_model_with_lora_on_your_files(project):
    train, heldout = math_rows(60, 0), math_rows(20, 1, start=40)
    texts = [f"{r['question']} {r['completion']} Answer with \\boxed{{}}." for r in train + heldout] * 5
    model = build_chat_model(project / "qwen2-tiny", texts)
    config = {
        "extends": str(REPO / "configs" / "pipeline.yaml"),
        "model": {"path": str(model)},
        "data": {"env": "dataset", "chat": True,
                 "options": {**OPTIONS, "system": "Put the final answer in \\boxed{}."}},
        "sft": {"trl": {"num_train_epochs": 2, "per_device_train_batch_size": 16, "learning_rate": 1e-3,
                        "logging_steps": 2, "max_length": 128},
                "stop_when": None, "peft": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}},
        "grpo": {"dense": {"from": "sft", "rewards": {"correctness": 1.0, "format": 0.2}, "guardrails": ["unparseable"],
                           "pass_rate_filter": {"enabled": False},
                           "peft": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
                           "trl": {"max_steps": 2, "per_device_train_batch_size": 4, "num_generations": 4,
                                   "max_completion_length": 12, "logging_steps": 1, "save_steps": 100}}},
        "evaluate": {"n_samples": 2, "k": [1, 2], "max_new_tokens": 12, "backend": "transformers"},
        "serving": {"context_length": 256, "session_lengths": [128, 256], "load_test": {"enabled": False}},
        "gate": {"n_samples": 2, "k": 2, "tolerance": 1.0},
        "orchestration": {"retries": 0},
        "stats": {"bootstrap_resamples": 200},
    }
    ws = check_and_run(project, "chat", config)

    rows = [json.loads(line) for line in (ws / "data" / "train.jsonl").read_text().splitlines()]
    assert rows[0]["prompt"].startswith("<|im_start|>system\nPut the final answer")      # the model's template
    assert rows[0]["prompt"].endswith("<|im_start|>assistant\n") and rows[0]["messages"][-1]["role"] == "user"
    for stage in ("sft", "dense"):
        folder = ws / "artifacts" / "models" / stage
        assert (folder / "adapter" / "adapter_config.json").is_file()          # the LoRA adapter
        assert (folder / "model.safetensors").is_file() and (folder / "config.json").is_file()  # merged
    grpo = json.loads((ws / "metrics" / "grpo" / "dense.json").read_text())
    assert grpo["steps"] == 2 and grpo["accepted"] in (0.0, 1.0)              # the gate decided
    serving = json.loads((ws / "metrics" / "serving.json").read_text())
    for field in ("num_blocks", "kv_cache_tokens", "max_concurrency"):      # vLLM loaded the merged model
        assert serving[f"vllm_{field}"] == serving[f"predicted_{field}"] > 0, serving
    mlflow.set_tracking_uri(f"sqlite:///{ws / 'mlflow.db'}")
    runs = mlflow.search_runs(search_all_experiments=True, output_format="list")
    by_stage = {r.data.tags.get("posttrain.stage"): r for r in runs}
    client = mlflow.MlflowClient()
    for stage in ("sft", "grpo@dense"):
        names = {f.path for f in client.list_artifacts(by_stage[stage].info.run_id, "adapter")}
        assert "adapter/adapter_config.json" in names, names
    parent = next(r for r in runs if r.data.tags.get("posttrain.flow") == "retrain")
    final = client.get_model_version_by_alias("posttrain", "champion").source.removeprefix("models:/")
    assert client.get_logged_model(final).source_run_id == parent.info.run_id   # the final model, a logged model
    logged = {f.path for f in client.list_logged_model_artifacts(final)}
    assert {"model.safetensors", "adapter"} <= logged, logged   # the merged model and its adapter

    # a verifier option changes no row, only how completions score: every stage that scores
    # must rerun (it read as up to date, and gates, rewards and evaluation kept the old figures)
    params = ws / "configs" / "pipeline.yaml"
    written = yaml.safe_load(params.read_text())
    written["data"]["options"]["tolerance"] = 0.5
    params.write_text(yaml.safe_dump(written, sort_keys=False))
    stale = set(yaml.safe_load(sh("dvc", "status", "--json", cwd=ws).stdout))
    # serving too: an environment's options can change its episodes (a tool environment's sessions)
    assert stale == {"prepare", "sft", "grpo@dense", "serving", "evaluate"}, stale


# Qwen/Qwen2.5-0.5B-Instruct's published config.json
QWEN25_05B_INSTRUCT = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
    "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02, "intermediate_size": 4864,
    "max_position_embeddings": 32768, "max_window_layers": 21, "model_type": "qwen2", "num_attention_heads": 14,
    "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "transformers_version": "4.43.1",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}


def test_the_qwen_recipe_checks_against_the_published_config(tmp_path):
    """The recipe as its header says to run it: the model folder (its published config.json
    and a chat tokenizer) and MATH-shaped files in custom/, then `posttrain check`."""
    recipe = REPO / "configs" / "recipes" / "qwen2.5-0.5b-math.yaml"
    header = recipe.read_text()
    assert "huggingface-cli download Qwen/Qwen2.5-0.5B-Instruct --local-dir models/Qwen2.5-0.5B-Instruct" in header
    assert "posttrain run --config configs/recipes/qwen2.5-0.5b-math.yaml" in header
    model = tmp_path / "models" / "Qwen2.5-0.5B-Instruct"
    build_chat_model(model, ["What is 1 + 1? \\boxed{2}"] * 20, vocab_size=300)   # the tokenizer and its template
    (model / "config.json").write_text(json.dumps(QWEN25_05B_INSTRUCT))
    problem = lambda i: {"problem": f"Compute {i} + {i}.", "solution": f"Twice {i} is $\\boxed{{{2 * i}}}$."}
    write_jsonl(tmp_path / "custom" / "math_train.jsonl", [problem(i) for i in range(300)])
    write_jsonl(tmp_path / "custom" / "math_test.jsonl", [problem(i) for i in range(300, 350)])
    done = cli("check", "--config", recipe, "--elsewhere", cwd=tmp_path)   # for its GPU machine
    assert done.returncode == 0, done.stderr
    assert "every training stage fits H100-80GB" in done.stdout            # its memory plan (issue 15)
    import torch

    if not torch.cuda.is_available():  # here: GRPO's vLLM generation is refused before any compute
        assert_refused(cli("check", "--config", recipe, cwd=tmp_path), "grpo.math.trl.use_vllm", "CUDA",
                       "use_vllm: false")
    config = yaml.safe_load(recipe.read_text())
    assert config["sft"]["peft"] and config["grpo"]["math"]["peft"]                              # LoRA
    assert config["grpo"]["math"]["trl"]["use_vllm"] and config["grpo"]["math"]["trl"]["vllm_mode"] == "colocate"
    assert config["sft"]["trl"]["bf16"] and config["grpo"]["math"]["trl"]["gradient_checkpointing"]


def test_prose_targets_for_a_choice_task_stop_sft_before_compute(project):
    """The format contract on a real task: one-letter answers, prose SFT targets."""
    from posttrain.errors import UserError
    from posttrain.scoring.evaluation import check_format_contract

    rows = [{"question": f"Q{i}: pick one", "solution": "B", "completion": "I think the answer is B"} for i in range(40)]
    rows[:10] = [{**r, "completion": "B"} for r in rows[:10]]
    write_jsonl(project / "custom" / "mc.jsonl", rows)
    env = get_env("dataset", **{**OPTIONS, "train": "custom/mc.jsonl", "verifier": "choice"})
    with pytest.raises(UserError) as err:
        check_format_contract(env, env.generate(0)["train"], where="data/train.jsonl")
    message = str(err.value)
    assert "30 of 40 SFT targets fail the dataset environment's verifier" in message
    assert "target 'I think the answer is B' parses as 'None', expected 'B'" in message


def test_lengths_are_checked_on_the_prompt_inside_the_chat_template(project):
    model = build_chat_model(project / "chat-model", ["What is 1 + 1? \\boxed{2}"] * 20, vocab_size=300, positions=120)
    config = {"extends": str(REPO / "configs" / "pipeline.yaml"), "model": {"path": str(model)},
              "data": {"env": "dataset", "chat": True, "options": {**OPTIONS, "system": "Answer in \\boxed{}."}},
              "sft": {"stop_when": None}, "evaluate": {"max_new_tokens": 8}, "grpo": {"dense": {"trl": {"max_completion_length": 5}}}}
    path = project / "configs" / "chat.yaml"
    path.parent.mkdir()
    path.write_text(yaml.safe_dump(config))
    # the longest prompt is 16 characters; inside ChatML with the system turn, 115
    assert_refused(cli("check", "--config", path, cwd=project), "evaluate.max_new_tokens", "prompt of up to 115",
                   "use at most 5")
    config["data"]["chat"] = False
    path.write_text(yaml.safe_dump(config))
    assert cli("check", "--config", path, cwd=project).returncode == 0
