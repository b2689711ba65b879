"""`sft.stop_when`'s callback on real TRL: measuring leaves the run as it was, the curve
ends where training ended, and a reached target stops training."""

import functools

import pytest
import torch

from posttrain.envs import get_env
from posttrain.training.stopping import StopOnTarget, carve_validation, validation_curve


def train(tmp_path, *, stopper: dict | None, epochs: int = 2):
    """SFT on a tiny model for `epochs` (5 steps each), with the callback when `stopper` is given."""
    from datasets import Dataset
    from transformers import AutoTokenizer, Trainer
    from trl import SFTConfig, SFTTrainer

    from posttrain.training.trl_bridge import device_defaults
    from posttrain.training.tiny_model import save_tiny_model

    base = tmp_path / "base"
    if not base.exists():
        save_tiny_model(base, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64,
                        max_positions=32, seed=0)
    env = get_env("arithmetic", operand_max=9, heldout_size=20)
    rows, validation = carve_validation(env.generate(0)["train"], 10, seed=0)
    args = SFTConfig(output_dir=str(tmp_path / "out"), num_train_epochs=epochs, per_device_train_batch_size=16,
                     learning_rate=3e-3, report_to=[], save_strategy="no", disable_tqdm=True, seed=0,
                     **device_defaults())
    trainer = SFTTrainer(model=str(base), args=args, processing_class=AutoTokenizer.from_pretrained(base),
                         train_dataset=Dataset.from_list([{"prompt": r["prompt"], "completion": r["completion"]}
                                                          for r in rows]))
    if stopper is not None:
        trainer.add_callback(StopOnTarget(env, validation, max_new_tokens=4,
                                          log=functools.partial(Trainer.log, trainer), **stopper))
    trainer.train()
    return trainer


def test_carve_validation_is_seeded_and_disjoint():
    rows = [{"prompt": str(i)} for i in range(100)]
    train_rows, validation = carve_validation(rows, 20, seed=3)
    assert (train_rows, validation) == carve_validation(rows, 20, seed=3)
    assert len(validation) == 20 and len(train_rows) == 80
    assert not {r["prompt"] for r in train_rows} & {r["prompt"] for r in validation}


@pytest.mark.slow
def test_measuring_never_changes_the_run_and_the_curve_ends_at_the_last_step(tmp_path):
    plain = train(tmp_path, stopper=None)
    measured = train(tmp_path, stopper={"target": 1.01, "every_steps": 4})     # 10 steps, never stops
    for a, b in zip(plain.model.parameters(), measured.model.parameters()):
        assert torch.equal(a, b)
    assert [p["step"] for p in validation_curve(measured.state.log_history)] == [4, 8, 10]


@pytest.mark.slow
def test_a_reached_target_stops_training(tmp_path):
    trainer = train(tmp_path, stopper={"target": 0.0, "every_steps": 3}, epochs=4)   # 0% is reached at once
    curve = validation_curve(trainer.state.log_history)
    assert trainer.state.global_step == 3 and [p["step"] for p in curve] == [3]
