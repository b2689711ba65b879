"""The memory savers of `posttrain memory` (8-bit AdamW, GaLore, LoGRA, training the top layers)
against values worked out by hand from each model's own parameter list, not by the code under test.

How the table was computed (from `AutoModelForCausalLM.from_config(...)` on the meta device: every
parameter's name and shape; P parameters, L the largest one, N GPUs; bytes of model states per GPU):
- 8-bit AdamW, the Trainer in fp32: 4P weights + 4P gradients + per tensor of n elements
  8n (an `nn.Embedding` weight, or n < 4,096) else 2n + 8 ceil(n / 256) (bitsandbytes' uint8
  states and an fp32 absmax per block of 256, two of each). DDP: the same on every N.
- GaLore rank 128 on q/k/v/o/gate/up/down, fp32: 4P + 4P + per targeted (out, in) weight
  2 r max(out, in) 4 + min(out, in)^2 4 (r = min(128, out, in); the fp32 projection is a view of
  the SVD's square factor), 8n for every other tensor.
- 8-bit AdamW under DeepSpeed ZeRO-3 (bf16): 4L + int((10P + 2P + 8 ceil(P / 256)) / N).
- The top half of the layers and the final norm (T parameters) under ZeRO-3:
  4L + int(18T / N) + int(2(P - T) / N).
- LoGRA rank 256 (an estimate), FSDP (the Trainer, fp32): 4L + int(4P / N) weights, int(G / N)
  gradients with G = 4 out min(256, in) per targeted (out, in) weight (the sketch) + 4n per other
  tensor, int(S / N) states with S = 4 out per target (RowAdam's row moment) + 8n per other tensor.
"""

from __future__ import annotations

import json

import pytest

from hardening import assert_refused, cli
from posttrain.capacity.memory import Setup, plan, shape
from test_memory import SHAPES

