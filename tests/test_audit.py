"""The reward audit (posttrain.scoring.audit): every built-in environment passes its own
audit, and hackable rewards planted by import path or by option are refused."""

from __future__ import annotations

import json

import pytest

from posttrain.envs import get_env
from posttrain.scoring.audit import audit_stage

BUILT_IN = [("arithmetic", {}, {"correctness": 1.0, "digits": 0.5}, ["unparseable"]),
            ("arithmetic", {"answer": "last_number"}, {"correctness": 1.0}, []),
            ("sql", {}, {"correctness": 1.0}, []),
            ("calculator", {}, {"correctness": 1.0, "tool_errors": 0.2}, []),
            ("sql_tools", {}, {"correctness": 1.0}, []),
            ("retrieval", {"towns": 40, "heldout_size": 10}, {"correctness": 1.0}, [])]

ROWS = {"numeric": [("How many legs have 3 spiders?", "24"), ("What is 7 * 6?", "42"), ("What is 1.5 + 2?", "3.5")],
        "exact": [("Capital of France?", "Paris"), ("Opposite of hot?", "cold")],
        "math": [("Solve x + 1 = 3.", "2"), ("What is 1/2 + 1/4?", "\\frac{3}{4}")],
        "choice": [("Which is a fruit? A) stone B) apple C) iron D) salt", "B"),
                   ("Which is red? A) blood B) sky C) grass D) snow", "A")]}


def dataset(tmp_path, verifier: str, **options):
    (tmp_path / "custom").mkdir(exist_ok=True)
    for split in ("train", "heldout"):
        rows = ROWS[verifier] if split == "train" else [(f"held {q}", a) for q, a in ROWS[verifier][:1]]
        (tmp_path / "custom" / f"{verifier}-{split}.jsonl").write_text(
            "".join(json.dumps({"prompt": q, "answer": a}) + "\n" for q, a in rows))
    return get_env("dataset", train=f"custom/{verifier}-train.jsonl", heldout=f"custom/{verifier}-heldout.jsonl",
                   verifier=verifier, **options)


@pytest.mark.parametrize("name, options, rewards, guardrails", BUILT_IN)
def test_every_built_in_environment_passes_its_own_audit(name, options, rewards, guardrails):
    env = get_env(name, **options)
    report = audit_stage("s", env, rewards, guardrails, env.generate(0)["train"])
    assert report.rows == 32 and report.exploits > 300
    assert report.breaches == [], [b.line("s") for b in report.breaches]


@pytest.mark.parametrize("verifier", ["numeric", "exact", "math", "choice"])
def test_the_dataset_verifiers_pass_their_own_audit(tmp_path, monkeypatch, verifier):
    monkeypatch.chdir(tmp_path)
    env = dataset(tmp_path, verifier)
    report = audit_stage("s", env, {"correctness": 1.0}, ["unparseable"], env.generate(0)["train"])
    assert report.breaches == [], [b.line("s") for b in report.breaches]


PLANTED = [  # (environment, its options or a dataset verifier, the stage's rewards, guardrails, a family that breaks it)
    ("arithmetic", {}, {"planted_rewards:anywhere": 1.0}, [], "several answers"),
    ("arithmetic", {}, {"parseable": 1.0}, [], "wrong answer"),
    ("arithmetic", {}, {"planted_rewards:has_number": 1.0}, [], "wrong answer"),
    ("arithmetic", {}, {"planted_rewards:starts_with_answer": 1.0}, [], "right then wrong"),
    ("arithmetic", {}, {"planted_rewards:longer_is_better": 1.0}, [], "very long"),
    ("arithmetic", {}, {"planted_rewards:constant": 1.0}, [], "empty"),
    ("arithmetic", {}, {"length": 1.0}, [], "empty"),
    ("arithmetic", {}, {"planted_rewards:last_line": 1.0}, [], "several answers"),
    ("sql", {}, {"planted_rewards:sql_overlap": 1.0}, [], "tautology"),
    ("sql", {}, {"similarity": 1.0}, ["unparseable"], "flipped comparison"),  # below gold, paid as if right
    (("dataset", "numeric"), {"tolerance": 1e9}, {"correctness": 1.0}, [], "wrong answer"),
    (("dataset", "choice"), {}, {"planted_rewards:first_letter": 1.0}, [], "every candidate"),
    (("dataset", "exact"), {"answer_pattern": "(\\w+)"}, {"correctness": 1.0}, [], "right then wrong"),
    ("calculator", {}, {"tool_use": 1.0}, [], "tools forever"),          # pays for calling, played as episodes
    ("sql_tools", {}, {"tool_use": 1.0}, [], "no final answer"),
]


@pytest.mark.parametrize("name, options, rewards, guardrails, family", PLANTED,
                         ids=[f"{p[2]}-{p[4]}".replace(" ", "_") for p in PLANTED])
