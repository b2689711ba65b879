"""GRPO on one node of 8 x H100-80GB: per GPU, for a 27B dense model (Gemma-2-27B's published
config) and Llama-3.1-70B, each memory lever alone and the cheapest setup that fits, from the
plan (posttrain/capacity/memory.py) and the fit gate (posttrain/capacity/fit.py).

The step: micro-batches of 2 sequences of 2,048 tokens (512 of prompt, 1,536 of completion),
gradient checkpointing (TRL's default), bf16 compute, beta 0 (TRL's default: no reference
model), generation on a vLLM server elsewhere (none of the GPU's memory). Budget: the profile's
79.2 GiB less its 2 GiB reserve. Pure arithmetic: it runs in seconds anywhere.

    .venv/bin/python bench/memory_table.py            # prints the markdown table and the LoGRA check
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from posttrain import workspace  # noqa: E402
from posttrain.capacity.memory import GIB, Setup, plan  # noqa: E402
from posttrain.capacity.profiles import PACKAGED, load_gpu_profile  # noqa: E402

MODELS = {
    "Gemma-2-27B": {"model_type": "gemma2", "vocab_size": 256000, "hidden_size": 4608, "num_hidden_layers": 46,
                    "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 128,
                    "intermediate_size": 36864, "max_position_embeddings": 8192},
    "Llama-3.1-70B": {"model_type": "llama", "vocab_size": 128256, "hidden_size": 8192, "num_hidden_layers": 80,
                      "num_attention_heads": 64, "num_key_value_heads": 8, "intermediate_size": 28672,
                      "tie_word_embeddings": False, "attention_bias": False, "max_position_embeddings": 131072},
}
GPU, GPUS, BATCH, PROMPT, COMPLETION = "H100-80GB", 8, 2, 512, 1536
COLOCATED = 0.3  # TRL's GRPOConfig.vllm_gpu_memory_utilization default
STEP = Setup(method="grpo", gpus=GPUS, batch=BATCH, seq=PROMPT + COMPLETION, completion=COMPLETION,
             gradient_checkpointing=True, vllm_server=True)


def levers(layers: int) -> dict[str, Setup]:
    """Each lever alone on top of the step (DDP unless it says otherwise)."""
    return {
        "dense AdamW, DDP (fp32 weights, as TRL loads them)": STEP,
        "dense AdamW, DeepSpeed ZeRO-3 (bf16 weights, fp32 master)": replace(STEP, zero=3, engine="deepspeed"),
        "dense AdamW, FSDP (fp32 weights sharded)": replace(STEP, zero=3, engine="trainer"),
        "8-bit AdamW, DDP": replace(STEP, optim="adamw_bnb_8bit"),
        "8-bit AdamW, ZeRO-3": replace(STEP, optim="adamw_bnb_8bit", zero=3, engine="deepspeed"),
        "GaLore r=256 (attention + MLP), DDP": replace(STEP, optim="galore_adamw", galore_rank=256),
        "LoRA r=16 (all linears), DDP, base in bf16": replace(STEP, lora_rank=16, load_bytes=2),
        f"top half of the layers ({layers // 2}), DDP": replace(STEP, trainable_layers=layers // 2),
        f"top half of the layers ({layers // 2}), ZeRO-3": replace(STEP, trainable_layers=layers // 2, zero=3,
                                                                    engine="deepspeed"),
        "LoGRA r=256 (estimate), FSDP (fp32 weights sharded)": replace(STEP, optim="logra", zero=3, engine="trainer"),
    }


def cheapest(name: str, config: dict) -> str:
    """What `posttrain memory --config` says of a default GRPO stage of this model on 8 x H100: its
    plan, or the cheapest fix the fit gate picks."""
    folder = Path(tempfile.mkdtemp())
    (folder / "model").mkdir()
    (folder / "model" / "config.json").write_text(json.dumps(config))
    trl = {"per_device_train_batch_size": BATCH, "num_generations": BATCH * GPUS, "max_completion_length": COMPLETION,
           "gradient_checkpointing": True, "beta": 0.0, "use_vllm": True, "vllm_mode": "server", "bf16": True}
    pipeline = {"extends": str(REPO / "configs" / "pipeline.yaml"), "model": {"path": str(folder / "model")},
                "training": {"gpu": GPU, "num_gpus": GPUS},
                "launcher": {"type": "torchrun", "processes": GPUS},
                "sft": {"trl": {"max_length": PROMPT + COMPLETION, "per_device_train_batch_size": BATCH, "bf16": True}},
                "grpo": {"dense": {"trl": trl}}}
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(pipeline, sort_keys=False))
    done = subprocess.run([workspace.tool_path("posttrain"), "memory", "--config", str(path), "--json"],
                          capture_output=True, text=True)
    if done.returncode:
        return f"(posttrain memory refused: {done.stderr.strip()[:200]})"
    stage = json.loads(done.stdout)["stages"]["grpo@dense"]
    if stage["fits"]:
        return f"the stage as configured fits ({stage['total_bytes'] / GIB:.1f} GiB)"
    after = f" -> {stage['fix_total_bytes'] / GIB:.1f} GiB" if stage["fix_total_bytes"] else ""
    return f"{stage['total_bytes'] / GIB:.1f} GiB as configured; {stage['fix']}{after}"


def main() -> None:
    profile = load_gpu_profile(str(PACKAGED), GPU)
    budget = (profile["memory_gib"] - profile["reserve_gib"]) * GIB
    print(f"GRPO per GPU on one node of {GPUS} x {GPU} (budget {budget / GIB:.1f} GiB): micro-batch {BATCH} x "
          f"{PROMPT + COMPLETION} tokens ({COMPLETION} completion), gradient checkpointing, beta 0, vLLM server\n")
    totals = {}
    for name, config in MODELS.items():
        layers = config["num_hidden_layers"]
        print(f"### {name}\n")
        print("| setup | trained params | weights | gradients | optimizer | activations + logits | total GiB | fits |")
        print("|---|---|---|---|---|---|---|---|")
        for label, setup in levers(layers).items():
            p = plan(config, setup)
            totals[name, label] = p.total_bytes
            print(f"| {label} | {p.trainable_params / 1e9:.2f}B | {p.weights_bytes / GIB:.1f} "
                  f"| {p.gradients_bytes / GIB:.1f} | {p.optimizer_bytes / GIB:.1f} "
                  f"| {(p.activations_bytes + p.logits_bytes) / GIB:.1f} | {p.total_bytes / GIB:.1f} "
                  f"| {'fits' if p.total_bytes <= budget else 'does not fit'} |")
        print(f"\nCheapest setup that fits (the fit gate, `posttrain memory --config` on a default GRPO stage, "
              f"DDP over {GPUS} GPUs): {cheapest(name, config)}\n")
    dense = totals["Gemma-2-27B", "dense AdamW, FSDP (fp32 weights sharded)"]
    logra = totals["Gemma-2-27B", "LoGRA r=256 (estimate), FSDP (fp32 weights sharded)"]
    ddp = totals["Gemma-2-27B", "dense AdamW, DDP (fp32 weights, as TRL loads them)"]
    print(f"LoGRA check, Gemma-2-27B under FSDP: {logra / GIB:.1f} GiB against dense AdamW's {dense / GIB:.1f} GiB "
          f"per GPU: {1 - logra / dense:.1%} less ({'fits' if logra <= budget else 'does not fit'}; dense "
          f"{'fits' if dense <= budget else 'does not fit'}); against unsharded dense AdamW ({ddp / GIB:.1f} GiB): "
          f"{1 - logra / ddp:.1%} less")
    gpu_bytes = int(profile["memory_gib"] * GIB)  # RL with generation colocated: vLLM keeps TRL's default share
    for label in ("dense AdamW, FSDP (fp32 weights sharded)", "LoGRA r=256 (estimate), FSDP (fp32 weights sharded)"):
        setup = replace(levers(46)[label], vllm_server=False, vllm_share=COLOCATED, gpu_bytes=gpu_bytes)
        total = plan(MODELS["Gemma-2-27B"], setup).total_bytes
        totals["colocated", label] = total
        print(f"With vLLM colocated ({COLOCATED:.0%} of each GPU, TRL's vllm_gpu_memory_utilization default), "
              f"{label}: {total / GIB:.1f} GiB: {'fits' if total <= budget else 'does not fit'}")
    cut = 1 - totals["colocated", "LoGRA r=256 (estimate), FSDP (fp32 weights sharded)"] / \
        totals["colocated", "dense AdamW, FSDP (fp32 weights sharded)"]
    print(f"LoGRA's cut of the colocated total: {cut:.1%}")


if __name__ == "__main__":
    main()