GEMMA2_27B = {"model_type": "gemma2", "vocab_size": 256000, "hidden_size": 4608, "num_hidden_layers": 46,
              "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 128, "intermediate_size": 36864}

# model -> GPUs -> (8-bit Trainer, GaLore Trainer, 8-bit ZeRO-3, top half ZeRO-3, LoGRA FSDP) bytes per GPU
EXPECTED = {
    'Qwen2.5-0.5B': {
        1: (5_768_747_008, 5_877_102_592, 6_488_370_368, 4_395_796_224, 4_467_787_776),
        8: (5_768_747_008, 5_877_102_592, 1_287_517_592, 1_025_945_824, 1_034_944_768),
        32: (5_768_747_008, 5_877_102_592, 730_283_366, 664_890_424, 667_140_160),
    },
    'Mistral-7B': {
        1: (73_425_961_088, 72_985_149_440, 87_651_377_280, 70_844_489_728, 34_054_930_432),
        8: (73_425_961_088, 72_985_149_440, 11_415_174_160, 9_314_313_216, 4_715_618_304),
        32: (73_425_961_088, 72_985_149_440, 3_247_009_540, 2_721_794_304, 1_572_120_576),
    },
    'Qwen2.5-7B': {
        1: (79_649_095_680, 78_940_037_120, 93_805_375_664, 69_616_225_280, 47_155_920_896),
        8: (79_649_095_680, 78_940_037_120, 13_633_162_774, 10_609_518_976, 7_801_980_928),
        32: (79_649_095_680, 78_940_037_120, 5_043_282_821, 4_287_371_872, 3_585_487_360),
    },
    'Llama-3.1-8B': {
        1: (83_689_160_832, 85_601_615_872, 98_715_426_944, 73_998_606_336, 48_248_455_168),
        8: (83_689_160_832, 85_601_615_872, 14_178_106_384, 11_088_503_808, 7_869_734_912),
        32: (83_689_160_832, 85_601_615_872, 5_120_536_324, 4_348_135_680, 3_543_443_456),
    },
    'Llama-3.1-70B': {
        1: (714_013_073_664, 699_027_030_016, 853_051_973_888, 692_929_052_672, 318_555_029_504),
        8: (714_013_073_664, 699_027_030_016, 110_308_852_768, 90_293_487_616, 43_496_734_720),
        32: (714_013_073_664, 699_027_030_016, 30_729_232_648, 25_725_391_360, 14_026_203_136),
    },
}
COLUMNS = ("8bit", "galore", "8bit_zero3", "top_half_zero3", "logra_fsdp")


def setups(config: dict, gpus: int) -> dict[str, Setup]:
    return {"8bit": Setup(optim="adamw_bnb_8bit", mixed_precision=False, gpus=gpus),
            "galore": Setup(optim="galore_adamw", galore_rank=128, mixed_precision=False, gpus=gpus),
            "8bit_zero3": Setup(optim="adamw_bnb_8bit", zero=3, gpus=gpus),
            "top_half_zero3": Setup(zero=3, gpus=gpus, trainable_layers=config["num_hidden_layers"] // 2),
            "logra_fsdp": Setup(optim="logra", sketch_rank=256, zero=3, engine="trainer", gpus=gpus,
                                mixed_precision=False)}


@pytest.mark.parametrize("name", EXPECTED)
@pytest.mark.parametrize("gpus", [1, 8, 32])
def test_each_saver_matches_the_hand_computed_table(name, gpus):
    config = SHAPES[name][0]
    found = {column: plan(config, setup).model_states_bytes for column, setup in setups(config, gpus).items()}
    assert found == dict(zip(COLUMNS, EXPECTED[name][gpus])), name


@pytest.mark.parametrize("config", [c for c, _ in SHAPES.values()] + [GEMMA2_27B])
def test_the_plans_tensors_are_the_models_parameters(config):
    """Every tensor the per-tensor rules see, with its size and linear shape, is a parameter of the
    model transformers builds (and nothing is missing): the names trainable patterns match too."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    theirs = {n: tuple(p.shape) for n, p in model.named_parameters()}
    s = shape(config)
    ours = {t.name.format(i=i): t for i in range(s.layers) for t in s.layer_tensors()}
    ours.update({t.name: t for t in s.outer_tensors()})
    assert set(ours) == set(theirs)
    for name, t in ours.items():
        assert t.numel == torch.Size(theirs[name]).numel() and (t.linear is None or t.linear == theirs[name]), name
    assert s.params == sum(torch.Size(v).numel() for v in theirs.values())


def test_what_the_savers_change():
    config, params = SHAPES["Llama-3.1-8B"]
    dense = plan(config, Setup(gradient_checkpointing=True, batch=4, seq=2048))
    eight = plan(config, Setup(optim="adamw_bnb_8bit", gradient_checkpointing=True, batch=4, seq=2048))
    assert eight.optimizer_bytes < dense.optimizer_bytes / 3 and eight.gradients_bytes == dense.gradients_bytes
    galore = plan(config, Setup(optim="galore_adamw", galore_rank=256, gradient_checkpointing=True, batch=4, seq=2048))
    assert galore.optimizer_step_bytes > 0 and galore.optimizer_bytes < dense.optimizer_bytes / 2
    logra = plan(config, Setup(optim="logra", gradient_checkpointing=True, batch=4, seq=2048))
    assert logra.gradients_bytes < dense.gradients_bytes / 5      # the sketch replaces the projections' gradients
    top = plan(config, Setup(trainable_layers=8, gradient_checkpointing=True, batch=4, seq=2048))
    kept = {n: plan(config, Setup(trainable_layers=n, batch=4, seq=2048)).activations_bytes for n in (8, 32)}
    assert kept[8] < kept[32] / 3                                  # nothing kept below the lowest trained layer
    assert top.logits_bytes < dense.logits_bytes                   # the frozen head needs no fp32 gradient
    assert dense.total_bytes > eight.total_bytes > top.total_bytes


def test_the_command_takes_each_saver(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(SHAPES["Qwen2.5-0.5B"][0]))
    found = {}
    for flags in (["--optim", "adamw_bnb_8bit"], ["--optim", "galore_adamw", "--galore-rank", "64"],
                  ["--optim", "logra", "--sketch-rank", "64"], ["--trainable-layers", "12"], []):
        done = cli("memory", tmp_path, "--json", *flags)
        assert done.returncode == 0, done.stderr
        figures = json.loads(done.stdout)
        found[" ".join(flags)] = figures["total_bytes"]
        assert ("estimate" in figures) == ("logra" in flags), flags     # the LoGRA row says it is an estimate
    assert all(total < found[""] for flags, total in found.items() if flags)


@pytest.mark.parametrize("args, needles", [
    (["--optim", "sgd_8bit"], ["--optim", "sgd_8bit", "not a transformers optimizer"]),
    (["--optim", "galore_adamw", "--zero", "3", "--gpus", "8"], ["--optim", "GaLore", "--zero 0"]),
    (["--optim", "galore_adamw", "--lora-rank", "8"], ["--optim", "LoRA"]),
    (["--optim", "logra", "--zero", "3", "--gpus", "8"], ["--optim", "DeepSpeed", "--engine trainer"]),
    (["--trainable-layers", "25"], ["--trainable-layers", "24 decoder layers"]),
    (["--galore-rank", "0"], ["--galore-rank", "out of range"]),
])
def test_bad_saver_flags_are_one_line(args, needles, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(SHAPES["Qwen2.5-0.5B"][0]))
    assert_refused(cli("memory", tmp_path, *args), *needles)


@pytest.mark.parametrize("trl, stage, needles", [
    ({"optim": "sgd_8bit"}, {}, ["sft.trl.optim", "sgd has no 8-bit form", "adamw_bnb_8bit"]),
    ({"optim": "galore_adamw", "optim_target_modules": ["q_proj"]}, {"peft": {"r": 4}},
     ["sft.trl.optim", "GaLore", "LoRA"]),
    ({"optim": "galore_adamw"}, {}, ["sft.trl.optim_target_modules", "GaLore needs"]),
    ({"optim": "galore_adamw", "optim_target_modules": ["qproj"]}, {}, ["sft.trl.optim_target_modules", "names none"]),
    ({"optim": "galore_adamw", "optim_target_modules": ["q_proj"], "optim_args": "rank=0"}, {},
     ["sft.trl.optim_args", "rank=0"]),
    ({"optim": "galore_adamw", "optim_target_modules": ["q_proj"], "optim_args": "rnk=4"}, {},
     ["sft.trl.optim_args", "rnk=4"]),
    ({"optim": "galore_adamw_8bit", "optim_target_modules": ["q_proj"]}, {}, ["sft.trl.optim", "CUDA"]),
    ({"optim": "logra"}, {}, ["sft.trl.optim", "planning row"]),
    ({}, {"trainable": {"patterns": ["model.layers.*.mlp.upproj.*"]}}, ["sft.trainable.patterns", "upproj"]),
])
def test_a_bad_optimizer_combination_is_refused_by_check(tmp_path, trl, stage, needles):
    """`posttrain check` refuses what the Trainer would fail on mid-run (or never say), in one line."""
    from conftest import REPO

    path = tmp_path / "bad.yaml"
    path.write_text(json.dumps({"extends": str(REPO / "configs" / "pipeline.yaml"), "sft": {"trl": trl, **stage}}))
    assert_refused(cli("check", "--config", path), *needles)


def test_the_stage_plan_reads_the_optimizer_from_trl(tmp_path):
    """A stage's `trl.optim` and GaLore's `optim_args` / `optim_target_modules` reach its plan."""
    from conftest import REPO
    from posttrain.capacity.fit import pipeline_plan
    from posttrain.config import load_config

    plans = {}
    for name, trl in {"adamw": {}, "8bit": {"optim": "adamw_bnb_8bit"},
                      "galore": {"optim": "galore_adamw", "optim_args": "rank=8", "optim_target_modules": "all-linear"}
                      }.items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(json.dumps({"extends": str(REPO / "configs" / "pipeline.yaml"), "sft": {"trl": trl}}))
        plans[name] = pipeline_plan(load_config(path), config_path=path, prompt_chars=8)["stages"]["sft"]
    assert plans["galore"]["setup"]["galore_rank"] == 8 and plans["galore"]["setup"]["optim"] == "galore_adamw"
    assert plans["8bit"]["optimizer_bytes"] < plans["adamw"]["optimizer_bytes"]


@pytest.mark.slow
@pytest.mark.parametrize("optim, extra", [
    ("adamw_bnb_8bit", {}),
    ("galore_adamw", {"optim_args": "rank=8", "optim_target_modules": "all-linear"}),
    ("adamw_torch", {}),
])
def test_a_real_step_keeps_the_states_the_plan_counts(tmp_path, optim, extra):
    """Two real TRL SFT steps on the tiny model (hidden 256, wider than bitsandbytes' 4,096-element
    threshold and GaLore's rank) with each optimizer: the weights move, and the bytes of every state
    tensor the optimizer holds (storage, once each: a GaLore projection is a view of its SVD factor)
    equal the plan's optimizer bytes."""
    import torch
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from posttrain.training.tiny_model import save_tiny_model, tiny_config
    from transformers import AutoTokenizer

    shape_args = dict(hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=512,
                      max_positions=32)
    save_tiny_model(tmp_path / "m", seed=0, **shape_args)
    rows = [{"prompt": f"{a}+{b}=", "completion": str(a + b)} for a in range(6) for b in range(6)]
    args = SFTConfig(output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=8, learning_rate=1e-3,
                     use_cpu=True, bf16=False, report_to=[], save_strategy="no", disable_tqdm=True, optim=optim,
                     **extra)
    trainer = SFTTrainer(model=str(tmp_path / "m"), args=args, train_dataset=Dataset.from_list(rows),
                         processing_class=AutoTokenizer.from_pretrained(tmp_path / "m"))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert all(not torch.equal(p.detach(), before[n]) for n, p in trainer.model.named_parameters())
    storages, held = set(), 0
    for state in trainer.optimizer.state.values():
        tensors = [v for v in state.values() if isinstance(v, torch.Tensor)]
        tensors += [state["projector"].ortho_matrix] if "projector" in state else []
        for t in tensors:  # not the step counter, nor bitsandbytes' two quantisation maps, shared by all
            shared = any(t is state.get(q) for q in ("qmap1", "qmap2"))
            key = t.untyped_storage().data_ptr()
            if t.dim() and not shared and key not in storages:
                storages.add(key)
                held += t.untyped_storage().nbytes()
    config = tiny_config(**shape_args).to_dict()
    fields = {"optim": optim, **({"galore_rank": 8, "galore_targets": "all-linear"} if "galore" in optim else {})}
    planned = plan(config, Setup(method="sft", mixed_precision=False, cpu=True, **fields))
    assert held == planned.optimizer_bytes, (held, planned.optimizer_bytes)