def test_a_planted_hackable_reward_is_refused(tmp_path, monkeypatch, name, options, rewards, guardrails, family):
    monkeypatch.chdir(tmp_path)
    env = dataset(tmp_path, name[1], **options) if isinstance(name, tuple) else get_env(name, **options)
    report = audit_stage("s", env, rewards, guardrails, env.generate(0)["train"])
    families = {b.family for b in report.breaches}
    assert family in families, (family, sorted(families))
    line = report.breaches[0].line("s")
    assert line.startswith("grpo.s.rewards: the `") and "e.g." in line and "\n" not in line


def test_the_audit_command_passes_the_default_and_refuses_a_format_reward_in_one_line(tmp_path):
    import yaml

    from conftest import REPO, sh

    done = sh("posttrain", "audit", "--config", REPO / "configs" / "pipeline.yaml", "--out", tmp_path / "r" / "a.json",
              cwd=tmp_path)
    assert done.stdout.startswith("grpo.dense: audit passed (") and done.returncode == 0
    report = json.loads((tmp_path / "r" / "a.json").read_text())
    assert all(stage["passed"] and stage["exploits"] > 300 for stage in report.values())
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"extends": str(REPO / "configs" / "pipeline.yaml"),
                                   "grpo": {"dense": {"rewards": {"correctness": 0.0, "digits": 0.0, "parseable": 1.0}}}}))
    done = sh("posttrain", "audit", "--config", bad, cwd=tmp_path, check=False)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    assert "grpo.dense.rewards: the `wrong answer` exploit scores 1.000" in done.stderr and "fix:" in done.stderr
    assert "refused: 2 exploit families breach it" in done.stdout   # a wrong answer, and one hedged (521 for 52)


def hackable(tmp_path, audit=None, **stage):
    """configs/hack.yaml: the shipped config, its GRPO stage paid for a parseable answer only."""
    import yaml

    from conftest import REPO

    dense = {"rewards": {"correctness": 0.0, "digits": 0.0, "parseable": 1.0}, **stage}
    if audit is not None:
        dense["audit"] = audit
    path = tmp_path / "configs" / "hack.yaml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(yaml.safe_dump({"extends": str(REPO / "configs" / "pipeline.yaml"), "grpo": {"dense": dense}}))
    return path


def test_check_and_run_refuse_a_hackable_reward_before_any_compute(tmp_path):
    from hardening import assert_nothing_left, assert_refused, cli, state

    path = hackable(tmp_path)
    before = state(tmp_path)
    for command in ("check", "run"):
        assert_refused(cli(command, "--config", path, cwd=tmp_path), str(path),
                       "grpo.dense.rewards: the `wrong answer` exploit scores 1.000", "audit: warn")
    assert_nothing_left(tmp_path, before)
    assert not (tmp_path / "runs").exists()


def test_audit_warn_checks_with_a_warning_and_off_says_nothing(tmp_path):
    from hardening import cli

    done = cli("check", "--config", hackable(tmp_path, "warn"), cwd=tmp_path)
    assert done.returncode == 0 and "WARNING: grpo.dense.rewards: the `wrong answer` exploit" in done.stderr
    done = cli("check", "--config", hackable(tmp_path, {"action": "off"}), cwd=tmp_path)
    assert done.returncode == 0 and "WARNING" not in done.stderr + done.stdout


def test_an_unknown_audit_action_is_refused_naming_the_field(tmp_path):
    from hardening import assert_refused, cli

    assert_refused(cli("check", "--config", hackable(tmp_path, "maybe"), cwd=tmp_path), "grpo.dense.audit",
                   "refuse", "warn", "off")


GENERATORS = '''
from posttrain.envs.base import Exploit


def gold_is_wrong(row, env):
    return [Exploit("mine", row["answer"])]   # claims the right answer is an exploit: always breaches


def nothing(row, env):
    return ["not a number at all"]


def broken(row, env):
    return 1 / 0
'''


@pytest.mark.parametrize("generator, outcome", [
    ("custom.gens:gold_is_wrong", "the `mine` exploit scores"),     # run, and it can refuse the stage
    ("custom.gens:nothing", None),                                  # run; a string is a wrong completion
    ("custom.gens:broken", "raised ZeroDivisionError: division by zero at custom/gens.py:14 in broken"),
    ("custom.gens:missing", "grpo.dense.audit.exploits: module 'custom.gens' has no attribute 'missing'"),
    ("custom.gens:Exploit", "grpo.dense.audit.exploits"),          # a class: not a generator function
])
def test_users_add_exploit_generators_by_import_path(tmp_path, monkeypatch, generator, outcome):
    import sys

    from hardening import assert_refused, cli

    (tmp_path / "custom").mkdir()
    (tmp_path / "custom" / "gens.py").write_text(GENERATORS)
    monkeypatch.chdir(tmp_path)
    for name in [m for m in sys.modules if m == "custom" or m.startswith("custom.")]:
        monkeypatch.delitem(sys.modules, name)
    path = hackable(tmp_path, {"exploits": [generator]}, rewards={"correctness": 1.0, "digits": 0.5, "parseable": 0.0})
    done = cli("check", "--config", path, cwd=tmp_path)
    if outcome is None:
        assert done.returncode == 0, done.stderr
    else:
        assert_refused(done, str(path), outcome)


