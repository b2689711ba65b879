"""Will it fit (issue 15): every training stage's memory plan from a pipeline config
(posttrain/capacity/fit.py), checked against what no one here wrote (DeepSpeed's ZeRO-3 estimator
through a real accelerate config, peft's own adapter on the model's real modules), and
the refusal of a stage that does not fit, before any compute, with the cheapest fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from hardening import assert_refused, cli
from posttrain.capacity.memory import GIB, Setup, plan
from test_memory import SHAPES

REPO = Path(__file__).resolve().parents[1]
QWEN7B, QWEN7B_PARAMS = SHAPES["Qwen2.5-7B"]


@pytest.fixture
def qwen(tmp_path):
    """A Qwen2.5-7B-shaped model folder (its config.json: all a plan reads) and a writer of
    configs that train it with the default pipeline's stages."""
    model = tmp_path / "qwen7b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**QWEN7B, "max_position_embeddings": 32768}))

    def write(name: str = "big.yaml", **sections) -> Path:
        config = {"extends": str(REPO / "configs" / "pipeline.yaml"), "model": {"path": str(model)}, **sections}
        path = tmp_path / name
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        return path
    return write


def memory(config: Path) -> dict:
    done = cli("memory", "--config", config, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_the_default_pipeline_plans_as_it_trains_here():
    """No GPU declared: each stage as this CPU trains it (fp32), with TRL's own defaults
    where the config is silent (gradient checkpointing on in TRL 1.x)."""
    figures = memory(REPO / "configs" / "pipeline.yaml")
    assert figures["gpu"] is None and set(figures["stages"]) == {"sft", "grpo@dense"}
    from posttrain.config import load_config
    from posttrain.capacity.fit import model_config

    config = load_config(REPO / "configs" / "pipeline.yaml")
    sft = figures["stages"]["sft"]
    expected = plan(model_config(config), Setup(method="sft", batch=64, seq=32, gradient_checkpointing=True,
                                                mixed_precision=False, cpu=True))
    assert sft["total_bytes"] == expected.total_bytes and sft["fits"] is None
    grpo = figures["stages"]["grpo@dense"]
    assert grpo["setup"]["completion"] == 5 and grpo["setup"]["beta"] == 0.02 and grpo["reference_bytes"] > 0
    for key in ("weights_bytes", "gradients_bytes", "optimizer_bytes", "reference_bytes", "activations_bytes",
                "logits_bytes", "generation_bytes", "model_states_bytes", "total_bytes"):
        assert isinstance(grpo[key], int), key


def test_zero3_through_the_accelerate_config_equals_deepspeeds_estimator(qwen):
    """`launcher: accelerate` with infra/accelerate/zero3.yaml on 8 GPUs: the stage's model
    states are DeepSpeed's own estimate for that model on 8 GPUs, to the byte."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    from posttrain.capacity.memory import shape

    config = qwen(training={"gpu": "H100-80GB", "num_gpus": 8},
                  launcher={"type": "accelerate", "processes": 8,
                            "accelerate_config": str(REPO / "infra" / "accelerate" / "zero3.yaml")})
    stage = memory(config)["stages"]["sft"]
    _, theirs, _ = estimate_zero3_model_states_mem_needs(QWEN7B_PARAMS, shape(QWEN7B).largest_layer, 8, 1,
                                                         cpu_offload=False, cpu_offload_params=False)
    assert stage["setup"]["zero"] == 3 and stage["setup"]["gpus"] == 8
    assert stage["model_states_bytes"] == theirs


def test_a_lora_stage_trains_what_peft_would_train(tmp_path):
    """`peft: {r: 16}` with peft's default modules, and with all-linear: the plan's trained
    parameters equal peft's count on the model built (empty) from the same config.json."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    small, _ = SHAPES["Qwen2.5-0.5B"]
    model_dir = tmp_path / "qwen05b"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({**small, "max_position_embeddings": 32768}))
    for peft in ({"r": 16}, {"r": 8, "target_modules": "all-linear"}, {"r": 4, "target_modules": ["k_proj", "down_proj"]}):
        path = tmp_path / "lora.yaml"
        path.write_text(yaml.safe_dump({"extends": str(REPO / "configs" / "pipeline.yaml"),
                                        "model": {"path": str(model_dir)}, "sft": {"peft": peft}}))
        ours = memory(path)["stages"]["sft"]["trainable_params"]
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**small))
        adapted = get_peft_model(model, LoraConfig(**peft))
        theirs = sum(p.numel() for p in adapted.parameters() if p.requires_grad)
        assert ours == theirs, peft


