"""Held-out evaluation: greedy accuracy, pass@k, and a per-prompt samples table.

Completions come from vLLM (one engine process for all models) or from transformers
`generate`; both feed the same scorer, so the metrics agree within sampling noise.
"""

from __future__ import annotations

import importlib.util

from posttrain.scoring import stats
from posttrain.chat import reward_columns
from posttrain.envs.tools import ToolLimits, is_tool_env
from posttrain.scoring.episodes import episode_figures, from_record, sample_episodes
from posttrain.scoring.generation import generate, load_policy
from posttrain.scoring.metrics import mean_pass_at_k


def resolve_backend(backend: str) -> str:
    """`auto` -> `vllm` when vLLM is installed and a CUDA GPU is present, else `transformers`.

    On CPUs vLLM is not the fast path: its engine start (~40 s on 2 cores) and CPU kernels
    cost more than `generate` on small models (README, "Measured"); ask for it by name there.
    """
    if backend != "auto":
        return backend
    import torch

    return "vllm" if importlib.util.find_spec("vllm") is not None and torch.cuda.is_available() else "transformers"


def sample_models(models: dict[str, str], prompts: list[str], *, backend: str, n: int, temperature: float,
                  max_new_tokens: int, seed: int, greedy_known: dict[str, list[str]] | None = None,
                  ) -> dict[str, tuple[list[str], list[list[str]]]]:
    """Each model's greedy completion and `n` sampled completions per prompt.

    greedy_known: model name -> its greedy completions of `prompts`, already decoded with
    `generate` and these settings (a gate's, `known_greedy`); the transformers backend
    does not decode them again.
    """
    if resolve_backend(backend) == "vllm":
        return _sample_vllm(models, prompts, n=n, temperature=temperature, max_new_tokens=max_new_tokens, seed=seed)
    out = {}
    for name, model_dir in models.items():
        model, tokenizer = load_policy(model_dir)
        greedy = [[g] for g in (greedy_known or {}).get(name, [])] or \
            generate(model, tokenizer, prompts, n=1, temperature=0.0, max_new_tokens=max_new_tokens, seed=seed)
        sampled = generate(model, tokenizer, prompts, n=n, temperature=temperature, max_new_tokens=max_new_tokens,
                           seed=seed)
        out[name] = ([g[0] for g in greedy], sampled)
    return out


def _sample_vllm(models, prompts, *, n, temperature, max_new_tokens, seed):
    """`posttrain.vllm_engine.sample` in its own process (vLLM must start under `__main__`)."""
    from posttrain.vllm_engine.sample import run_job

    longest = max(len(p) for p in prompts)  # an upper bound in tokens for any tokenizer
    result = run_job({"models": models, "prompts": prompts, "n": n, "temperature": temperature,
                      "max_tokens": max_new_tokens, "seed": seed, "max_model_len": longest + max_new_tokens + 8})
    return {name: (r["greedy"], r["sampled"]) for name, r in result.items()}


def sample_tool_models(models: dict[str, str], env, rows: list[dict], *, backend: str, data, n: int,
                       temperature: float, max_tokens: int, seed: int, limits=None):
    """`sample_episodes` on the backend asked for: on vLLM, a sampling process builds the
    environment again from `data` (the config's section) and runs the same episode loop."""
    if resolve_backend(backend) == "vllm":
        return _episodes_vllm(models, rows, n=n, temperature=temperature, max_tokens=max_tokens, seed=seed,
                              limits=limits or ToolLimits(), data=data)
    return sample_episodes(models, env, rows, n=n, temperature=temperature, max_tokens=max_tokens, seed=seed,
                           limits=limits)


def _episodes_vllm(models, rows, *, n, temperature, max_tokens, seed, limits, data):
    """A tool environment's episodes in a vLLM sampling process (posttrain.vllm_engine.sample)."""
    from posttrain.vllm_engine.sample import run_job

    if data is None:
        raise ValueError("vLLM episodes need the config's data section to build the environment again")
    result = run_job({"kind": "episodes", "models": models, "rows": rows, "n": n, "temperature": temperature,
                               "max_tokens": max_tokens, "seed": seed, "data": data.model_dump(),
                               "limits": {"seconds": limits.seconds, "max_chars": limits.max_chars}})
    completions, greedy_episodes = {}, {}
    for name, out in result.items():
        greedy = [from_record(r) for r in out["greedy"]]
        sampled = [[from_record(r) for r in group] for group in out["sampled"]]
        completions[name] = ([e.final for e in greedy], [[e.final for e in group] for group in sampled])
        greedy_episodes[name] = greedy
    return completions, greedy_episodes


