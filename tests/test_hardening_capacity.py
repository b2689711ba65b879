"""Hostile input to the capacity and launcher commands (issue 25): `posttrain memory`,
`kv`, `join` and the launcher checks of `posttrain check`. Each ends in one line, exit 2,
nothing written; a pipe whose reader leaves ends quietly; `posttrain join` says what it
waits for, and its own time limit (launcher.rdzv_timeout_s) ends the wait.

In the tables `{big}` is a 400-digit number (10**400: past a float), `{tmp}` the test's
folder, which holds the model configs (`MODELS`), accelerate configs (`ACCELERATE`) and
a FIFO (`fifo`) the cases point at.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hardening import assert_nothing_left, assert_refused, cli, cli_process, state

REPO = Path(__file__).resolve().parents[1]
BIG = str(10**400)
MODEL = {"model_type": "llama", "vocab_size": 1000, "hidden_size": 128, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 512, "max_position_embeddings": 64}
MODELS = {  # model folders, each with this config.json
    "ok": MODEL,
    "vocab_big": {**MODEL, "vocab_size": 10**400},
    "hidden_big": {**MODEL, "hidden_size": 10**400},
    "heads_big": {**MODEL, "num_attention_heads": 10**400},
    "mlp_big": {**MODEL, "intermediate_size": 10**400},
    "layers_1e30": {**MODEL, "num_hidden_layers": 1e30},
    "layers_float": {**MODEL, "num_hidden_layers": 4.0},
    "layers_bool": {**MODEL, "num_hidden_layers": True},
    "layers_text": {**MODEL, "num_hidden_layers": "4"},
}
ACCELERATE = {  # accelerate config files
    "zero7.yaml": "distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 7\n",
    "zero_text.yaml": "distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: three\n",
    "ds_list.yaml": "distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: {tmp}/list.json\n",
    "ds_fifo.yaml": "distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: {tmp}/fifo\n",
    "ds_name.yaml": "distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: '123'\n",
    "binary.yaml": b"\x00\x01\xff\xfe",
}


def write_files(tmp: Path) -> None:
    for name, config in MODELS.items():
        (tmp / name).mkdir()
        (tmp / name / "config.json").write_text(json.dumps(config))
    for name, text in ACCELERATE.items():
        data = text if isinstance(text, bytes) else text.replace("{tmp}", str(tmp)).encode()
        (tmp / name).write_bytes(data)
    (tmp / "list.json").write_text("[1, 2]")
    (tmp / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    (tmp / "huge.json").write_bytes(b" " * (17 * 2**20) + b"{}")
    (tmp / "a_folder").mkdir()
    os.mkfifo(tmp / "fifo")
    (tmp / "hostile_weights").mkdir()
    (tmp / "hostile_weights" / "config.json").write_text(json.dumps(MODEL))
    header = json.dumps({"w": {"dtype": "BF16", "shape": [10**400], "data_offsets": [0, 0]}}).encode()
    (tmp / "hostile_weights" / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    (tmp / "huge_header").mkdir()
    (tmp / "huge_header" / "config.json").write_text(json.dumps(MODEL))
    (tmp / "huge_header" / "model.safetensors").write_bytes(struct.pack("<Q", 2**63))


@pytest.fixture
def here(tmp_path):
    write_files(tmp_path)
    return tmp_path


# --- numbers a flag or a config.json gives: one line naming it and its range ------------------
NUMBERS = [
    (["memory", "ok", "--seq", BIG], ["--seq", "16,777,216"]),                          # 10**400 tokens: was OverflowError
    (["memory", "ok", "--seq", "1" + "0" * 5000], ["--seq", "invalid int", "..."]),       # past int(): cut, not 5,000 digits
    (["memory", "ok", "--batch", BIG], ["--batch", "16,777,216"]),                      # 10**400 sequences
    (["memory", "ok", "--lora-rank", str(10**30)], ["--lora-rank", "16,777,216"]),      # was 10^26 GiB, exit 0
    (["memory", "ok", "--gpus", "1000000000"], ["--gpus", "1,024"]),                    # a billion GPUs per node
    (["memory", "ok", "--nodes", BIG], ["--nodes", "1,024"]),                           # 10**400 nodes
    (["memory", "ok", "--completion", "0"], ["--completion", "at most --seq"]),         # no completion at all
    (["memory", "ok", "--beta", "inf"], ["--beta", "inf", "finite"]),                   # was accepted
    (["memory", "ok", "--beta", "nan"], ["--beta", "nan", "finite"]),                   # NaN
    (["memory", "ok", "--beta", "-0.5"], ["--beta", "finite number >= 0"]),             # negative KL weight
    (["memory", "ok", "--vllm-share", "nan", "--gpu", "H100-80GB"], ["--vllm-share"]),  # NaN share
    (["kv", "ok", "--context", BIG], ["--context"]),                                    # 10**400 tokens
    (["kv", "ok", "--tp", BIG], ["--tp"]),                                              # 10**400 GPUs
    (["memory", "vocab_big"], ["vocab_big", "config.json", "vocab_size", "16,777,216"]),      # was OverflowError
    (["memory", "hidden_big"], ["hidden_big", "config.json", "hidden_size"]),                  # was OverflowError
    (["memory", "heads_big"], ["heads_big", "config.json", "num_attention_heads"]),            # 10**400 heads
    (["memory", "layers_1e30"], ["layers_1e30", "num_hidden_layers", "1e+30"]),                # was 10^28 GiB, exit 0
    (["memory", "layers_float"], ["layers_float", "num_hidden_layers", "4.0"]),                # range() takes no float
    (["memory", "layers_bool"], ["layers_bool", "num_hidden_layers", "True"]),                 # true is not 1 layer
    (["memory", "layers_text"], ["layers_text", "num_hidden_layers", "'4'"]),                  # text
    (["kv", "vocab_big", "--gpu", "H100-80GB"], ["vocab_big", "config.json", "vocab_size"]),   # was printed, exit 0
    (["kv", "mlp_big"], ["mlp_big", "config.json", "intermediate_size"]),                      # weights estimate
    (["kv", "layers_1e30"], ["layers_1e30", "num_hidden_layers"]),                             # was 10^30 layers, exit 0
    (["kv", "hostile_weights"], ["model.safetensors", "safetensors header"]),                  # a 10**400-element tensor
    (["kv", "huge_header"], ["model.safetensors", "safetensors header"]),                      # a 2**63-byte header
    (["memory", "deep.json"], ["deep.json", "nests too deeply"]),                              # was RecursionError
    (["memory", "huge.json"], ["huge.json", "bytes"]),                                         # 17 MiB: not a config.json
    (["memory", "fifo"], ["fifo", "not a regular file"]),                                      # a FIFO would block the read
    (["kv", "deep.json"], ["deep.json", "nests too deeply"]),                                  # was RecursionError
]


@pytest.mark.parametrize("args,needles", NUMBERS)
def test_numbers_out_of_range_are_one_line(args, needles, here):
    before = state(here)
    assert_refused(cli(*args, cwd=here), *needles)
    assert_nothing_left(here, before)


# --- launcher and pipeline configs: `posttrain check` ------------------------------------------
CONFIGS = [
    ({"launcher": {"type": "torchrun", "processes": 1024}}, [],
     ["launcher.processes", "1024 processes per node", "this machine has"]),          # on a CPU-only 2-core machine
    ({"launcher": {"type": "torchrun", "processes": 1024}}, ["--elsewhere"], None),    # for a cluster: accepted
    ({"training": {"gpu": "H100-80GB", "num_gpus": 10**9}}, ["--elsewhere"],
     ["training.num_gpus", "1024"]),                                                  # a billion GPUs per node
    ({"launcher": {"type": "torchrun", "nodes": 10**9}}, ["--elsewhere"], ["launcher.nodes", "1024"]),  # a billion nodes
    ({"launcher": {"type": "torchrun", "nodes": 2, "rdzv_endpoint": "node0:29500", "rdzv_timeout_s": 10**14}},
     ["--elsewhere"], ["launcher.rdzv_timeout_s", "604800"]),                         # 3 million years: was OverflowError
    ({"launcher": {"type": "torchrun", "nodes": 2, "rdzv_endpoint": "127.0.0.1:99999"}}, ["--elsewhere"],
     ["launcher.rdzv_endpoint", "1 to 65535"]),                                       # no such port
    ({"launcher": {"type": "accelerate", "accelerate_config": "{tmp}/zero7.yaml"}}, ["--elsewhere"],
     ["launcher.accelerate_config", "zero_stage 7", "0, 1, 2 or 3"]),                 # was planned as ZeRO-0
    ({"launcher": {"type": "accelerate", "accelerate_config": "{tmp}/zero_text.yaml"}, "sft": {"peft": {"r": 8}}},
     ["--elsewhere"], ["launcher.accelerate_config", "'three'"]),                     # was ValueError (LoRA check)
    ({"launcher": {"type": "accelerate", "accelerate_config": "{tmp}/ds_list.yaml"}}, ["--elsewhere"],
     ["launcher.accelerate_config", "list.json", "not an object"]),                   # was AttributeError
    ({"launcher": {"type": "accelerate", "accelerate_config": "{tmp}/ds_fifo.yaml"}}, ["--elsewhere"],
     ["launcher.accelerate_config", "fifo", "not a file"]),                           # the read would block
    ({"launcher": {"type": "accelerate", "accelerate_config": "{tmp}/ds_name.yaml"}}, ["--elsewhere"],
     ["launcher.accelerate_config", "'123'", "not a file"]),                          # accelerate parsed '123' as JSON
    ({"launcher": {"type": "accelerate", "accelerate_config": "{tmp}/a_folder"}}, ["--elsewhere"],
     ["launcher.accelerate_config", "not a file"]),                                   # a folder
    ({"launcher": {"type": "accelerate", "accelerate_config": "{tmp}/binary.yaml"}}, ["--elsewhere"],
     ["launcher.accelerate_config", "accelerate cannot load", "utf-8"]),              # not YAML
    ({"model": {"path": "{tmp}/layers_1e30"}}, ["--elsewhere"],
     ["model.path", "layers_1e30/config.json", "num_hidden_layers"]),                 # was "not planned", exit 0
    ({"sft": {"trl": {"max_length": 10**400}}}, ["--elsewhere"], ["sft.trl.max_length", "16,777,216"]),  # OverflowError
    ({"grpo": {"dense": {"trl": {"per_device_train_batch_size": 10**15}}}}, ["--elsewhere"],
     ["grpo.dense.trl.per_device_train_batch_size"]),                                 # was 10^11 GiB, exit 0
]


def variant(tmp: Path, overrides: dict) -> Path:
    path = tmp / "variant.yaml"
    text = yaml.safe_dump({"extends": str(REPO / "configs" / "pipeline.yaml"), **overrides})
    path.write_text(text.replace("{tmp}", str(tmp)))
    return path


@pytest.mark.parametrize("overrides,flags,needles", CONFIGS)
def test_launcher_configs_are_checked_in_one_line(overrides, flags, needles, here):
    path = variant(here, overrides)
    before = state(here)
    done = cli("check", "--config", path, *flags, cwd=here)
    if needles is None:
        assert done.returncode == 0, done.stderr
    else:
        assert_refused(done, str(path), *needles)
    assert_nothing_left(here, before)


def test_memory_of_a_pipeline_names_the_trl_option(here):
    """`posttrain memory --config` plans the same stages: a count past the plan's range is
    its option, in one line (was an OverflowError while printing GiB)."""
    path = variant(here, {"sft": {"trl": {"max_length": 10**400}}})
    assert_refused(cli("memory", "--config", path, cwd=here), "sft.trl.max_length")


# --- a reader that leaves: no traceback, no "Exception ignored" -------------------------------
PIPES = [
    (["memory", "ok"], ["true"]),                     # the reader leaves before a byte is written
    (["memory", "ok", "--json"], ["true"]),           # one JSON line
    (["kv", "ok", "--kv-memory-gib", "4"], ["true"]),  # the capacity table
    (["kv", "ok", "--json"], ["head", "-c", "0"]),    # head that reads nothing
    (["memory", "ok"], ["head", "-n", "1"]),          # the usual: the first line, then gone (the rest may fit the pipe)
]


@pytest.mark.parametrize("args,reader", PIPES)
def test_a_reader_that_leaves_ends_quietly(args, reader, here):
    command = [str(Path(sys.executable).parent / "posttrain"), *args]
    writer = subprocess.Popen(command, cwd=here, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    taker = subprocess.Popen(reader, stdin=writer.stdout, stdout=subprocess.DEVNULL)
    writer.stdout.close()  # only the reader holds the pipe's read end
    _, err = writer.communicate(timeout=300)
    taker.wait(timeout=300)
    assert err.decode() == "", err.decode()[-2000:]  # no traceback, no "Exception ignored in ... BrokenPipeError"
    assert writer.returncode in (0, 141)  # 141: 128 + SIGPIPE, as `cat` ends
    if reader == ["true"]:
        assert writer.returncode == 141


# --- posttrain join: what it waits for, and its own limit ends the wait -----------------------
def joining(tmp: Path, endpoint: str, timeout_s: int = 10) -> Path:
    return variant(tmp, {"launcher": {"type": "torchrun", "nodes": 2, "rdzv_endpoint": endpoint,
                                      "rdzv_timeout_s": timeout_s}})


@pytest.mark.parametrize("host,problem", [
    ("127.0.0.1", "refused"),                   # node 0's launcher never started: nothing listens
    ("no-such-node.invalid", "no-such-node"),   # a name that never resolves (the resolver's words vary by machine)
])
def test_join_says_what_it_waits_for_and_gives_up_in_one_line(host, problem, here):
    from posttrain.probe import free_port

    port = free_port()
    path = joining(here, f"{host}:{port}")
    before = state(here)
    # the wait's end is launcher.rdzv_timeout_s (10 s); the timeout here only guards against a hang
    done = cli_process("join", "--config", path, "--stage", "sft", "--node-rank", "1", cwd=here, timeout=300)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert len(lines) == 2, lines
    assert all(s in lines[0] for s in ("join sft", "node 1 of 2", f"{host}:{port}", "until", "rdzv_timeout_s")), lines[0]
    assert all(s in lines[1] for s in ("posttrain join", "did not answer within 10 s", problem, "rdzv_endpoint")), \
        lines[1]
    assert_nothing_left(here, before)


@pytest.mark.parametrize("args,env,needles", [
    (["--node-rank", BIG], {}, ["--node-rank", "...", "1..1"]),                        # 10**400: cut, not quoted whole
    (["--node-rank", "0"], {}, ["--node-rank", "node 0 is the one that runs the stage"]),  # node 0 runs the stage
    (["--node-rank", "-3"], {}, ["--node-rank", "1..1"]),                              # negative
    (["--node-rank", "1"], {"POSTTRAIN_RDZV_ENDPOINT": "127.0.0.1:70000"},
     ["POSTTRAIN_RDZV_ENDPOINT", "70000", "1..65535"]),                               # the environment's port: no such port
])
def test_join_refuses_bad_ranks_and_endpoints(args, env, needles, here):
    path = variant(here, {"launcher": {"type": "torchrun", "nodes": 2}}) if env else joining(here, "127.0.0.1:29599")
    before = state(here)
    assert_refused(cli("join", "--config", path, "--stage", "sft", *args, cwd=here, env=env), *needles)
    assert_nothing_left(here, before)


def test_node_0_says_what_it_waits_for():
    """The stage's own line on node 0: which nodes it waits for, how they join, until when."""
    from posttrain.config import LauncherSection
    from posttrain.runtime.launch import awaited

    launcher = LauncherSection(type="torchrun", nodes=3, rdzv_endpoint="node0:29500", rdzv_timeout_s=60)
    line = awaited(launcher, "grpo@dense")
    assert "nodes 1..2" in line and "posttrain join --stage grpo@dense" in line and "until" in line
    assert awaited(LauncherSection(type="torchrun", processes=2), "sft") == ""