def test_a_stage_that_does_not_fit_is_refused_with_the_cheapest_fix(qwen):
    """GRPO on a 7B model on one H100 without gradient checkpointing: `posttrain check`
    refuses in one line (stage, peak, budget, fix); the fix it names, applied, passes."""
    big = qwen(training={"gpu": "H100-80GB", "num_gpus": 8},
               launcher={"type": "accelerate", "processes": 8,
                         "accelerate_config": str(REPO / "infra" / "accelerate" / "zero3.yaml")},
               sft={"trl": {"max_length": 1024, "per_device_train_batch_size": 2}},
               grpo={"dense": {"trl": {"per_device_train_batch_size": 16, "max_completion_length": 2048,
                                       "gradient_checkpointing": False}}})
    done = cli("check", "--config", big, "--elsewhere")
    assert_refused(done, "big.yaml: grpo.dense:", "training stage grpo@dense needs", "GiB per GPU",
                   "over the budget of 77.2 GiB (H100-80GB: 79.2 GiB less a 2 GiB reserve)",
                   "fix: set grpo.dense.trl.gradient_checkpointing: true", "the cheapest change that fits")
    stage = memory(big)["stages"]["grpo@dense"]
    assert stage["fits"] is False and stage["total_bytes"] > stage["budget_bytes"] >= stage["fix_total_bytes"]

    fixed = qwen("fixed.yaml", **{**yaml.safe_load(big.read_text()), "grpo": {"dense": {"trl": {
        "per_device_train_batch_size": 16, "max_completion_length": 2048, "gradient_checkpointing": True}}}})
    done = cli("check", "--config", fixed, "--elsewhere")
    assert done.returncode == 0, done.stderr
    assert "every training stage fits H100-80GB" in done.stdout
    assert memory(fixed)["stages"]["grpo@dense"]["total_bytes"] == stage["fix_total_bytes"]


def test_fixes_come_in_order_of_cost(qwen):
    """SFT of a 7B model, micro-batches of 16 x 8,192 tokens (TRL's default gradient
    checkpointing on): on one H200 a smaller micro-batch (the same global batch) is enough;
    with 8 H100s declared, ZeRO-3 over them; on one L40S only LoRA (and a smaller batch)
    fits; on an L4 nothing does, and it says so."""
    sft = {"trl": {"max_length": 8192, "per_device_train_batch_size": 16}}
    fixes = {gpu: memory(qwen(f"{gpu}.yaml", training=training, sft=sft))["stages"]["sft"]
             for gpu, training in [("H200", {"gpu": "H200-141GB"}), ("H100", {"gpu": "H100-80GB", "num_gpus": 8}),
                                   ("L40S", {"gpu": "L40S-48GB"}), ("L4", {"gpu": "L4-24GB"})]}
    assert fixes["H200"]["fix"] == ("set sft.trl.per_device_train_batch_size: 4 with gradient_accumulation_steps: 4 "
                                    "(the same global batch)")
    assert fixes["H100"]["fix"].startswith("set sft.launcher: {type: accelerate, processes: 8, accelerate_config: "
                                           "infra/accelerate/zero3.yaml} with sft.trl.per_device_train_batch_size: 2 "
                                           "and gradient_accumulation_steps: 1")   # the same global batch of 16
    assert fixes["L40S"]["fix"].startswith("set sft.peft: {r: 16, target_modules: all-linear}")
    assert fixes["L4"]["fix"].startswith("set sft.peft: {r: 16, target_modules: all-linear} and "
                                         "sft.trl.model_init_kwargs: {dtype: bfloat16}")   # the base in bf16 too
    for gpu in fixes:
        assert fixes[gpu]["fits"] is False and fixes[gpu]["fix_total_bytes"] <= fixes[gpu]["budget_bytes"]


