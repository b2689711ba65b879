"""The anchor of bench/grpo_throughput.py: GRPO with bare TRL, nothing of posttrain.

One process: TRL's GRPOTrainer on a model folder, the prompts of a JSONL file and a
`GRPOConfig` given as JSON, with the default stage's rewards written as plain functions
(correctness and digit overlap of the parsed number; a completion with no number gets 0
on both, as posttrain's `unparseable` guardrail gives it). No MLflow, no callbacks but
the step clock (`--clock`). Prints one JSON line: `trainer.train()`'s wall seconds and
the steps it took.

The step clock (`install_clock`) is the bench's one timer on both sides: the throughput
bench installs it in the posttrain stage's process too, which builds its trainer itself.

    python bench/bare_grpo.py --model DIR --rows ROWS.jsonl --options OPTIONS.json --output-dir DIR [--clock FILE]
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

ANSWER = re.compile(r"^\s*(-?\d+)\s*$")


def parse(text: str) -> str | None:
    match = ANSWER.match(text)
    return str(int(match.group(1))) if match else None


def correctness(completions, answer, **_):
    return [float(parse(c) == a) for c, a in zip(completions, answer)]


def digits(completions, answer, **_):
    scores = []
    for c, a in zip(completions, answer):
        p = parse(c)
        scores.append(0.0 if p is None else sum(x == y for x, y in zip(p[::-1], a[::-1])) / max(len(p), len(a)))
    return scores


def step_clock(path: str):
    """A trainer callback that writes to `path`, when training ends, the wall (perf_counter)
    and CPU time (process_time, all threads: with one thread, what other tenants of a
    shared machine take shows in wall time, hardly in it) when training began and each
    step ended, and the tokens trained on so far at each logged step (prompts and
    completions: the work done). A bench times steps W+1..W+N from these, not train() as
    a whole, whose first steps pay one-time costs (the optimizer's state, allocator
    growth, MLflow's start)."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def __init__(self):
            self.begin, self.ends, self.tokens = None, [], {}

        def on_train_begin(self, args, state, control, **kwargs):
            self.begin = (time.perf_counter(), time.process_time())

        def on_step_end(self, args, state, control, **kwargs):
            self.ends.append((time.perf_counter(), time.process_time()))

        def on_log(self, args, state, control, logs=None, **kwargs):
            if "num_tokens" in (logs or {}):
                self.tokens[state.global_step] = logs["num_tokens"]

        def on_train_end(self, args, state, control, **kwargs):
            if state.is_world_process_zero:
                Path(path).write_text(json.dumps({"begin": self.begin, "step_ends": self.ends,
                                                  "num_tokens": self.tokens}))

    return StepClock()


def install_clock(path: str) -> None:
    """Every trainer made from now on carries the step clock, as one of transformers'
    default callbacks: the same for a trainer built here and one built inside posttrain."""
    from transformers import trainer

    trainer.DEFAULT_CALLBACKS.append(step_clock(path))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--rows", required=True)
    parser.add_argument("--options", required=True)
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--clock", help="write the step clock's times here (JSON)")
    args = parser.parse_args()
    if args.clock:
        install_clock(args.clock)

    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    with open(args.options) as f:
        options = json.load(f)
    with open(args.rows) as f:
        rows = [json.loads(line) for line in f]
    config = GRPOConfig(**options, output_dir=args.output_dir, report_to="none")
    trainer = GRPOTrainer(model=args.model, reward_funcs=[correctness, digits], args=config,
                          train_dataset=Dataset.from_list(rows),
                          processing_class=AutoTokenizer.from_pretrained(args.model))
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    print(json.dumps({"train_seconds": seconds, "steps": trainer.state.global_step}), flush=True)


if __name__ == "__main__":
    main()
