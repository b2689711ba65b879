"""Evaluation sampling on one model, vLLM against transformers `generate`, side by side.

The evaluate stage and the gates sample every held-out prompt greedily and `n` times
(`evaluate.backend`: `auto` picks transformers on a CPU, vLLM with a CUDA GPU). This times the
same job through both backends (`posttrain.scoring.evaluation.sample_models`, the stage's own
call), alternating, and prints each side's wall seconds, engine start included, and the
ratio vLLM / transformers per round.

    .venv/bin/python bench/sampling_backends.py --model models/SmolLM2-135M-Instruct --prompts 100 --n 8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from posttrain.scoring.evaluation import sample_models  # noqa: E402


def prompts(model: str, count: int) -> list[str]:
    """Held-out-style prompts of the arithmetic recipe, rendered with the model's template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    system = "You are a calculator. Reply with the result only."
    return [tokenizer.apply_chat_template([{"role": "system", "content": system},
                                           {"role": "user", "content": f"{a} + {b}"}], tokenize=False,
                                          add_generation_prompt=True)
            for a, b in zip(range(10, 10 + count), range(99, 99 - count, -1))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(REPO / "models" / "SmolLM2-135M-Instruct"))
    parser.add_argument("--prompts", type=int, default=100)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    batch = prompts(args.model, args.prompts)
    seconds = {"vllm": [], "transformers": []}
    for _ in range(args.rounds):
        for backend in seconds:
            start = time.perf_counter()
            sample_models({"model": args.model}, batch, backend=backend, n=args.n, temperature=1.0,
                          max_new_tokens=args.max_new_tokens, seed=0)
            seconds[backend].append(time.perf_counter() - start)
            print(f"{backend}: {seconds[backend][-1]:.1f} s", flush=True)
    ratios = [v / t for v, t in zip(seconds["vllm"], seconds["transformers"])]
    print(f"{args.prompts} prompts x (1 greedy + {args.n} sampled) x {args.max_new_tokens} tokens: "
          f"vllm {statistics.median(seconds['vllm']):.1f} s, transformers {statistics.median(seconds['transformers']):.1f} s "
          f"(medians), ratio vllm/transformers {statistics.median(ratios):.2f} [{min(ratios):.2f}, {max(ratios):.2f}]")


if __name__ == "__main__":
    main()
