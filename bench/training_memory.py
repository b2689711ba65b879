"""Measured peak memory of real TRL training steps against posttrain's plan (posttrain/capacity/memory.py).

Each case runs two optimizer steps (the second holds the optimizer states throughout) of TRL's SFTTrainer or GRPOTrainer, in fp32 on the CPU,
in a process of its own, on a Llama-shaped model with random weights. The peak is the
model's (and TRL's reference model's) weights plus the highest point of what training
allocated on top of what was in use before it, read from glibc's malloc statistics
(`mallinfo2`: heap and mmap bytes in use, where PyTorch's CPU allocator takes every
tensor), sampled every 0.5 ms. It prints, per case, the
measured peak, the plan's total and their ratio (goal: within 15%).

    .venv/bin/python bench/training_memory.py [--sizes tiny,10m,30m,100m] [--cases sft,sft_gc,...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

SIZES = {  # hidden, layers, heads, kv heads, MLP width, vocab
    "tiny": (128, 4, 4, 2, 512, 32000),
    "10m": (256, 6, 4, 2, 1024, 32000),
    "30m": (512, 8, 8, 4, 1408, 32000),
    "100m": (768, 12, 12, 4, 2048, 32000),
    "wide": (128, 4, 4, 2, 512, 152064),  # Qwen2.5's vocabulary: five of TRL's logit tiles across
}
CASES = {  # method, gradient checkpointing, beta, LoRA rank, tokens per sequence
    "sft": ("sft", False, 0.0, 0, 128), "sft_gc": ("sft", True, 0.0, 0, 128), "sft_lora": ("sft", False, 0.0, 8, 128),
    "grpo": ("grpo", False, 0.0, 0, 128), "grpo_ref": ("grpo", False, 0.04, 0, 128),
    "grpo_gc": ("grpo", True, 0.0, 0, 128),
    "sft_long": ("sft", True, 0.0, 0, 1024),  # 8 x 1,023 scored tokens: two of TRL's logit tiles down
    # the memory savers (issue 30): bitsandbytes' 8-bit AdamW, GaLore rank 32, the top half of the layers
    "sft_8bit": ("sft", False, 0.0, 0, 128), "grpo_8bit": ("grpo", False, 0.0, 0, 128),
    "sft_galore": ("sft", False, 0.0, 0, 128), "grpo_galore": ("grpo", False, 0.0, 0, 128),
    "sft_top": ("sft", False, 0.0, 0, 128), "grpo_top": ("grpo", False, 0.0, 0, 128),
}
GALORE_RANK = 32
SAVERS = {  # case suffix -> (TRL options, memory.Setup fields)
    "8bit": ({"optim": "adamw_bnb_8bit"}, {"optim": "adamw_bnb_8bit"}),
    "galore": ({"optim": "galore_adamw", "optim_args": f"rank={GALORE_RANK}", "optim_target_modules": "all-linear"},
               {"optim": "galore_adamw", "galore_rank": GALORE_RANK, "galore_targets": "all-linear"}),
    "top": ({}, {}),   # trainable_layers: half the model's, set per size
}


def saver(case: str, layers: int) -> tuple[dict, dict, int]:
    """(TRL options, plan fields, top layers trained: 0 for all) of a case's memory saver."""
    name = case.rsplit("_", 1)[-1]
    if name not in SAVERS:
        return {}, {}, 0
    trl, fields = SAVERS[name]
    top = layers // 2 if name == "top" else 0
    return trl, {**fields, **({"trainable_layers": top} if top else {})}, top
BATCH, PROMPT = 8, 32  # GRPO: completions of the sequence length less the prompt


def model_config(size: str) -> dict:
    hidden, layers, heads, kv_heads, intermediate, vocab = SIZES[size]
    return {"model_type": "llama", "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "intermediate_size": intermediate, "vocab_size": vocab,
            "max_position_embeddings": 2048, "tie_word_embeddings": False, "attention_bias": False}