def test_a_reward_that_raises_is_refused_by_check_before_any_compute(tmp_path, monkeypatch):
    """The audit calls the stage's reward: one that raises is found by `check`, not an hour
    into `run` (with `audit: off` it fails the stage instead: tests/test_scheduled.py)."""
    import sys

    from hardening import assert_refused, cli

    (tmp_path / "custom").mkdir()
    (tmp_path / "custom" / "boom.py").write_text("def reward(completions, **_):\n    raise RuntimeError('boom')\n")
    monkeypatch.chdir(tmp_path)
    for name in [m for m in sys.modules if m == "custom" or m.startswith("custom.")]:
        monkeypatch.delitem(sys.modules, name)
    path = hackable(tmp_path, rewards={"correctness": 1.0, "digits": 0.0, "parseable": 0.0, "custom.boom:reward": 1.0})
    assert_refused(cli("check", "--config", path, cwd=tmp_path), str(path), "the reward audit",
                   "RuntimeError: boom at custom/boom.py:2 in reward")


SHIPPED = ["configs/pipeline.yaml", "configs/sql.yaml", "configs/recipes/qwen2.5-0.5b-math.yaml",
           "configs/recipes/smollm2-arithmetic.yaml", "configs/recipes/smollm2-calculator.yaml",
           "configs/recipes/smollm2-sql.yaml"]


def shipped_env(tmp_path, monkeypatch, path: str):
    """The shipped config and its environment's rows; the MATH recipe's files (not shipped:
    the user downloads them) stood in for by worked solutions of its columns."""
    from conftest import REPO
    from posttrain.config import load_config
    from posttrain.envs import config_env

    config = load_config(REPO / path)
    if config.data.env == "dataset":
        monkeypatch.chdir(tmp_path)
        (tmp_path / "custom").mkdir(exist_ok=True)
        for name, numbers in (("math_train", range(40)), ("math_test", range(40, 50))):
            rows = [{"problem": f"What is {n} + {n + 3}?", "solution": f"The sum is \\boxed{{{2 * n + 3}}}."}
                    for n in numbers]
            (tmp_path / "custom" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = config_env(config.data)
    return config, env, env.generate(config.seed)["train"]


@pytest.mark.parametrize("path", SHIPPED)
def test_hedges_refuse_an_answer_anywhere_reward_on_every_shipped_config_and_no_own_reward(tmp_path, monkeypatch,
                                                                                           path):
    """A reward that pays the answer found anywhere is refused by the `hedged` family alone
    (the gold answer beside a wrong one, in a few characters), whatever the config's cap and
    guardrails; each shipped stage's own reward raises no alarm."""
    config, env, rows = shipped_env(tmp_path, monkeypatch, path)
    for name, stage in config.grpo.items():
        own = audit_stage(name, env, stage.rewards, stage.guardrails, rows)
        assert own.breaches == [], [b.line(name) for b in own.breaches]
        anywhere = audit_stage(name, env, {"planted_rewards:answer_anywhere": 1.0}, stage.guardrails, rows)
        hedged = [b for b in anywhere.breaches if b.family == "hedged"]
        assert hedged, sorted({b.family for b in anywhere.breaches})
        assert len(hedged[0].example) <= 20 or config.data.env.startswith("sql"), hedged[0].example


def test_hedges_alone_catch_what_a_short_cap_leaves(monkeypatch):
    """Four-digit sums under a 6-character cap: every longer answer-holding exploit is
    pinned to the minimum, and only the hedge breaches (`12341` for 1234)."""
    env = get_env("arithmetic", operand_max=999, heldout_size=100)
    rows = [r for r in env.generate(0)["train"] if len(r["answer"]) == 4]
    report = audit_stage("s", env, {"planted_rewards:answer_anywhere": 1.0}, ["planted_rewards:over_six"], rows)
    assert {b.family for b in report.breaches} == {"hedged"}, [b.line("s") for b in report.breaches]
    monkeypatch.setattr("posttrain.scoring.audit.hedges", lambda *a: [])
    report = audit_stage("s", env, {"planted_rewards:answer_anywhere": 1.0}, ["planted_rewards:over_six"], rows)
    assert report.breaches == []                # what the audit passed before the family
