"""The promotion rule (pure): champion only when the serving target holds and the metric beats the champion."""

import pytest

from posttrain.tracking.promotion import decide


@pytest.mark.parametrize("value,champion,higher,serving_ok,alias,needle", [
    (0.7, None, True, True, "champion", "no champion yet"),
    (0.8, ("3", 0.7), True, True, "champion", "0.8000 beats the champion's 0.7000 (version 3)"),
    (0.7, ("3", 0.7), True, True, "challenger", "does not beat"),            # a tie does not promote
    (0.6, ("3", 0.7), True, True, "challenger", "does not beat"),
    (0.6, ("3", 0.7), False, True, "champion", "beats"),                     # lower is better
    (0.9, ("3", 0.7), True, False, "challenger", "serving target is not met"),
    (0.9, None, True, False, "challenger", "serving target"),
])
def test_decide(value, champion, higher, serving_ok, alias, needle):
    got, reason = decide("evaluate.grpo.greedy_accuracy", value, champion, higher_is_better=higher,
                         serving_ok=serving_ok)
    assert got == alias and needle in reason and reason.startswith(alias)


def test_significance_decides_when_asked():
    from posttrain.scoring.stats import Test

    noise = Test(0.01, 0.40, "exact McNemar", 500)
    real = Test(0.08, 0.0004, "exact McNemar", 500)
    args = dict(higher_is_better=True, serving_ok=True, alpha=0.05)
    alias, reason = decide("evaluate.grpo.greedy_accuracy", 0.71, ("3", 0.70), test=noise, **args)
    assert alias == "challenger" and "within noise: exact McNemar p=0.400, 500 prompts" in reason
    alias, reason = decide("evaluate.grpo.greedy_accuracy", 0.78, ("3", 0.70), test=real, **args)
    assert alias == "champion" and "beyond noise: exact McNemar p<0.001, 500 prompts, alpha 0.05" in reason
    alias, reason = decide("serving.max_concurrency", 9.0, ("3", 8.0), untested="no per-prompt outcomes", **args)
    assert alias == "champion" and "(no significance test: no per-prompt outcomes)" in reason
