"""The promotion rule (pure): champion only when the serving target holds and the metric beats the champion."""

import pytest

from posttrain.registry import decide


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
