"""Stage `evaluate`: base, SFT (unless `sft: off`) and every GRPO stage's model on the held-out split.

`metrics/evaluate.json` holds, per model, `greedy_accuracy` and `pass_at_k` (k -> value),
`n_prompts`, and the 95% intervals `greedy_accuracy_ci95` (Wilson) and `pass_at_k_ci95`
(k -> bootstrap over prompts): `base`, `sft`, `grpo.<stage>` for each GRPO stage, and
`grpo` for the final model; with the dataset environment also `pattern_timeouts` and
`math_timeouts` (that model's matches a time limit cut, scored unparseable). The per-prompt
outcomes behind them (`outcomes_path`) are what paired tests against another run read (promotion, `posttrain compare`). Each model
also gets a samples table in MLflow (prompt, completion, every reward channel, verdict),
and one pass@k-versus-k plot has a line per model (PNG and DVC plot data).
"""

from __future__ import annotations

from pathlib import Path


from posttrain import stageid
from posttrain.envs import config_env
from posttrain.envs.tools import is_tool_env, tool_limits
from posttrain.scoring.episodes import episode_figures, episode_table
from posttrain.scoring.evaluation import (known_greedy, outcomes, report_timeouts, resolve_backend, sample_models,
                                          sample_tool_models, score, timeout_counts)
from posttrain.files import read_jsonl, write_json
from posttrain.layout import model_dirs, read_card
from posttrain.tracking.lineage import log_datasets
from posttrain.scoring.rewards import curve_name, reward_channel
from posttrain.tracking.mlflow_runs import compute, stage_run
from posttrain.tracking.recorder import Recorder


def main(config, *, data_dir: str, models_dir: str, metrics_path: str, outcomes_path: str,
         accuracy_plot: str, pass_at_k_plot: str, pass_at_k_png: str) -> dict:
    settings = config.evaluate
    with stage_run(config, "evaluate") as recorder:
        log_datasets({f"{data_dir}/heldout.jsonl": "evaluation"})
        env = config_env(config.data)
        rows = read_jsonl(Path(data_dir) / "heldout.jsonl")[:settings.max_prompts]
        backend = resolve_backend(settings.backend)
        models, prompts = model_dirs(config, models_dir), [r["prompt"] for r in rows]
        reused = known_greedy(gate_evaluations(models), prompts, settings.max_new_tokens)
        episodes = {}
        with compute("sampling"):
            if is_tool_env(env):  # whole episodes, run by posttrain (posttrain.scoring.episodes) on either backend
                reused = {}
                completions, episodes = sample_tool_models(models, env, rows, backend=backend, data=config.data,
                                                           n=settings.n_samples, temperature=settings.temperature,
                                                           max_tokens=settings.max_new_tokens, seed=config.seed,
                                                           limits=tool_limits(config))
            else:
                completions = sample_models(models, prompts, backend=backend, n=settings.n_samples,
                                            temperature=settings.temperature, max_new_tokens=settings.max_new_tokens,
                                            seed=config.seed, greedy_known=reused)
        channels = {curve_name(name): reward_channel(name).make(env) for name in reward_channels(config)}
        report, per_prompt = {}, {}
        for name, (greedy, sampled) in completions.items():
            before = timeout_counts(env)
            report[name], samples = score(env, rows, greedy, sampled, ks=settings.k, channels=channels,
                                          resamples=config.stats.bootstrap_resamples, seed=config.seed,
                                          environments=[e.instance for e in episodes[name]] if name in episodes
                                          else None)
            # this model's completions whose matches a time limit cut (dataset env: patterns, math-verify)
            report[name].update({k: float(v - before[k]) for k, v in timeout_counts(env).items()})
            per_prompt[name] = outcomes(samples, settings.n_samples)
            recorder.table({key: [s[key] for s in samples] for key in samples[0]}, f"samples/{name}.json")
            if name in episodes:  # turns, tool calls and errors; the greedy episodes as the model saw them
                report[name]["episodes"] = episode_figures(episodes[name])
                recorder.table(episode_table(episodes[name], rows, [s["correct"] for s in samples]),
                               f"episodes/{name}.json")
        if settings.harness.lm_eval:
            with compute("lm-eval"):
                lm_eval_figures(config, models, rows, report, per_prompt, Path(outcomes_path).parent / "harness",
                                recorder)
        curves = dict(report)
        final = stageid.final(config).field  # "grpo": the pipeline's result
        report["grpo"], per_prompt["grpo"] = report[final], per_prompt[final]
        write_json(outcomes_path, per_prompt)
        recorder.params({"heldout_prompts": len(rows), "n_samples": settings.n_samples,
                         "temperature": settings.temperature, "sampling_backend": backend,
                         "greedy_from_gates": ",".join(reused) if backend == "transformers" else ""})
        recorder.metrics(report)
        report_timeouts("stage evaluate", timeout_counts(env), recorder)
        write_json(metrics_path, report)
        write_json(accuracy_plot, [{"model": m, "greedy_accuracy": r["greedy_accuracy"]} for m, r in report.items()])
        write_json(pass_at_k_plot, [{"model": m, "k": int(k), "pass_at_k": v}
                                    for m, r in curves.items() for k, v in r["pass_at_k"].items()])
        plot_pass_at_k(curves, pass_at_k_png, settings.temperature, settings.n_samples, recorder)
    return report


