"""What the training stages share: resuming, held-out evaluation, the model card."""

from __future__ import annotations

import time
from pathlib import Path

from posttrain.envs.tools import tool_limits
from posttrain.runtime import launch
from posttrain.scoring.evaluation import evaluate_model, outcomes
from posttrain.files import read_jsonl


def last_complete_checkpoint(checkpoint_dir: str) -> str | None:
    """The newest `checkpoint-N` that was written to the end; partial ones are deleted.

    The Trainer writes `trainer_state.json` after the weights and optimizer, so a process
    killed mid-save leaves a folder without it: resuming from that would fail.
    """
    import shutil

    root = Path(checkpoint_dir)
    found = sorted(root.glob("checkpoint-*"), key=lambda p: int(p.name.rsplit("-", 1)[1]), reverse=True) \
        if root.is_dir() else []
    for candidate in found:
        if (candidate / "trainer_state.json").is_file():
            return str(candidate)
        shutil.rmtree(candidate, ignore_errors=True)
    return None


def train(trainer, checkpoint_dir: str) -> tuple[float, int]:
    """`trainer.train()`, resumed from the newest complete checkpoint in `checkpoint_dir`.

    Returns (wall seconds of `train()`, the step it resumed from; 0 for a fresh start).
    """
    last = last_complete_checkpoint(checkpoint_dir)
    resumed = int(last.rsplit("-", 1)[1]) if last else 0
    if last:
        print(f"posttrain: resuming from {last} (step {resumed})", flush=True)
    recorder = launch.observe(trainer)  # a rank of a launched job records what it trains on
    trainer.add_callback(step_progress())
    start = time.perf_counter()
    trainer.train(resume_from_checkpoint=last)
    seconds = time.perf_counter() - start
    launch.report(trainer, recorder, checkpoint_dir)
    return seconds, resumed


def step_progress():
    """A trainer callback that reports the steps done, the latest loss and reward, as the
    training phase's progress lines (posttrain.progress), from the main process only."""
    from transformers import TrainerCallback

    from posttrain import progress

    class StepProgress(TrainerCallback):
        figures: dict = {}

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.figures = {k: logs[k] for k in ("loss", "reward") if isinstance((logs or {}).get(k), (int, float))}

        def on_step_end(self, args, state, control, **kwargs):
            if state.is_world_process_zero:
                progress.update(state.global_step, state.max_steps, **self.figures)

    return StepProgress()


ADAPTER_DIR = "adapter"  # inside a LoRA stage's model folder: the adapter the merged model was made from


def lora_config(where: str, options: dict | None):
    """The stage's `peft:` block as a `peft.LoraConfig` for TRL's `peft_config`; None
    trains every weight."""
    if options is None:
        return None
    from posttrain.training.trl_bridge import build_lora_config

    return build_lora_config(where, options)


def save_model(trainer, out_dir: str, record) -> None:
    """The trained model into `out_dir`. A LoRA stage saves its adapter to
    `<out_dir>/adapter` (also to `record`, the stage's run) and the base model with
    the adapter merged in to `out_dir`: what later stages, evaluation and vLLM load.
    In a launched job every rank calls this (DeepSpeed and FSDP gather the weights
    together); only the main one writes."""
    import sys

    peft = sys.modules.get("peft")  # a LoRA stage imported it; a full one need not
    model = trainer.accelerator.unwrap_model(trainer.model)
    if peft is None or not isinstance(model, peft.PeftModel):
        trainer.save_model(out_dir)
        return
    if not trainer.args.should_save:
        return
    adapter = Path(out_dir) / ADAPTER_DIR
    model.save_pretrained(adapter)
    model.merge_and_unload().save_pretrained(out_dir)
    trainer.processing_class.save_pretrained(out_dir)
    record.artifacts(adapter, ADAPTER_DIR)


def gate_evaluation(model_dir: str, env, config, data_dir: str) -> dict:
    """Held-out greedy accuracy and the gate's pass@k for one model, with their 95%
    intervals, the per-prompt `outcomes` the gate's paired tests read, and the greedy
    completions themselves (`greedy`: the evaluate stage reuses them, posttrain.scoring.evaluation)."""
    gate = config.gate
    rows = read_jsonl(Path(data_dir) / "heldout.jsonl")[:gate.max_prompts]
    result, samples = evaluate_model(model_dir, env, rows, n_samples=gate.n_samples, temperature=gate.temperature,
                                     ks=[gate.k], max_new_tokens=config.evaluate.max_new_tokens, seed=config.seed,
                                     resamples=config.stats.bootstrap_resamples, limits=tool_limits(config),
                                     episodes_backend=gate.episodes_backend, data=config.data)
    return {**result, "outcomes": outcomes(samples, gate.n_samples),
            "greedy": {"max_new_tokens": config.evaluate.max_new_tokens, "completions": [s["completion"] for s in samples]}}


def gate_figures(evaluation: dict, k: int, prefix: str = "") -> dict:
    """A gate evaluation's figures for a stage's metrics: greedy accuracy and pass@k, each
    with its 95% interval (`[low, high]`)."""
    key = str(k)
    return {f"{prefix}greedy_accuracy": evaluation["greedy_accuracy"],
            f"{prefix}greedy_accuracy_ci95": evaluation["greedy_accuracy_ci95"],
            f"{prefix}pass_at_{k}": evaluation["pass_at_k"][key],
            f"{prefix}pass_at_{k}_ci95": evaluation["pass_at_k_ci95"][key]}
