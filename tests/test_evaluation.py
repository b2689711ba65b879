"""Sampling backends: vLLM and transformers `generate` give the same metrics within noise."""

import pytest

from posttrain.envs import get_env
from posttrain.scoring.evaluation import sample_models, score


@pytest.fixture(scope="module")
def trained_model(tmp_path_factory):
    """A tiny model vLLM's CPU kernels accept (head_dim 32), warmed up on 1-digit sums."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from posttrain.training.trl_bridge import device_defaults
    from posttrain.training.tiny_model import save_tiny_model

    root = tmp_path_factory.mktemp("model")
    save_tiny_model(root / "base", seed=0, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                    intermediate_size=128, max_positions=32)
    env = get_env("arithmetic", operand_max=9, heldout_size=20)
    rows = env.generate(0)["train"]
    args = SFTConfig(output_dir=str(root / "ck"), num_train_epochs=15, per_device_train_batch_size=16,
                     learning_rate=3e-3, report_to=[], save_strategy="no", disable_tqdm=True, seed=0,
                     **device_defaults())
    trainer = SFTTrainer(model=str(root / "base"), args=args, processing_class=AutoTokenizer.from_pretrained(root / "base"),
                         train_dataset=Dataset.from_list([{"prompt": r["prompt"], "completion": r["completion"]}
                                                          for r in rows]))
    trainer.train()
    trainer.save_model(str(root / "sft"))
    return {"base": str(root / "base"), "sft": str(root / "sft")}, env, rows


@pytest.mark.slow
def test_vllm_and_transformers_agree(trained_model):
    models, env, rows = trained_model
    prompts = [r["prompt"] for r in rows]
    results = {}
    for backend in ("vllm", "transformers"):
        out = sample_models(models, prompts, backend=backend, n=32, temperature=1.0, max_new_tokens=4, seed=0)
        results[backend] = {name: score(env, rows, greedy, sampled, ks=[1, 8], resamples=1000, seed=0)[0] for name, (greedy, sampled) in out.items()}
    vllm, hf = results["vllm"], results["transformers"]
    assert 0.05 < hf["sft"]["pass_at_k"]["1"] < 0.99   # a model with something to measure
    for name in models:
        # greedy decoding is deterministic: at most one prompt may flip on a near-tie
        assert abs(vllm[name]["greedy_accuracy"] - hf[name]["greedy_accuracy"]) <= 1 / len(rows) + 1e-9
        # 80 prompts x 32 samples: pass@1's standard error is about 0.01
        assert vllm[name]["pass_at_k"]["1"] == pytest.approx(hf[name]["pass_at_k"]["1"], abs=0.05)
        assert vllm[name]["pass_at_k"]["8"] == pytest.approx(hf[name]["pass_at_k"]["8"], abs=0.06)


def test_greedy_decodes_a_gate_made_are_reused_only_when_they_match():
    """The evaluate stage takes a model's greedy completions from its card when the gate
    decoded every prompt with the same max_new_tokens; otherwise it decodes them itself."""
    from posttrain.scoring.evaluation import known_greedy

    gate = {"outcomes": {"prompts": ["1+1=", "2+2=", "3+3="]},
            "greedy": {"max_new_tokens": 5, "completions": ["2", "4", "7"]}}
    evaluations = {"sft": gate, "base": None, "old": {"outcomes": {"prompts": ["1+1="]}}}
    assert known_greedy(evaluations, ["3+3=", "1+1="], 5) == {"sft": ["7", "2"]}
    assert known_greedy(evaluations, ["3+3=", "1+1="], 6) == {}          # another length: decode again
    assert known_greedy(evaluations, ["3+3=", "9+9="], 5) == {}          # a prompt the gate did not see
