"""The anchor of bench/grpo_throughput.py: GRPO with bare TRL, nothing of posttrain.

One process: TRL's GRPOTrainer on a model folder, the prompts of a JSONL file and a
`GRPOConfig` given as JSON, with the default stage's rewards written as plain functions
(correctness and digit overlap of the parsed number; a completion with no number gets 0
on both, as posttrain's `unparseable` guardrail gives it). No MLflow, no callbacks but
the step clock (`--clock`). `--spec` names the channels, the reader (`last_number`: the
reply's last integer, for a chat model's sentences) and the parameters to train, for a
recipe other than the default (`grpo_throughput.py --config`). Prints one JSON line:
`trainer.train()`'s wall seconds and the steps it took.

The step clock (`install_clock`) is the bench's one timer on both sides: the throughput
bench installs it in the posttrain stage's process too, which builds its trainer itself.

    python bench/bare_grpo.py --model DIR --rows ROWS.jsonl --options OPTIONS.json --output-dir DIR [--clock FILE]
                              [--spec SPEC.json]
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

ANSWER = re.compile(r"^\s*(-?\d+)\s*$")
NUMBER = re.compile(r"-?\d+")
READER = {"lenient": False}  # --spec's `reader: last_number`: the reply's last integer (a chat model's sentences)


def text(completion) -> str:
    """A completion's text: a string, or a conversational completion's last message."""
    return completion if isinstance(completion, str) else completion[-1]["content"]


def parse(completion) -> str | None:
    if READER["lenient"]:
        found = NUMBER.findall(text(completion))
        return str(int(found[-1])) if found else None
    match = ANSWER.match(text(completion))
    return str(int(match.group(1))) if match else None


def correctness(completions, answer, **_):
    return [float(parse(c) == a) for c, a in zip(completions, answer)]


def digits(completions, answer, **_):
    scores = []
    for c, a in zip(completions, answer):
        p = parse(c)
        scores.append(0.0 if p is None else sum(x == y for x, y in zip(p[::-1], a[::-1])) / max(len(p), len(a)))
    return scores


CHANNELS = {"correctness": correctness, "digits": digits}


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
                                                  "num_tokens": self.tokens, "parts": PARTS}))

    return StepClock()


PARTS: dict[str, dict[str, float]] = {}  # step -> TRL's profiled block -> seconds (its ProfilingContext)


def clock_parts() -> None:
    """Record the seconds of every block TRL profiles (`transformers.generate`, each reward
    function, ...) by the step it ran in, whatever `report_to` says: the step's split into
    generation and the rest, the same on both sides."""
    from trl.extras.profiling import ProfilingContext

    logged = ProfilingContext._log_metrics

    def log_metrics(self, duration: float) -> None:
        step = PARTS.setdefault(str(self.step), {})
        step[self.name] = step.get(self.name, 0.0) + duration
        logged(self, duration)

    ProfilingContext._log_metrics = log_metrics


def install_clock(path: str) -> None:
    """Every trainer made from now on carries the step clock, as one of transformers'
    default callbacks: the same for a trainer built here and one built inside posttrain."""
    from transformers import trainer

    trainer.DEFAULT_CALLBACKS.append(step_clock(path))
    clock_parts()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--rows", required=True)
    parser.add_argument("--options", required=True)
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--clock", help="write the step clock's times here (JSON)")
    parser.add_argument("--spec", help="JSON: the reward channels (in order), the reader (exact or last_number) "
                        "and the names of the parameters to train (default: correctness + digits, exact, all)")
    args = parser.parse_args()
    if args.clock:
        install_clock(args.clock)
    spec = json.loads(Path(args.spec).read_text()) if args.spec else {}
    READER["lenient"] = spec.get("reader") == "last_number"

    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    with open(args.options) as f:
        options = json.load(f)
    with open(args.rows) as f:
        rows = [json.loads(line) for line in f]
    config = GRPOConfig(**options, output_dir=args.output_dir, report_to="none")
    trainer = GRPOTrainer(model=args.model, args=config, train_dataset=Dataset.from_list(rows),
                          reward_funcs=[CHANNELS[c] for c in spec.get("channels", ["correctness", "digits"])],
                          processing_class=AutoTokenizer.from_pretrained(args.model))
    if spec.get("trainable"):  # the rest frozen before train() builds the optimizer
        keep = set(spec["trainable"])
        for name, param in trainer.model.named_parameters():
            param.requires_grad_(name in keep)
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    print(json.dumps({"train_seconds": seconds, "steps": trainer.state.global_step}), flush=True)


if __name__ == "__main__":
    main()
