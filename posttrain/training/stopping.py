"""Stop a warmup on a target, not on an epoch count (`sft.stop_when`).

An epoch count that lands a warmup at 40% on one CPU lands it at 10% or 90% on another:
the SFT curve of a small model is steep, and float rounding moves it. A target measured
while training holds on every machine. The target is greedy accuracy on a validation
split carved from the training rows (never the held-out split, which gates and
evaluates); the `trl:` epochs stay the cap.
"""

from __future__ import annotations

import random
import time

from transformers import TrainerCallback

CURVE_KEY = "validation_greedy_accuracy"


def carve_validation(rows: list[dict], size: int, seed: int) -> tuple[list[dict], list[dict]]:
    """(train, validation): `size` rows drawn by `seed` out of the training rows.

    The rest keep their order, so the data SFT sees changes only by what was taken out.
    """
    picked = set(random.Random(seed).sample(range(len(rows)), size))
    return [r for i, r in enumerate(rows) if i not in picked], [r for i, r in enumerate(rows) if i in picked]


def greedy_accuracy(model, tokenizer, env, rows: list[dict], max_new_tokens: int) -> float:
    """Share of `rows` whose greedy completion the environment verifies, from the model as
    it is mid-training. The RNG is forked, so measuring never changes the training run."""
    import torch

    from posttrain.scoring.generation import generate

    was_training, side = model.training, tokenizer.padding_side
    tokenizer.padding_side = "left"  # decoder-only generation continues the prompt's last token
    model.eval()
    devices = [model.device] if model.device.type != "cpu" else []  # the CPU generator is always forked
    try:
        with torch.random.fork_rng(devices=devices, device_type=model.device.type):
            greedy = generate(model, tokenizer, [r["prompt"] for r in rows], n=1, temperature=0.0,
                              max_new_tokens=max_new_tokens, report=False)
    finally:
        model.train(was_training)
        tokenizer.padding_side = side
    return sum(env.verify(g[0], r["answer"]) for g, r in zip(greedy, rows)) / len(rows)


class StopOnTarget(TrainerCallback):
    """Every `every_steps` optimizer steps, measure greedy accuracy on `rows`; once it
    reaches `target`, stop training (`control.should_training_stop`).

    Each measurement goes through `log` (the trainer's own `Trainer.log`), so it lands in
    `state.log_history` (saved with every checkpoint: the curve survives a resume) and in
    every reporting callback (MLflow) at its step. A schedule that ends between two
    measurements is measured at its last step too, so the curve ends where training did.
    `seconds` is the time spent measuring (inside `train()`'s wall time).
    """

    def __init__(self, env, rows: list[dict], *, target: float, every_steps: int, max_new_tokens: int, log):
        self.env, self.rows, self.target, self.every_steps = env, rows, target, every_steps
        self.max_new_tokens, self.log = max_new_tokens, log
        self.seconds = 0.0

    def on_step_end(self, args, state, control, model=None, processing_class=None, **kwargs):
        if state.global_step % self.every_steps:
            return control
        if self.measure(model, processing_class) >= self.target:
            control.should_training_stop = True
        return control

    def on_train_end(self, args, state, control, model=None, processing_class=None, **kwargs):
        curve = validation_curve(state.log_history)
        if not curve or curve[-1]["step"] != state.global_step:
            self.measure(model, processing_class)
        return control

    def measure(self, model, tokenizer) -> float:
        """Greedy accuracy on the validation rows. In a launched job every rank measures
        (a sharded model generates only with all of them) and all take rank 0's figure, so
        all stop at the same step: a rank that stopped alone would leave the others
        waiting in a collective."""
        from posttrain.runtime.launch import from_main

        started = time.perf_counter()
        accuracy = from_main(greedy_accuracy(model, tokenizer, self.env, self.rows, self.max_new_tokens))
        self.seconds += time.perf_counter() - started
        self.log({CURVE_KEY: accuracy})
        return accuracy


def validation_curve(log_history: list[dict]) -> list[dict]:
    """`[{"step": s, "greedy_accuracy": a}, ...]` from a trainer's log history."""
    return [{"step": e["step"], "greedy_accuracy": e[CURVE_KEY]} for e in log_history if CURVE_KEY in e]
