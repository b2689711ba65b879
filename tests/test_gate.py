"""The stage gate's decision (pure)."""

import pytest

from posttrain.gate import decide


def result(greedy, pass8):
    return {"greedy_accuracy": greedy, "pass_at_k": {"8": pass8}}


@pytest.mark.parametrize("before,after,accepted,needle", [
    (result(0.5, 0.9), result(0.7, 0.92), True, "no drop"),            # better on both
    (result(0.5, 0.9), result(0.49, 0.89), True, "no drop"),           # within tolerance
    (result(0.5, 0.9), result(0.40, 0.95), False, "greedy accuracy"),  # greedy fell
    (result(0.5, 0.9), result(0.70, 0.80), False, "pass@8"),           # breadth fell while greedy rose
    (result(0.5, 0.9), result(0.0, 0.0), False, "greedy accuracy fell 0.500 -> 0.000"),  # wrecked model
])
def test_decide(before, after, accepted, needle):
    decision = decide(before, after, k=8, tolerance=0.02)
    assert decision.accepted is accepted and needle in decision.reason
