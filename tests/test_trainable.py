"""A stage's `trainable:` (posttrain/training/trainable.py): which weights train, checked
against the model before compute, and a real TRL step that moves only those (issue 27)."""

from __future__ import annotations

import pytest
import yaml

from hardening import assert_refused, cli

NAMES = ["model.embed_tokens.weight", *[f"model.layers.{i}.{part}" for i in range(4)
                                        for part in ("self_attn.q_proj.weight", "mlp.up_proj.weight",
                                                     "input_layernorm.weight")],
         "model.norm.weight"]


@pytest.mark.parametrize("top, patterns, expected", [
    (1, [], {"model.layers.3.self_attn.q_proj.weight", "model.layers.3.mlp.up_proj.weight",
             "model.layers.3.input_layernorm.weight", "model.norm.weight"}),        # the last layer and the final norm
    (None, ["model.layers.*.mlp.*"], {f"model.layers.{i}.mlp.up_proj.weight" for i in range(4)}),  # a glob alone
    (1, ["model.embed_tokens.*"], {"model.layers.3.self_attn.q_proj.weight", "model.layers.3.mlp.up_proj.weight",
                                   "model.layers.3.input_layernorm.weight", "model.norm.weight",
                                   "model.embed_tokens.weight"}),                   # both: the union
    (4, [], set(NAMES) - {"model.embed_tokens.weight"}),                           # every layer, never the embedding
])
def test_selected(top, patterns, expected):
    from posttrain.training.trainable import selected

    assert set(selected(NAMES, top_layers=top, patterns=patterns, num_layers=4)) == expected


@pytest.mark.parametrize("stage_block, needles", [
    ({"trainable": {"top_layers": 9}}, ["sft.trainable.top_layers", "4 decoder layers"]),          # more than the model has
    ({"trainable": {"patterns": ["model.layer.*"]}}, ["sft.trainable.patterns", "model.layer.*"]),  # a typo: matches nothing
    ({"trainable": {}}, ["sft.trainable", "names no weights"]),                                     # an empty section
    ({"trainable": {"top_layers": 2}, "peft": {"r": 4}}, ["sft.trainable", "LoRA"]),                # with an adapter
])
def test_a_bad_trainable_is_refused_before_compute(tmp_path, stage_block, needles):
    from conftest import REPO

    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"extends": str(REPO / "configs" / "pipeline.yaml"), "sft": stage_block}))
    assert_refused(cli("check", "--config", path), *needles)


def test_a_trl_step_moves_only_the_trainable_weights(tmp_path):
    import torch
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from posttrain.config import TrainableSection
    from posttrain.training.tiny_model import save_tiny_model
    from posttrain.training.trainable import freeze
    from transformers import AutoTokenizer

    save_tiny_model(tmp_path / "m", seed=0, hidden_size=32, num_layers=3, num_heads=2, num_kv_heads=1,
                    intermediate_size=64, max_positions=32)
    rows = [{"prompt": f"{a}+{b}=", "completion": str(a + b)} for a in range(6) for b in range(6)]
    args = SFTConfig(output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=8, learning_rate=1e-2,
                     use_cpu=True, bf16=False, report_to=[], save_strategy="no", disable_tqdm=True)
    trainer = SFTTrainer(model=str(tmp_path / "m"), args=args, train_dataset=Dataset.from_list(rows),
                         processing_class=AutoTokenizer.from_pretrained(tmp_path / "m"))
    counts = freeze(trainer.model, TrainableSection(top_layers=1))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    moved = {n for n, p in trainer.model.named_parameters() if not torch.equal(p.detach(), before[n])}
    assert moved and all(n.startswith("model.layers.2.") or n == "model.norm.weight" for n in moved), moved
    assert 0 < counts["trainable_params"] < counts["total_params"]


def test_the_memory_plan_counts_only_the_trained_weights(tmp_path):
    from conftest import REPO
    from posttrain.capacity.fit import pipeline_plan
    from posttrain.config import load_config

    path = tmp_path / "top.yaml"
    path.write_text(yaml.safe_dump({"extends": str(REPO / "configs" / "pipeline.yaml"),
                                    "sft": {"trainable": {"top_layers": 1}}}))
    whole = pipeline_plan(load_config(REPO / "configs" / "pipeline.yaml"), config_path=str(path), prompt_chars=8)
    top = pipeline_plan(load_config(path), config_path=str(path), prompt_chars=8)
    # the default tiny model: 4 layers of hidden 128; one layer and the final norm train
    per_layer = 128 * 128 * 2 + 128 * 64 * 2 + 3 * 128 * 512 + 2 * 128
    assert top["stages"]["sft"]["trainable_params"] == per_layer + 128
    assert top["stages"]["sft"]["gradients_bytes"] == 4 * (per_layer + 128) < whole["stages"]["sft"]["gradients_bytes"]
