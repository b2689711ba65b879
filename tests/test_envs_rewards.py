"""The arithmetic environment and the reward channels built on it."""

import pytest

from posttrain.envs import get_env
from posttrain.rewards import REWARDS, build_rewards


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
    correctness, parseable = build_rewards(env, ["correctness", "parseable"])
    completions, answers = ["5", "6", "x"], ["5", "5", "5"]
    assert correctness(completions, answer=answers) == [1.0, 0.0, 0.0]
    assert parseable(completions, answer=answers) == [1.0, 1.0, 0.0]
    assert set(REWARDS) >= {"correctness", "parseable"}