def test_what_nothing_can_fix_is_said(tmp_path):
    """Llama-3.1-70B on one L4: not even LoRA on a bf16 base fits; it says so in one line."""
    config, _ = SHAPES["Llama-3.1-70B"]
    model = tmp_path / "llama70b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 131072}))
    path = tmp_path / "l4.yaml"
    path.write_text(yaml.safe_dump({"extends": str(REPO / "configs" / "pipeline.yaml"), "model": {"path": str(model)},
                                    "training": {"gpu": "L4-24GB"}}))
    assert_refused(cli("check", "--config", path), "l4.yaml: sft:", "nothing posttrain can change fits it",
                   "use GPUs with more memory")


@pytest.mark.parametrize("sections, needles", [
    ({"training": {"gpu": "H100-80GB", "num_gpus": 2}, "launcher": {"type": "torchrun", "processes": 4}},
     ["launcher.processes", "4 processes per node", "training.num_gpus declares 2"]),
    ({"training": {"num_gpus": 2}}, ["training", "num_gpus", "set training.gpu"]),
    ({"training": {"gpu": "B300"}}, ["training.gpu", "unknown GPU profile", "H100-80GB"]),
    ({"training": {"gpu": "H100-80GB"}, "grpo": {"dense": {"trl": {"per_device_train_batch_size": "8"}}}},
     ["grpo.dense.trl.per_device_train_batch_size"]),
    ({"sft": {"peft": {"r": None}}}, ["sft.peft.r", "not a LoRA rank"]),                    # no GPU declared either
    ({"sft": {"peft": {"target_modules": "(["}}}, ["sft.peft.target_modules", "not a regular expression"]),
    ({"sft": {"peft": {"target_modules": "q_proj"}}}, ["sft.peft.target_modules", "matches none", "[q_proj, v_proj]"]),
])
def test_bad_training_sections_are_one_line(qwen, sections, needles):
    assert_refused(cli("check", "--config", qwen(**sections), "--elsewhere"), *needles)


def test_the_memory_command_refuses_mixed_flags(qwen):
    assert_refused(cli("memory", "--config", qwen(), "--zero", "3"), "posttrain memory --zero", "leave out the flag")
    assert_refused(cli("memory"), "posttrain memory", "no model given")


def test_posttrain_run_refuses_before_anything_is_written(qwen, tmp_path):
    """The start of `posttrain run`: no workspace, no MLflow store, one line, exit 2."""
    big = qwen(training={"gpu": "L4-24GB"})
    before = sorted(p.name for p in tmp_path.iterdir())
    done = cli("run", "--config", big, cwd=tmp_path)
    assert_refused(done, "big.yaml: sft:", "over the budget", "L4-24GB")
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_a_model_the_plan_does_not_know(tmp_path):
    """A Phi-3 model (fused qkv and gate/up projections: not a Llama-like decoder): without a GPU declared the stages are not
    planned and say why; with one, the check cannot be made and says so in one line."""
    model = tmp_path / "phi3"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "model_type": "phi3", "vocab_size": 32064, "hidden_size": 3072, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 32, "intermediate_size": 8192,
        "max_position_embeddings": 4096, "tie_word_embeddings": False}))
    path = tmp_path / "phi3.yaml"
    path.write_text(yaml.safe_dump({"extends": str(REPO / "configs" / "pipeline.yaml"), "model": {"path": str(model)}}))
    stages = memory(path)["stages"]
    assert not stages["sft"]["planned"] and "phi3" in stages["sft"]["reason"]
    assert cli("check", "--config", path).returncode == 0
    path.write_text(yaml.safe_dump({"extends": str(REPO / "configs" / "pipeline.yaml"), "model": {"path": str(model)},
                                    "training": {"gpu": "H100-80GB"}}))
    assert_refused(cli("check", "--config", path), "training.gpu", "cannot read the model", "phi3")


