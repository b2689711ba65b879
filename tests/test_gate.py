"""The stage gate's sentinels (pure): each fires on its planted failure with a message
that says what happened, and all stay quiet on a healthy stage."""

import pytest

from posttrain.scoring.gate import decide, reward_trend


def result(greedy, pass8):
    return {"greedy_accuracy": greedy, "pass_at_k": {"8": pass8}}


@pytest.mark.parametrize("before,after,accepted,needle", [
    (result(0.5, 0.9), result(0.7, 0.92), True, "no drop"),            # better on both
    (result(0.5, 0.9), result(0.49, 0.89), True, "no drop"),           # within tolerance
    (result(0.5, 0.9), result(0.40, 0.95), False, "regression: greedy accuracy fell 0.500 -> 0.400"),
    (result(0.5, 0.9), result(0.0, 0.0), False, "greedy accuracy fell 0.500 -> 0.000"),  # wrecked model
])
def test_regression(before, after, accepted, needle):
    decision = decide(before, after, k=8, tolerance=0.02)
    assert decision.accepted is accepted and needle in decision.reason


def test_breadth_collapse_fires_even_when_greedy_rises():
    decision = decide(result(0.5, 0.82), result(0.60, 0.74), k=8, tolerance=0.02)
    assert not decision.accepted
    assert decision.reason == ("breadth collapse: pass@8 fell 0.820 -> 0.740 while greedy accuracy rose "
                               "(more than the tolerance 0.020)")


def test_reward_hacking_reward_up_accuracy_down():
    decision = decide(result(0.5, 0.9), result(0.3, 0.9), k=8, tolerance=0.02, reward=(0.4, 0.95))
    assert not decision.accepted
    assert "reward hacking: training reward rose 0.400 -> 0.950 while held-out accuracy fell 0.500 -> 0.300" \
        in decision.reason


def test_reward_hacking_below_the_base_model():
    # the stage kept its predecessor's (already poor) accuracy, but sits below the untrained base
    decision = decide(result(0.20, 0.5), result(0.20, 0.5), k=8, tolerance=0.02, reward=(0.1, 0.9),
                      base=result(0.35, 0.6))
    assert not decision.accepted
    assert "below the base model's 0.350" in decision.reason


@pytest.mark.parametrize("reward", [None, (0.4, 0.9), (0.9, 0.4)])
def test_quiet_on_a_healthy_stage(reward):
    decision = decide(result(0.5, 0.82), result(0.66, 0.83), k=8, tolerance=0.02, reward=reward,
                      base=result(0.0, 0.1))
    assert decision.accepted and "no drop" in decision.reason


def test_falling_reward_with_falling_accuracy_is_a_regression_not_hacking():
    decision = decide(result(0.5, 0.9), result(0.3, 0.9), k=8, tolerance=0.02, reward=(0.9, 0.4))
    assert not decision.accepted and "regression" in decision.reason and "hacking" not in decision.reason


def test_reward_trend_averages_the_ends():
    assert reward_trend([0.0] * 10 + [1.0] * 10) == (0.0, 1.0)
    assert reward_trend([0.2, 0.8]) == (0.2, 0.8)
    assert reward_trend([0.5]) is None


def measured(greedy: list[int], correct: list[int], n: int = 16) -> dict:
    """An evaluation with the per-prompt outcomes the gate's paired tests read."""
    from posttrain.scoring.metrics import mean_pass_at_k

    return {"greedy_accuracy": sum(greedy) / len(greedy), "pass_at_k": {"8": mean_pass_at_k(correct, n, 8)},
            "outcomes": {"prompts": [f"{i}+1=" for i in range(len(greedy))], "greedy": greedy, "correct": correct,
                         "n": n}}


def test_a_drop_beyond_the_tolerance_that_noise_explains_is_not_a_regression():
    # 100 prompts, 3 lost and 0 gained: 3 points down, above the 0.02 tolerance, but McNemar p = 0.25
    before = measured([1] * 60 + [0] * 40, [12] * 100)
    after = measured([1] * 57 + [0] * 43, [12] * 100)
    decision = decide(before, after, k=8, tolerance=0.02, alpha=0.05)
    assert decision.accepted and "no drop beyond 0.020 and noise" in decision.reason
    assert decision.p_values["greedy_accuracy"] == pytest.approx(0.25)
    assert "exact McNemar p=0.250, 100 prompts" in decision.reason


def test_a_significant_drop_within_the_tolerance_is_not_a_regression():
    # 1,000 prompts, 15 lost: p < 0.001, but 1.5 points is inside the practical margin
    before = measured([1] * 600 + [0] * 400, [12] * 1000)
    after = measured([1] * 585 + [0] * 415, [12] * 1000)
    decision = decide(before, after, k=8, tolerance=0.02)
    assert decision.accepted and decision.p_values["greedy_accuracy"] < 0.001


def test_a_large_significant_drop_is_a_regression_with_its_p_value():
    before = measured([1] * 300 + [0] * 200, [4] * 500)
    after = measured([1] * 250 + [0] * 250, [1] * 500)             # 10 points down on 500 prompts, pass@8 too
    decision = decide(before, after, k=8, tolerance=0.02, resamples=1000)
    assert not decision.accepted
    assert "regression: greedy accuracy fell 0.600 -> 0.500 (more than the tolerance 0.020; exact McNemar " \
           "p<0.001, 500 prompts)" in decision.reason
    assert "breadth collapse" in decision.reason and "paired bootstrap p<0.001" in decision.reason
    assert set(decision.p_values) == {"greedy_accuracy", "pass_at_8"}


def test_identical_models_pass_with_p_one():
    same = measured([1, 0] * 50, [8] * 100)
    decision = decide(same, same, k=8, tolerance=0.0)
    assert decision.accepted and decision.p_values == {"greedy_accuracy": 1.0, "pass_at_8": 1.0}
