"""Held-out evaluation of one model: greedy accuracy and pass@k."""

from __future__ import annotations

from posttrain.generation import generate, load_policy
from posttrain.metrics import mean_pass_at_k


def evaluate_model(model_dir: str, env, rows: list[dict], *, n_samples: int, temperature: float,
                   ks: list[int], max_new_tokens: int, seed: int) -> tuple[dict, list[dict]]:
    """Greedy accuracy and pass@k on `rows`, plus one sample row per prompt.

    Returns `({"greedy_accuracy": a, "pass_at_k": {k: p}}, samples)` where each sample
    has the prompt, the greedy completion, the answer and the verifier's verdict.
    """
    model, tokenizer = load_policy(model_dir)
    prompts = [r["prompt"] for r in rows]
    greedy = generate(model, tokenizer, prompts, n=1, temperature=0.0,
                      max_new_tokens=max_new_tokens, seed=seed)
    verdicts = [env.verify(outs[0], r["answer"]) for outs, r in zip(greedy, rows)]
    sampled = generate(model, tokenizer, prompts, n=n_samples, temperature=temperature,
                       max_new_tokens=max_new_tokens, seed=seed)
    correct = [sum(env.verify(c, r["answer"]) for c in outs) for outs, r in zip(sampled, rows)]
    result = {"greedy_accuracy": sum(verdicts) / len(rows),
              "pass_at_k": {str(k): mean_pass_at_k(correct, n_samples, k) for k in ks}}
    samples = [{"prompt": r["prompt"], "completion": outs[0], "answer": r["answer"], "correct": ok,
                "sampled_correct": c} for outs, r, ok, c in zip(greedy, rows, verdicts, correct)]
    return result, samples


def pass_rates(model_dir: str, env, rows: list[dict], *, samples: int, temperature: float,
               max_new_tokens: int, seed: int) -> list[float]:
    """Each prompt's estimated pass rate: the share of `samples` sampled completions correct."""
    model, tokenizer = load_policy(model_dir)
    sampled = generate(model, tokenizer, [r["prompt"] for r in rows], n=samples, temperature=temperature,
                       max_new_tokens=max_new_tokens, seed=seed)
    return [sum(env.verify(c, r["answer"]) for c in outs) / samples for outs, r in zip(sampled, rows)]
