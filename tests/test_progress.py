"""What the terminal shows while a stage runs (issue 17): the stage's progress lines
(posttrain/progress.py), the flow's display of them (tasks/display.py: plain lines at most
every 10% off a terminal), the routing of a stage's output between terminal and log, and
each stage's end line in numbers (posttrain.tracking.summary.stage_line)."""

from __future__ import annotations

import io
import sys

import pytest

from posttrain import progress
from posttrain.tracking.summary import duration, stage_line
from tasks.display import StageDisplay
from tasks.dvc_stages import run_logged


def test_progress_lines_come_at_most_every_percent_and_at_the_end(capsys, monkeypatch):
    monkeypatch.setattr(progress, "MIN_SECONDS", 0.0)
    progress.update(5, 10)  # outside a phase: nothing
    with progress.phase("train"):
        for step in range(1, 1001):
            progress.update(step, 1000, loss=0.5, reward=None)
        for step in (300, 600, 1000):  # a second loop in the phase (the next model): shown again
            progress.update(step, 1000)
    events = [progress.parse(line + "\n") for line in capsys.readouterr().out.splitlines()]
    assert [e["done"] for e in events[-3:]] == [300, 600, 1000]
    events = events[:-3]
    assert events[0] == {"phase": "train", "done": 0, "total": None}
    assert len(events) == 1 + 100 and events[-1] == {"phase": "train", "done": 1000, "total": 1000, "loss": 0.5}
    assert progress.parse("{'loss': 0.1}\n") is None and progress.parse(progress.PREFIX + "not json") is None


def test_a_new_loop_in_a_phase_is_shown_at_its_first_update(capsys):
    """The next sampler of a gate: its first batch is shown at once, not when the 2 s throttle
    lets the next line through (the display then started its clock at 86% done, "0.0 s left")."""
    with progress.phase("gate"):
        for done in range(10, 101, 10):
            progress.update(done, 100)
        progress.update(10, 100)  # the next model's first batch, within 2 s of the last line
    events = [progress.parse(line + "\n") for line in capsys.readouterr().out.splitlines()]
    assert [e["done"] for e in events] == [0, 100, 10]  # the phase, the first loop's end, the next one at once


def plain_display(stage: str) -> tuple[StageDisplay, io.StringIO]:
    out = io.StringIO()
    return StageDisplay(stage, stream=out), out


def test_off_a_terminal_the_display_prints_a_line_per_tenth_of_a_phase():
    display, out = plain_display("grpo@dense")
    with display:
        display.update({"phase": "filter", "done": 0, "total": None})
        for done in range(0, 601, 4):
            display.update({"phase": "train", "done": done, "total": 600, "loss": 0.01, "reward": 0.5})
        for loop in range(2):  # a gate: two evaluations in one phase
            for done in (64, 128, 200):
                display.update({"phase": "gate", "done": done, "total": 200})
    lines = out.getvalue().splitlines()
    train = [line for line in lines if line.startswith("grpo@dense: train ")]
    assert lines[0] == "grpo@dense: filter" and "grpo@dense: train" in lines and "grpo@dense: gate" in lines
    assert len(train) == 10 and train[0].startswith("grpo@dense: train 60/600 (10%), loss 0.01, reward 0.5; ")
    assert "left" in train[0] and train[-1].startswith("grpo@dense: train 600/600 (100%)") and "left" not in train[-1]
    assert len([line for line in lines if line.startswith("grpo@dense: gate 200/200 (100%)")]) == 2


def test_the_terminal_gets_progress_and_posttrain_lines_the_log_gets_the_rest(tmp_path):
    script = (f"print({progress.PREFIX!r} + '{{\"phase\": \"train\", \"done\": 3, \"total\": 3}}')\n"
              "print(\"{'loss': 0.25, 'grad_norm': 1.0}\")\nprint('posttrain: resuming from checkpoint-2')\n"
              "print('Running stage x')\n")
    display, out = plain_display("sft")
    with display:
        code, tail = run_logged([sys.executable, "-c", script], cwd=str(tmp_path), env={}, log_path=tmp_path / "x.log",
                                display=display)
    assert code == 0 and out.getvalue().splitlines() == ["sft: train", "sft: train 3/3 (100%); 0.0 s",
                                                         "posttrain: resuming from checkpoint-2"]
    log = (tmp_path / "x.log").read_text()
    assert "{'loss': 0.25" in log and "Running stage x" in log and progress.PREFIX not in log
    assert tail.splitlines()[-1] == "Running stage x"


GRPO = {"candidate_greedy_accuracy": 0.712, "candidate_pass_at_8": 0.7523, "accepted": 1.0, "steps": 600.0}


@pytest.mark.parametrize("name, metrics, kwargs, line", [
    ("grpo@dense", GRPO, {"seconds": 379.4, "before": 0.424},
     "grpo@dense: accepted, greedy 0.424 -> 0.712, pass@8 0.752, 600 steps, 6 min 19 s"),
    ("grpo@dense", {**GRPO, "accepted": 0.0}, {"seconds": 61},
     "grpo@dense: rejected (the previous model carries on), greedy 0.712, pass@8 0.752, 600 steps, 1 min 1 s"),
    ("sft", {"greedy_accuracy": 0.424, "pass_at_4": 0.5, "steps": 200.0}, {"seconds": 15.5},
     "sft: greedy 0.424 on held-out, pass@4 0.500, 200 steps, 16 s"),
    ("prepare", {"train_rows": 2000.0, "heldout_rows": 500.0, "datasets_rows": 0.0, "base_params": 996992.0},
     {"seconds": 0.6}, "prepare: 2,000 train / 500 held-out rows, base model of 996,992 parameters, 0.6 s"),
    ("serving", {"max_concurrency": 9070.35, "context_length": 8192.0, "vllm_num_blocks": 512.0, "load_requests": 256.0,
                 "load_requests_per_second": 311.1, "load_latency_p95_ms": 130.3}, {"seconds": 24.6},
     "serving: 9,070 concurrent sessions of 8,192 tokens (KV arithmetic; vLLM's own report agreed), load test 311 "
     "req/s, p95 130 ms, 25 s"),
    ("evaluate", {"base": {"greedy_accuracy": 0.0}, "grpo": {"greedy_accuracy": 0.712}}, {"seconds": 3700},
     "evaluate: greedy accuracy base 0.000, grpo 0.712, 1 h 1 min"),
    ("evaluate", {}, {"seconds": 1.23, "cached": True}, "evaluate: up to date (DVC kept its outputs), 1.2 s"),
])
def test_each_stage_ends_with_a_line_of_what_it_did(name, metrics, kwargs, line):
    assert stage_line(name, metrics, **{"cached": False, **kwargs}) == line
    assert duration(9.96) == "10.0 s" and duration(10) == "10 s"
