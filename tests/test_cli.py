"""The CLI: valid input runs; bad input exits 2 with one line on stderr, no traceback."""

import json
from pathlib import Path

import pytest

from hardening import cli

REPO = Path(__file__).resolve().parents[1]


def posttrain(*args, cwd=REPO):
    """The command in this process (tests/hardening.py): the same exit code and output,
    without seconds of imports per case."""
    return cli(*args, cwd=cwd)


def assert_one_line_error(done, *needles):
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert all(n in lines[0] for n in needles), lines[0]


def test_check_accepts_the_default_config():
    done = posttrain("check", "--config", "configs/pipeline.yaml")
    assert done.returncode == 0 and "ok" in done.stdout


@pytest.mark.parametrize("args,needles", [
    (["check", "--config", "missing.yaml"], ["missing.yaml", "not found"]),       # no such file
    (["check"], ["--config"]),                                                     # missing argument
    (["frobnicate"], ["invalid choice"]),                                          # unknown command
    (["kv", "nowhere/config.json"], ["nowhere", "config.json"]),                   # kv: missing model
    (["kv", "configs/gpus.yaml"], ["config lacks"]),                               # kv: not a model config
    (["stage", "sft", "--config", "configs/pipeline.yaml", "--bogus", "x"],
     ["unknown flag --bogus", "--base-dir"]),                                      # stage: a flag main lacks
    (["stage", "prepare", "--config", "configs/pipeline.yaml"], ["missing --data-dir"]),  # stage: a path missing
    (["stage", "evaluate", "--config"], ["--flag value pairs"]),                   # stage: a flag without value
])
def test_bad_arguments(args, needles):
    assert_one_line_error(posttrain(*args), *needles)


def test_each_stage_declares_the_flags_its_main_takes():
    """posttrain.stages.STAGES is what `posttrain stage NAME` checks flags against before the
    stage is imported: each declaration is its `main`'s required keyword-only parameters, in
    order, and each declared import exists."""
    import importlib
    import inspect

    from posttrain.stages import STAGES

    assert set(STAGES) == {p.stem for p in (REPO / "posttrain" / "stages").glob("*.py")} - {"__init__"}
    for name, declared in STAGES.items():
        parameters = inspect.signature(importlib.import_module(f"posttrain.stages.{name}").main).parameters.values()
        assert declared.flags == tuple(p.name for p in parameters
                                       if p.kind is p.KEYWORD_ONLY and p.default is p.empty), name
        for module, attribute in declared.imports:
            assert hasattr(importlib.import_module(module), attribute), (name, module, attribute)


def test_check_rejects_a_malformed_config(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("grpo: {a: {from: sft, trl: {learnin_rate: 1}}}\n")
    assert_one_line_error(posttrain("check", "--config", bad), "bad.yaml", "grpo.a.trl.learnin_rate")


@pytest.fixture
def tiny_config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
                                "hidden_size": 128, "torch_dtype": "float32"}))
    return path


def test_kv_json_matches_vllm_on_this_machine(tiny_config):
    # Seen here with vLLM's CPU engine and 1 GiB of KV space (shared REFERENCE):
    # "CPU KV cache size: 1,048,576 tokens, Maximum concurrency for 256 tokens per request: 4096.00x"
    done = posttrain("kv", tiny_config, "--kv-memory-gib", 1, "--context", 256, "--block-size", 128, "--json")
    report = json.loads(done.stdout)
    assert report["kv_bytes_per_token"] == 1024 and report["kv_cache_tokens"] == 1_048_576
    assert report["max_concurrency"] == 4096.0 and report["num_blocks"] == 8192


@pytest.mark.parametrize("flags,needles", [
    (["--gpu", "Z80"], ["unknown GPU profile", "H100-80GB"]),    # unknown GPU name
    (["--kv-memory-gib", "-1"], ["--kv-memory-gib"]),             # negative size
    (["--context", "0"], ["--context"]),                          # empty context
])
def test_kv_bad_input(tiny_config, flags, needles):
    assert_one_line_error(posttrain("kv", tiny_config, *flags), *needles)