def test_what_grpo_generates_at_once_and_deepspeeds_json(qwen, tmp_path):
    """GRPO's KV cache is for the generation batch (micro-batch x steps_per_generation, by
    default the accumulation steps), and ZeRO-3 gathers the whole 16-bit model to generate
    (TRL's ds3_gather_for_generation); a ZeRO-3 stage given in DeepSpeed's own JSON file
    (accelerate's deepspeed_config_file) is planned as ZeRO-3."""
    config, _ = SHAPES["Qwen2.5-7B"]
    ds = tmp_path / "ds3.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3}, "bf16": {"enabled": "auto"}}))
    accelerate = tmp_path / "accelerate.yaml"
    accelerate.write_text(yaml.safe_dump({"compute_environment": "LOCAL_MACHINE", "distributed_type": "DEEPSPEED",
                                          "deepspeed_config": {"deepspeed_config_file": str(ds)},
                                          "main_training_function": "main", "use_cpu": False}))
    grpo = {"trl": {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 4, "max_completion_length": 1024}}
    plans = {name: memory(qwen(f"{name}.yaml", training={"gpu": "H200-141GB", "num_gpus": 8}, launcher=launcher,
                               grpo={"dense": grpo}))["stages"]["grpo@dense"]
             for name, launcher in [("ddp", {"type": "torchrun", "processes": 8}),
                                    ("zero3", {"type": "accelerate", "processes": 8,
                                               "accelerate_config": str(accelerate)})]}
    kv_per_sequence = 2 * config["num_hidden_layers"] * 4 * 128 * plans["ddp"]["setup"]["seq"] * 2   # bf16
    assert plans["ddp"]["setup"]["generation_batch"] == 32
    assert plans["ddp"]["generation_bytes"] == 32 * kv_per_sequence
    assert plans["zero3"]["setup"]["zero"] == 3 and plans["zero3"]["setup"]["engine"] == "deepspeed"
    assert plans["zero3"]["generation_bytes"] == 32 * kv_per_sequence + 2 * QWEN7B_PARAMS   # the gathered model


def test_the_optimizer_levers_come_before_lora(qwen):
    """Qwen2.5-7B SFT on one GPU: in fp32 (TRL's default load) on an H100 its AdamW moments are
    what does not fit, and 8-bit AdamW states (every weight still training) are the fix picked,
    before GaLore and LoRA; with the weights loaded in bf16 on an L40S, 8-bit is not enough and
    GaLore's projected moments are."""
    def sft(dtype: str) -> dict:
        return {"trl": {"max_length": 1024, "per_device_train_batch_size": 1, "model_init_kwargs": {"dtype": dtype}}}
    h100 = memory(qwen("h100.yaml", training={"gpu": "H100-80GB"}, sft=sft("float32")))["stages"]["sft"]
    assert h100["fix"] == "set sft.trl.optim: adamw_bnb_8bit (8-bit AdamW states)"
    l40s = memory(qwen("l40s.yaml", training={"gpu": "L40S-48GB"}, sft=sft("bfloat16")))["stages"]["sft"]
    assert l40s["fix"].startswith("set sft.trl.optim: galore_adamw with optim_args: rank=128"), l40s["fix"]
    for stage in (h100, l40s):
        assert stage["fix_total_bytes"] <= stage["budget_bytes"] < stage["total_bytes"]