def lm_eval_figures(config, models: dict[str, str], rows: list[dict], report: dict, per_prompt: dict,
                    folder: Path, recorder: Recorder) -> None:
    """lm-evaluation-harness on every model (posttrain.scoring.harness): posttrain_heldout and the
    user's task folders; each model's figures into `report[model]["harness"]`, the task folder and
    the figures into the stage's run. HarnessMismatch when a model's two greedy accuracies differ by more
    than a prompt."""
    from posttrain import preflight
    from posttrain.errors import HarnessMismatch
    from posttrain.plugins import resolve
    from posttrain.scoring import harness

    settings = config.evaluate.harness
    task_dir = harness.write_task(folder, rows, config.data.model_dump(mode="json", by_alias=True),
                                  config.evaluate.max_new_tokens)
    user_dirs = [resolve(t) for t in settings.tasks]
    tasks = list(dict.fromkeys([harness.TASK, *(n for d in user_dirs for n in preflight.task_names(d) or [])]))
    recorder.artifacts(task_dir, "harness/task")
    wrong = []
    for name, model_dir in models.items():
        figures, verdicts, seconds = harness.run(model_dir, [task_dir, *user_dirs], tasks,
                                                 batch_size=settings.batch_size, seed=config.seed,
                                                 add_bos=harness.adds_bos(model_dir, rows[0]["prompt"]))
        report[name]["harness"] = {**figures, "seconds": seconds}
        recorder.dict(figures, f"harness/{name}.json")
        ours = per_prompt[name]["greedy"]
        print(f"evaluate: lm-eval {name}: exact_match {figures[harness.TASK]['exact_match']:.3f} (posttrain's "
              f"greedy accuracy {sum(ours) / len(ours):.3f}), {seconds:.0f} s", flush=True)
        problem = harness.check_agreement(name, [bool(v) for v in ours], verdicts)
        if problem:
            wrong.append(problem)
    if wrong:
        raise HarnessMismatch(f"lm-eval and posttrain disagree: {'; '.join(wrong)} (the task lm-eval ran: {folder})")


def gate_evaluations(models: dict[str, str]) -> dict[str, dict | None]:
    """Each model's held-out evaluation by the training stages' gates, from the model cards:
    the base and SFT models' in the SFT card (the base model's in the first GRPO stage's
    with `sft: off`), each GRPO stage's output's in its own (a rejected stage's card carries
    the evaluation of the model it passed on)."""
    cards = {name: read_card(path) for name, path in models.items() if name != "base"}
    first = next(iter(cards.values()), {})
    return {"base": first.get("base"), **{name: card.get("eval") for name, card in cards.items()}}


def reward_channels(config) -> list[str]:
    """Every channel a GRPO stage trains on, correctness first, each once."""
    names = ["correctness"] + [name for stage in config.grpo.values() for name in stage.rewards]
    return list(dict.fromkeys(names))


def plot_pass_at_k(curves: dict, path: str, temperature: float, n: int, recorder: Recorder) -> None:
    """pass@k against k (log scale), one line per model; a PNG file and a figure in the run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for model, result in curves.items():
        ks = sorted(int(k) for k in result["pass_at_k"])
        ax.plot(ks, [result["pass_at_k"][str(k)] for k in ks], marker="o", label=model)
    ax.set(xscale="log", xlabel="k", ylabel="pass@k", ylim=(0, 1.02),
           title=f"Held-out pass@k (n={n}, temperature {temperature})")
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.grid(alpha=0.3)
    ax.legend()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    recorder.figure(fig, "pass_at_k.png")
    plt.close(fig)