def one_case(size: str, case: str) -> dict:
    """Run the case here; the measured and planned bytes."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from posttrain.capacity.memory import Setup, plan
    from posttrain.training.tiny_model import build_tokenizer

    method, checkpointing, beta, rank, seq = CASES[case]
    torch.manual_seed(0)
    folder = tempfile.mkdtemp()
    tokenizer = build_tokenizer()
    config = model_config(size)
    LlamaForCausalLM(LlamaConfig(**{k: v for k, v in config.items() if k != "model_type"})).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    trl, fields, top = saver(case, config["num_hidden_layers"])
    trainer = build_trainer(folder, tokenizer, method=method, checkpointing=checkpointing, beta=beta, rank=rank,
                            seq=seq, top_layers=top, use_cpu=True, bf16=False, dataloader_num_workers=0, **trl)
    before = in_use()
    with Peak() as peak:
        trainer.train()
    planned = plan(config, Setup(method=method, mixed_precision=False, cpu=True, batch=BATCH, seq=seq,
                                 completion=None if method == "sft" else seq - PROMPT,
                                 gradient_checkpointing=checkpointing, beta=beta, lora_rank=rank, **fields)).as_dict()
    weights = sum(t.numel() * t.element_size() for m in (trainer.model, getattr(trainer, "ref_model", None))
                  if m is not None for t in m.parameters())
    # the model's (and reference's) weights were allocated before; what train() added on top, at its highest
    return {"size": size, "case": case, "measured_bytes": weights + peak.bytes - before, "weights_bytes": weights,
            "step_peak_bytes": peak.bytes - before, "plan": planned}


def build_trainer(folder: str, tokenizer, *, method: str, checkpointing: bool, beta: float, rank: int, seq: int,
                  batch: int = BATCH, prompt: int = PROMPT, top_layers: int = 0, **device):
    """TRL's SFTTrainer or GRPOTrainer for two optimizer steps of `batch` sequences of `seq`
    tokens (GRPO: `batch` completions of `seq - prompt` tokens of one prompt group), a
    LoRA adapter of rank `rank` on every linear when > 0; only the top `top_layers` decoder
    layers and the final norm trained when > 0 (posttrain.training.trainable, as a stage's
    `trainable:` freezes); `device`: TRL options (use_cpu, bf16, optim, ...). The CUDA bench
    (training_memory_cuda.py) builds its steps here too."""
    trainer = _trainer(folder, tokenizer, method=method, checkpointing=checkpointing, beta=beta, rank=rank, seq=seq,
                       batch=batch, prompt=prompt, **device)
    if top_layers:
        from posttrain.config import TrainableSection
        from posttrain.training.trainable import freeze

        freeze(trainer.model, TrainableSection(top_layers=top_layers))
    return trainer


def _trainer(folder: str, tokenizer, *, method: str, checkpointing: bool, beta: float, rank: int, seq: int,
             batch: int, prompt: int, **device):
    import tempfile

    from datasets import Dataset

    common = {"output_dir": tempfile.mkdtemp(), "max_steps": 2, "per_device_train_batch_size": batch,
              "report_to": [], "save_strategy": "no", "logging_steps": 1, "gradient_checkpointing": checkpointing,
              "disable_tqdm": True, **device}
    peft = None
    if rank:
        from peft import LoraConfig

        peft = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear")
    if method == "sft":
        from trl import SFTConfig, SFTTrainer

        rows = [{"text": "12+34=46," * seq} for _ in range(4 * batch)]
        return SFTTrainer(model=folder, processing_class=tokenizer, train_dataset=Dataset.from_list(rows),
                          peft_config=peft, args=SFTConfig(**common, max_length=seq))
    from trl import GRPOConfig, GRPOTrainer

    rows = [{"prompt": "1+2=" * (prompt // 4)} for _ in range(4 * batch)]
    return GRPOTrainer(model=folder, processing_class=tokenizer, train_dataset=Dataset.from_list(rows),
                       reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions], peft_config=peft,
                       args=GRPOConfig(**common, num_generations=batch, max_completion_length=seq - prompt, beta=beta,
                                       generation_kwargs={"min_new_tokens": seq - prompt}))


def in_use() -> int:
    """Bytes glibc's malloc has handed out and not taken back (heap and mmap): where
    PyTorch's CPU allocator gets every tensor."""
    import ctypes

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in
                    ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                     "keepcost")]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


class Peak:
    """The highest `in_use()` while the block runs, sampled every 0.5 ms by a thread."""

    def __enter__(self):
        import threading

        self.bytes, self.done = in_use(), threading.Event()
        self.thread = threading.Thread(target=self.watch, daemon=True)
        self.thread.start()
        return self

    def watch(self):
        while not self.done.wait(0.0005):
            self.bytes = max(self.bytes, in_use())

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()
        self.bytes = max(self.bytes, in_use())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=",".join(SIZES))
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--one", help=argparse.SUPPRESS)  # size:case, run in this process
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_case(*args.one.split(":"))))
        return
    run_cases(__file__, [(f"{size:<6} {case:<10}", f"{size}:{case}") for size in args.sizes.split(",")
                         for case in args.cases.split(",")], header=f"{'size':<6} {'case':<10}")


def run_cases(script: str, cases: list[tuple[str, str]], *, header: str) -> None:
    """Each case (label, `--one` value) in a process of its own running `script`; per case
    the measured peak, the plan's total, their ratio and the plan's parts."""
    print(f"{header} {'measured MiB':>13} {'plan MiB':>10} {'ratio':>6}  plan parts (MiB)")
    for label, one in cases:
        done = subprocess.run([sys.executable, script, "--one", one], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parents[1])
        if done.returncode:
            print(f"{label} failed: {done.stderr.strip().splitlines()[-1][:200]}", flush=True)
            continue
        r = json.loads(done.stdout.strip().splitlines()[-1])
        p, mib = r["plan"], 2**20
        parts = " ".join(f"{k[:-6]}={p[k] / mib:.0f}" for k in ("model_states_bytes", "reference_bytes",
                         "activations_bytes", "logits_bytes", "generation_bytes") if p[k])
        print(f"{label} {r['measured_bytes'] / mib:>13.1f} {p['total_bytes'] / mib:>10.1f} "
              f"{p['total_bytes'] / r['measured_bytes']:>6.2f}  {parts}{'  (' + r['gpu'] + ')' if 'gpu' in r else ''}",
              flush=True)


if __name__ == "__main__":
    main()
