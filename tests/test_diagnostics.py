"""Why a GRPO stage learned or did not (posttrain.training.diagnostics): weight change by
layer, KL to the start, and the clause a flat stage's end-of-stage line carries."""

from __future__ import annotations

import shutil

import pytest

from posttrain.tracking.summary import stage_line
from posttrain.training.diagnostics import change_figures, explain, kl_to_start, weight_change_by_layer


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny model and a copy of it with decoder layer 1's MLP moved by 10% of its norm."""
    import torch
    from safetensors.torch import load_file, save_file

    from posttrain.training.tiny_model import save_tiny_model

    root = tmp_path_factory.mktemp("diag")
    save_tiny_model(root / "start", hidden_size=32, num_layers=3, num_heads=2, num_kv_heads=1,
                    intermediate_size=64, max_positions=32, seed=0)
    shutil.copytree(root / "start", root / "moved")
    weights = load_file(root / "moved" / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight"
    torch.manual_seed(0)
    noise = torch.randn_like(weights[name])
    weights[name] = weights[name] + 0.1 * noise * weights[name].norm() / noise.norm()
    save_file(weights, root / "moved" / "model.safetensors", metadata={"format": "pt"})
    return root / "start", root / "moved"


def test_the_change_is_found_in_the_layer_that_moved(models):
    layers = weight_change_by_layer(*models)
    by = {l["layer"]: l["relative_change"] for l in layers}
    assert [l["layer"] for l in layers][:3] == ["0", "1", "2"]
    assert by["0"] == by["2"] == by["embed"] == 0.0
    assert 0.0 < by["1"] < 0.1          # 10% of one tensor's norm, over the whole layer's
    figures = change_figures(layers)
    assert figures["weight_change_max_layer"] == 1.0 and figures["weight_change_top3_share"] == 1.0
    assert weight_change_by_layer(models[0], models[0])[1]["relative_change"] == 0.0


def test_kl_to_the_start_is_zero_for_the_same_model_and_positive_for_a_moved_one(models):
    start, moved = map(str, models)
    prompts = ["1+2=", "33+4=", "5+61="]
    assert kl_to_start(start, start, prompts, samples=2, max_new_tokens=4, seed=0) == pytest.approx(0.0, abs=1e-6)
    assert kl_to_start(start, moved, prompts, samples=2, max_new_tokens=4, seed=0) > 0.0


@pytest.mark.parametrize("metrics, needle", [
    # most groups without reward variance: nothing to learn from
    ({"frac_reward_zero_std_mean": 0.92, "kl_to_start": 0.2}, "92% of groups had no reward variance"),
    # a policy that did not move
    ({"frac_reward_zero_std_mean": 0.1, "kl_to_start": 1e-5}, "the policy barely moved"),
    # neither: nothing to say
    ({"frac_reward_zero_std_mean": 0.1, "kl_to_start": 0.05}, ""),
])
def test_explain(metrics, needle):
    assert (needle in explain(metrics)) if needle else explain(metrics) == ""


def test_a_flat_stage_line_says_why_and_a_learning_one_does_not():
    flat = {"candidate_greedy_accuracy": 0.46, "accepted": 1.0, "steps": 100, "frac_reward_zero_std_mean": 0.92}
    line = stage_line("grpo@sums", flat, seconds=60, cached=False, before=0.46)
    assert line.endswith("; 92% of groups had no reward variance: the task is solved or unsolvable for this model "
                         "(see the pass-rate filter's band)")
    learned = {**flat, "candidate_greedy_accuracy": 0.60}
    assert "reward variance" not in stage_line("grpo@sums", learned, seconds=60, cached=False, before=0.46)
