"""The anchor of bench/grpo_throughput.py: GRPO with bare TRL, nothing of posttrain.

One process: TRL's GRPOTrainer on a model folder, the prompts of a JSONL file and a
`GRPOConfig` given as JSON, with the default stage's rewards written as plain functions
(correctness and digit overlap of the parsed number; a completion with no number gets 0
on both, as posttrain's `unparseable` guardrail gives it). No MLflow, no callbacks.
Prints one JSON line: `trainer.train()`'s wall seconds and the steps it took.

    python bench/bare_grpo.py --model DIR --rows ROWS.jsonl --options OPTIONS.json --output-dir DIR
"""

from __future__ import annotations

import argparse
import json
import re
import time

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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--rows", required=True)
    parser.add_argument("--options", required=True)
    parser.add_argument("--output-dir", required=True)
    args = parser.parse_args()

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
