"""The arithmetic environment and the reward channels built on it."""

import pytest

from posttrain.envs import get_env
from posttrain.scoring.rewards import REWARDS, build_rewards, digit_overlap


@pytest.fixture
def env():
    return get_env("arithmetic", operand_max=9, heldout_size=20)


def test_splits_are_disjoint_and_complete(env):
    splits = env.generate(seed=0)
    train = {r["prompt"] for r in splits["train"]}
    heldout = {r["prompt"] for r in splits["heldout"]}
    assert len(heldout) == 20 and not train & heldout and len(train | heldout) == 100


def test_generation_is_seeded(env):
    assert env.generate(1) == env.generate(1) != env.generate(2)


@pytest.mark.parametrize("completion,answer,ok", [
    ("12", "12", True),      # exact
    (" 12 ", "12", True),    # surrounding space is tolerated
    ("012", "12", True),     # same integer
    ("13", "12", False),     # wrong number
    ("12+", "12", False),    # trailing junk is not an answer
    ("", "12", False),       # empty
    ("-3", "-3", True),      # negatives
])
def test_verify(env, completion, answer, ok):
    assert env.verify(completion, answer) is ok


def test_sft_targets_satisfy_the_verifier(env):
    # the format contract: every SFT target must score as correct under the parser
    rows = env.generate(0)["train"]
    assert all(env.verify(r["completion"], r["answer"]) for r in rows)


def test_reward_channels(env):
    (correctness, parseable, digits), weights = build_rewards(env, {"correctness": 1, "parseable": 0.5, "digits": 2})
    completions, answers = ["15", "16", "x", "115"], ["15", "15", "15", "15"]
    assert correctness(completions, answer=answers) == [1.0, 0.0, 0.0, 0.0]
    assert parseable(completions, answer=answers) == [1.0, 1.0, 0.0, 1.0]
    assert digits(completions, answer=answers) == pytest.approx([1.0, 0.5, 0.0, 2 / 3])
    assert weights == [1.0, 0.5, 2.0] and digits.__name__ == "digits"   # TRL logs rewards/digits/mean
    assert set(REWARDS) >= {"correctness", "parseable", "digits"}


@pytest.mark.parametrize("predicted,answer,score", [
    ("85", "85", 1.0),      # all digits
    ("84", "85", 0.5),      # tens right
    ("185", "85", 2 / 3),   # an extra digit costs its share
    ("5", "85", 0.5),       # units right, one digit missing
    (None, "85", 0.0),      # nothing parsed
])
def test_digit_overlap(predicted, answer, score):
    assert digit_overlap(predicted, answer) == pytest.approx(score)


def test_guardrail_pins_every_channel_to_its_minimum(env):
    logged = {}
    funcs, _ = build_rewards(env, {"correctness": 1.0, "digits": 1.0}, guardrails=["overlong"])
    completions = ["15", "15        ", "14"]   # the second is right but breaks the 8-character rule
    columns = {"answer": ["15"] * 3, "log_metric": logged.__setitem__}
    assert funcs[0](completions, **columns) == [1.0, 0.0, 0.0]
    assert funcs[1](completions, **columns) == [1.0, 0.0, 0.5]
    assert logged == {"guardrails/overlong/hit_rate": pytest.approx(1 / 3)}
