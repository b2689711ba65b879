"""Hostile configs (issue 12): each is one line, exit 2, from `check` and from `run`,
before a workspace is created or anything committed.

A case is a variant of the shipped pipeline.yaml (its text follows `extends:`), or a
whole file (bytes, text that says `extends:` itself, or a size in bytes). `{tmp}` is the test's folder,
which also holds the broken model folders and files the cases point at.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from hardening import assert_nothing_left, assert_refused, cli, state

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{n}: &{n} [{', '.join([f'*{p}'] * 9)}]\n" for p, n in zip("abcdefgh", "bcdefghi")) + "seed: *i\n"
PASSWORD = "hunter2-s3cret"

CASES = [
    ("sft: {trl: {learning_rate: -0.1}}", ["sft.trl.learning_rate", "greater than 0"]),            # negative lr
    ("grpo: {dense: {trl: {learning_rate: 1e-4}}}", ["grpo.dense.trl.learning_rate", "number"]),     # YAML reads 1e-4 as text
    ("sft: {trl: {learning_rate: fast}}", ["sft.trl.learning_rate", "fast"]),                      # string lr
    ("sft: {trl: {per_device_train_batch_size: 0}}", ["per_device_train_batch_size", "greater than or equal to 1"]),  # batch of 0
    ("model: {path: '{tmp}/empty'}", ["model.path", "not valid JSON"]),                             # empty config.json
    ("model: {path: '{tmp}/garbled'}", ["model.path", "not valid JSON"]),                           # invalid config.json
    ("model: {path: '{tmp}/headless'}", ["model.path", "num_attention_heads"]),                     # config.json of no decoder
    ("serving: {tensor_parallel_size: 3}", ["serving.tensor_parallel_size", "[1, 2, 4]"]),          # 3 for 4 heads / 2 KV
    ("model: {path: '{tmp}/real'}\nserving: {tensor_parallel_size: 3}", ["tensor_parallel_size", "2 KV"]),  # model.path's heads
    ("data: {options: {ops: ['/']}}", ["data.options.ops[0]", "'+', '-' or '*'"]),                # unsupported op
    ("data: {options: {opz: 1}}", ["data.options.opz", "unknown option", "operand_max"]),           # unknown env option
    ("grpo: {dense: {trl: {max_completion_length: '5'}}}", ["max_completion_length", "integer"]),   # string length
    ("seed: -1", ["seed", "greater than or equal to 0"]),                                          # negative seed
    ("seed: 1180591620717411303424", ["seed", "less than or equal to 4294967295"]),               # seed 2**70
    ("data: {options: {heldout_size: -5}}", ["data.options.heldout_size", "greater than"]),        # negative held-out
    ("data: {options: {heldout_size: 99999}}", ["data.options.heldout_size", "use at most 2499"]),  # more than the data
    ("data: {options: {completion_format: '{answr}'}}", ["completion_format", "{answer}"]),         # unknown format field
    ("data: {options: {completion_format: '{answer'}}", ["completion_format", "{answer}"]),         # broken format
    ("grpo: {dense: {pass_rate_filter: {min_pass_rate: 0.9, max_pass_rate: 0.1}}}",
     ["grpo.dense.pass_rate_filter", "min_pass_rate < max_pass_rate"]),                           # inverted band
    ("serving: {vllm_check: {dtype: int3}}", ["serving.vllm_check.dtype", "bfloat16"]),            # unknown vLLM dtype
    ("promotion: {metric: evaluate.grpo.bogus}", ["promotion.metric", "evaluate.grpo.greedy_accuracy"]),  # no such figure
    ("promotion: {metric: evaluate.grpo.pass_at_k.3}", ["promotion.metric", "not a metric"]),       # k not evaluated
    ("promotion: {metric: grpo.nosuch.steps}", ["promotion.metric", "not a metric"]),              # no such stage
    ("promotion: {model_name: ../escape}", ["promotion.model_name", "no `..`"]),                   # path in a name
    ("tracking: {uri: 'bogus://nowhere'}", ["tracking.uri", "sqlite"]),                            # unknown store
    (f"tracking: {{uri: 'http://user:{PASSWORD}@host:5000'}}", ["tracking.uri", "MLFLOW_TRACKING_PASSWORD"]),  # password
    (f"tracking: {{uri: 'postgresql://u:{PASSWORD}@h/db'}}", ["tracking.uri", "MLFLOW_TRACKING_USERNAME"]),    # password
    ("tracking: {experiment: ''}", ["tracking.experiment", "name the MLflow experiment"]),          # empty experiment
    ("evaluate: {max_new_tokens: 1e12}", ["evaluate.max_new_tokens", "not text"]),                # YAML text, not a number
    ("evaluate: {max_new_tokens: 1.0e+12}", ["evaluate.max_new_tokens", "positions"]),            # would run for hours
    ("grpo: {dense: {trl: {max_completion_length: 100}}}", ["max_completion_length", "use at most 58"]),  # past positions
    ("serving: {gpu: Z80}", ["serving.gpu", "H100-80GB"]),                                         # no gpus.yaml beside
    ("extends: loop.yaml", ["extends", "cycle"]),                                                  # extends cycle
    (b"seed: 0\nexperiment: caf\xe9\n", ["not UTF-8", "byte 23"]),                                 # Latin-1 bytes
    (BOMB, ["expands to over 100,000 values"]),                                                                # billion laughs
    (50_000_000, ["50,000,000 bytes", "limit"]),                                                   # a 50 MB file
    (b"seed: " + b"[" * 5000 + b"]" * 5000, ["nested too deeply"]),                                # deep nesting
    ("x" * 1000 + ": 1", ["unknown key"]),                                                         # a long key, not echoed
    ("grpo: {dense: {trl: {beta: .inf}}}", ["grpo.dense.trl.beta", "finite"]),                    # issue 25: accepted
    ("sft: {trl: {max_grad_norm: .nan}}", ["sft.trl.max_grad_norm", "finite"]),                    # nan, not a bound
    ("model: {tiny: {num_layers: 1000000000000}}", ["model.tiny.num_layers", "16777216"]),         # 10**12 layers
    ("data: {env: sql, options: {operand_max: null, ops: null, heldout_size: 150, db_dir: '{tmp}/afile/db'}}",
     ["data.options.db_dir", "writable folder"]),                                                  # db_dir under a file
]


@pytest.fixture(scope="module", autouse=True)
def warm_imports():
    """TRL's first import and first config object take seconds: pay them before any case
    is timed, by checking the shipped config (which must pass)."""
    done = cli("check", "--config", CONFIGS / "pipeline.yaml")
    assert done.returncode == 0, done.stderr


def setup_folder(tmp_path: Path) -> None:
    """The shipped base config (no gpus.yaml beside it) and what the cases point at."""
    shutil.copy(CONFIGS / "pipeline.yaml", tmp_path / "pipeline.yaml")
    (tmp_path / "loop.yaml").write_text("extends: variant.yaml\n")
    (tmp_path / "afile").write_text("not a folder\n")
    for name, text in [("empty", ""), ("garbled", "{not json"), ("headless", '{"model_type": "bert"}'),
                       ("real", '{"num_attention_heads": 8, "num_key_value_heads": 2, "max_position_embeddings": 512}')]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(text)


def write_case(tmp_path: Path, content: str | bytes) -> Path:
    path = tmp_path / "variant.yaml"
    if isinstance(content, int):  # a file of that many bytes (sparse: quick to write)
        path.write_bytes(b"seed: 0\n")
        os.truncate(path, content)
    elif isinstance(content, bytes):
        path.write_bytes(content)
    else:
        text = content.replace("{tmp}", str(tmp_path))
        path.write_text(text if text.startswith("extends:") else "extends: pipeline.yaml\n" + text + "\n")
    return path


@pytest.mark.parametrize("content,needles", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_refused_by_check_and_run_leaving_nothing(tmp_path, content, needles):
    setup_folder(tmp_path)
    config = write_case(tmp_path, content)
    before = state(tmp_path)
    for command in ("check", "run"):
        done = cli(command, "--config", config, cwd=tmp_path)
        assert_refused(done, *needles, secrets=(PASSWORD,))
        assert len(done.stderr) < 600, done.stderr[:600]  # no echoed input
    assert_nothing_left(tmp_path, before)
    assert not (tmp_path / "runs").exists()


def test_kv_finds_the_packaged_gpu_profiles_from_any_folder(tmp_path):
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64, '
                                          '"num_key_value_heads": 2, "torch_dtype": "bfloat16"}')
    done = cli("kv", tmp_path / "config.json", "--gpu", "H200-141GB", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr


def test_the_workspace_copy_of_gpu_profiles_is_the_package_copy():
    from posttrain.capacity.profiles import PACKAGED

    assert (CONFIGS / "gpus.yaml").read_text() == PACKAGED.read_text()
