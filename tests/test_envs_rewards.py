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


@pytest.mark.parametrize("completion,exact,lenient,bare", [
    ("109", "109", "109", True),                    # the bare number: every reading agrees
    (" 109 ", "109", "109", True),                  # spaces around it
    ("27 + 82 = 109.", None, "109", False),         # an instruct model's sentence: only the lenient reading
    ("The result of 59 + 63 is 122.", None, "122", False),  # the number last, after others
    ("I think -5", None, "-5", False),              # a negative number
    ("no idea", None, None, False),                 # no number at all
])
def test_arithmetic_reads_replies_exactly_or_leniently(completion, exact, lenient, bare):
    from posttrain.envs.arithmetic import ArithmeticEnv

    strict, loose = ArithmeticEnv(), ArithmeticEnv(answer="last_number", prompt_format="What is {a} {op} {b}?")
    assert strict.parse(completion) == exact and loose.parse(completion) == lenient
    assert strict.format_ok(completion) is bare and loose.format_ok(completion) is bare


def test_a_worded_prompt_round_trips_through_check_row():
    from posttrain.envs.arithmetic import ArithmeticEnv

    env = ArithmeticEnv(prompt_format="What is {a} {op} {b}?", answer="last_number", operand_max=99)
    row = env.generate(0)["train"][0]
    assert row["prompt"].startswith("What is ") and env.check_row(row) is None
    assert "not of the form `What is <a> <op> <b>?`" in env.check_row({**row, "prompt": "3+4="})
    assert "is wrong" in env.check_row({**row, "prompt": "What is 3 + 4?", "answer": "8"})


@pytest.mark.parametrize("fmt", ["What is {a}?", "{a}{op}{b}{c}", "{a {op} {b}"])  # a field missing, extra, broken
def test_a_prompt_format_must_name_the_operands(fmt):
    from pydantic import ValidationError

    from posttrain.envs.arithmetic import ArithmeticOptions

    with pytest.raises(ValidationError, match="must name each of"):
        ArithmeticOptions(prompt_format=fmt)