def score(env, rows: list[dict], greedy: list[str], sampled: list[list[str]], *, ks: list[int], resamples: int,
          seed: int, channels: dict | None = None, environments: list | None = None) -> tuple[dict, list[dict]]:
    """`(result, samples)` from a model's completions.

    result: `greedy_accuracy`, `pass_at_k` (k -> value), `n_prompts`, and their 95%
    intervals `greedy_accuracy_ci95` and `pass_at_k_ci95` (`posttrain.scoring.stats.intervals`).
    samples: one row per prompt with the prompt, the greedy completion, the answer, every
    reward channel in `channels` (name -> reward function) on that completion, the
    verifier's verdict, and how many of the sampled completions were correct.
    """
    n = len(sampled[0]) if sampled else 0
    verdicts = [env.verify(g, r["answer"]) for g, r in zip(greedy, rows)]
    correct = [sum(env.verify(c, r["answer"]) for c in outs) for outs, r in zip(sampled, rows)]
    columns = {key: [r.get(key) for r in rows] for key in reward_columns(rows[0])} if rows else {}
    if environments is not None:  # a tool environment's greedy episodes: the channels that read them
        columns["environments"] = environments
    rewards = {name: fn(greedy, **columns) for name, fn in (channels or {}).items()}
    samples = [{"prompt": r["prompt"], "completion": g, "answer": r["answer"],
                **{f"reward.{name}": values[i] for name, values in rewards.items()},
                "correct": ok, "sampled_correct": c}
               for i, (g, r, ok, c) in enumerate(zip(greedy, rows, verdicts, correct))]
    format_ok = getattr(env, "format_ok", None) or (lambda c: env.parse(c) is not None)
    result = {"greedy_accuracy": sum(verdicts) / len(rows),
              # replies in the task's strict format (a lenient verifier may still read the others)
              "format_rate": sum(map(bool, map(format_ok, greedy))) / len(rows),
              "pass_at_k": {str(k): mean_pass_at_k(correct, n, k) for k in ks},
              **stats.intervals(outcomes(samples, n), ks, resamples=resamples, seed=seed)}
    return result, samples


def known_greedy(evaluations: dict[str, dict | None], prompts: list[str], max_new_tokens: int) -> dict[str, list[str]]:
    """Model name -> its greedy completions of `prompts`, from the gate evaluations the
    training stages stored in their model cards (`posttrain.training.trainer.gate_evaluation`),
    for each model whose evaluation decoded every prompt with the same `max_new_tokens`."""
    known = {}
    for name, evaluation in evaluations.items():
        greedy = (evaluation or {}).get("greedy")
        if not greedy or greedy["max_new_tokens"] != max_new_tokens:
            continue
        by_prompt = dict(zip(evaluation["outcomes"]["prompts"], greedy["completions"]))
        if all(p in by_prompt for p in prompts):
            known[name] = [by_prompt[p] for p in prompts]
    return known


def outcomes(samples: list[dict], n: int) -> dict:
    """The per-prompt record paired tests read (`posttrain.scoring.stats`): prompts, greedy
    verdicts (0/1), correct samples per prompt, and samples per prompt."""
    return {"prompts": [s["prompt"] for s in samples], "greedy": [int(s["correct"]) for s in samples],
            "correct": [int(s["sampled_correct"]) for s in samples], "n": n}


def evaluate_model(model_dir: str, env, rows: list[dict], *, n_samples: int, temperature: float,
                   ks: list[int], max_new_tokens: int, seed: int, resamples: int, backend: str = "transformers",
                   channels: dict | None = None, limits=None, episodes_backend: str = "transformers",
                   data=None) -> tuple[dict, list[dict]]:
    """One model's held-out evaluation (see `score`); of a tool environment's episodes
    (on `episodes_backend`; vLLM rebuilds the environment from `data`), with what they
    cost (`episodes`: posttrain.scoring.episodes.episode_figures)."""
    if is_tool_env(env):
        completions, episodes = sample_tool_models({"model": model_dir}, env, rows, backend=episodes_backend,
                                                   data=data, n=n_samples, temperature=temperature,
                                                   max_tokens=max_new_tokens, seed=seed, limits=limits)
        (greedy, sampled), = completions.values()
        result, samples = score(env, rows, greedy, sampled, ks=ks, channels=channels, resamples=resamples, seed=seed)
        return {**result, "episodes": episode_figures(episodes["model"])}, samples
    (greedy, sampled), = sample_models({"model": model_dir}, [r["prompt"] for r in rows], backend=backend,
                                       n=n_samples, temperature=temperature, max_new_tokens=max_new_tokens,
                                       seed=seed).values()
    return score(env, rows, greedy, sampled, ks=ks, channels=channels, resamples=resamples, seed=seed)


