"""The training-memory plan against a CUDA GPU: peak `torch.cuda.max_memory_allocated` of
real TRL steps in bf16 on a Qwen2.5-0.5B-shaped model with random weights, next to the plan
(posttrain/capacity/memory.py) for the same setup, and their ratio (goal: within 15%).

Each case runs two optimizer steps of TRL's SFTTrainer or GRPOTrainer (transformers
generation) in a process of its own; the peak counts every live CUDA allocation, the
weights included. Without a CUDA GPU it says so and measures nothing (exit 0): the CPU
bench (bench/training_memory.py) is the one that runs everywhere.

    .venv/bin/python bench/training_memory_cuda.py [--cases sft,sft_gc,grpo,grpo_ref,grpo_gc,sft_lora]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time

from training_memory import BATCH, build_trainer, run_cases, saver  # bench/ is on the path: the script's own folder

QWEN05B = {"model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896, "num_hidden_layers": 24,
           "num_attention_heads": 14, "num_key_value_heads": 2, "intermediate_size": 4864,
           "tie_word_embeddings": True, "max_position_embeddings": 4096}
CASES = {  # method, gradient checkpointing, beta, LoRA rank
    "sft": ("sft", False, 0.0, 0), "sft_gc": ("sft", True, 0.0, 0), "sft_lora": ("sft", True, 0.0, 16),
    "grpo": ("grpo", False, 0.0, 0), "grpo_ref": ("grpo", True, 0.04, 0), "grpo_gc": ("grpo", True, 0.0, 0),
    # the memory savers (training_memory.SAVERS): 8-bit AdamW, GaLore, the top half of the layers
    "sft_8bit": ("sft", False, 0.0, 0), "grpo_8bit": ("grpo", False, 0.0, 0),
    "sft_galore": ("sft", False, 0.0, 0), "grpo_galore": ("grpo", False, 0.0, 0),
    "sft_top": ("sft", False, 0.0, 0), "grpo_top": ("grpo", False, 0.0, 0),
}
SEQ, PROMPT = 1024, 64


def one_case(case: str) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from posttrain.capacity.memory import Setup, plan
    from posttrain.training.tiny_model import build_tokenizer

    method, checkpointing, beta, rank = CASES[case]
    torch.manual_seed(0)
    folder, tokenizer = tempfile.mkdtemp(), build_tokenizer()
    config = AutoConfig.for_model(**QWEN05B)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    trl, fields, top = saver(case, QWEN05B["num_hidden_layers"])
    trainer = build_trainer(folder, tokenizer, method=method, checkpointing=checkpointing, beta=beta, rank=rank,
                            seq=SEQ, prompt=PROMPT, top_layers=top, bf16=True, **trl)  # fp32 weights, bf16 autocast
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    trainer.train()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    planned = plan(QWEN05B, Setup(method=method, batch=BATCH, seq=SEQ, completion=None if method == "sft" else
                                  SEQ - PROMPT, gradient_checkpointing=checkpointing, beta=beta, lora_rank=rank,
                                  **fields))
    return {"case": case, "measured_bytes": torch.cuda.max_memory_allocated(), "plan": planned.as_dict(),
            "gpu": f"{torch.cuda.get_device_name()}, {seconds:.1f} s for 2 steps"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("no CUDA GPU on this machine: the bf16 check against torch.cuda.max_memory_allocated was not run "
              "(bench/training_memory.py measures the CPU)")
        return 0
    if args.one:
        print(json.dumps(one_case(args.one)))
        return 0
    run_cases(__file__, [(f"{case:<10}", case) for case in args.cases.split(",")], header=f"{'case':<10}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