def pass_rates(model_dir: str, env, rows: list[dict], *, samples: int, temperature: float,
               max_new_tokens: int, seed: int, limits=None, episodes_backend: str = "transformers",
               data=None) -> tuple[list[float], list[list[str]]]:
    """Each prompt's estimated pass rate: the share of `samples` sampled completions (a
    tool environment's: episodes, on `episodes_backend`) correct; and the completions."""
    if is_tool_env(env):
        completions, _ = sample_tool_models({"model": model_dir}, env, rows, backend=episodes_backend, data=data,
                                            n=samples, temperature=temperature, max_tokens=max_new_tokens, seed=seed,
                                            limits=limits)
        (_, sampled), = completions.values()
    else:
        model, tokenizer = load_policy(model_dir)
        sampled = generate(model, tokenizer, [r["prompt"] for r in rows], n=samples, temperature=temperature,
                           max_new_tokens=max_new_tokens, seed=seed)
    return [sum(env.verify(c, r["answer"]) for c in outs) / samples for outs, r in zip(sampled, rows)], sampled


def check_format_contract(env, rows: list[dict], *, where: str, threshold: float = 0.99) -> float:
    """Every SFT target must parse and verify: SFT teaches the format the reward reads.

    Returns the share of targets that verify; raises `UserError` (before any training)
    when it is below `threshold`, showing one failing target and what the parser made of it,
    and at the first target a time limit cut (`within_limits`): the check ends there.
    """
    from posttrain.errors import UserError

    failing = [r for i, r in enumerate(rows) if not within_limits(env, r, f"{where} row {i + 1}")]
    share = 1 - len(failing) / max(1, len(rows))
    if share < threshold:
        examples = "; ".join(f"target {r['completion'][:60]!r} parses as {str(env.parse(r['completion']))[:40]!r}, "
                             f"expected {r['answer'][:40]!r}" for r in failing[:2])
        raise UserError(where, f"format contract: {len(failing)} of {len(rows)} SFT targets fail the {env.name} "
                        f"environment's verifier (only {share:.1%} verify, need {threshold:.0%}); e.g. {examples}",
                        "make the SFT completions use the answer format the parser reads "
                        "(or fix the environment's parser)")
    return share


def within_limits(env, row: dict, where: str) -> bool:
    """Whether the row's SFT target verifies; `UserError` when a time limit cut it: a user
    pattern over its limit on the target (the environment's `check_target`), or the verifier
    (math-verify) over its own. Such a target would be judged by the clock, not the rule."""
    from posttrain.errors import OptionError, UserError

    check_target = getattr(env, "check_target", None)
    try:
        if check_target is not None:
            check_target(row["completion"], row["answer"], where)
    except OptionError as err:
        raise UserError(f"data.options.{err.option}", err.problem, err.fix) from None
    before = timeouts_total(env)
    verified = env.verify(row["completion"], row["answer"])
    if timeouts_total(env) > before:
        raise UserError(where, f"verifying the SFT target {row['completion'][:60]!r} ran past the {env.name} "
                        "environment's time limit", "shorten or simplify that target (a huge or deeply nested "
                        "expression), or drop the row")
    return verified


def timeout_counts(env) -> dict[str, int]:
    """The matches the environment cut at a time limit, by kind (`pattern_timeouts`,
    `math_timeouts`: the dataset environment's `timeout_counts`), {} for one that keeps none."""
    counts = getattr(env, "timeout_counts", None)
    return counts() if counts else {}


def timeouts_total(env) -> int:
    return sum(timeout_counts(env).values())


def add_timeout_counts(metrics: dict, env) -> dict:
    """`metrics` with the environment's counts of matches cut at a time limit added
    (`pattern_timeouts`, `math_timeouts`): a stage sums its processes' environments."""
    for name, count in timeout_counts(env).items():
        metrics[name] = metrics.get(name, 0.0) + float(count)
    return metrics


def report_timeouts(stage: str, metrics: dict, recorder) -> None:
    """A warning line in the stage's log and a tag in its run (`recorder`) when a time limit cut any match."""
    patterns, maths = int(metrics.get("pattern_timeouts", 0)), int(metrics.get("math_timeouts", 0))
    if not patterns and not maths:
        return
    warning = (f"{patterns} pattern match(es) and {maths} math-verify call(s) ran past their time limits and scored "
               "the completion unparseable (pattern_timeouts, math_timeouts); simplify data.options.answer_pattern / "
               "format_pattern (no nested repeats such as (a+)+) if the patterns are the cause")
    print(f"posttrain: WARNING: {stage}: {warning}", flush=True)
    recorder.tag("posttrain.warning.timeouts", warning)
