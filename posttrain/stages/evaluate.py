"""Stage `evaluate`: base, SFT and every GRPO stage's model on the held-out split.

`metrics/evaluate.json` holds, per model, `greedy_accuracy` and `pass_at_k` (k -> value):
`base`, `sft`, `grpo.<stage>` for each GRPO stage, and `grpo` for the final model.
"""

from __future__ import annotations

from pathlib import Path

import mlflow

from posttrain.envs import get_env
from posttrain.evaluation import evaluate_model
from posttrain.io import flatten, model_dirs, read_jsonl, write_json
from posttrain.tracking import stage_run


def main(config, *, data_dir: str, models_dir: str, metrics_path: str,
         accuracy_plot: str, pass_at_k_plot: str) -> dict:
    settings = config.evaluate
    with stage_run(config, "evaluate"):
        env = get_env(config.data.env, **config.data.options)
        rows = read_jsonl(Path(data_dir) / "heldout.jsonl")[:settings.max_prompts]
        report = {}
        for name, model_dir in model_dirs(config, models_dir).items():
            report[name], samples = evaluate_model(model_dir, env, rows, n_samples=settings.n_samples,
                                                   temperature=settings.temperature, ks=settings.k,
                                                   max_new_tokens=settings.max_new_tokens, seed=config.seed)
            mlflow.log_table({key: [s[key] for s in samples] for key in samples[0]},
                             artifact_file=f"samples/{name}.json")
        report["grpo"] = report[f"grpo.{list(config.grpo)[-1]}"]
        mlflow.log_params({"heldout_prompts": len(rows), "n_samples": config.evaluate.n_samples,
                           "temperature": config.evaluate.temperature})
        mlflow.log_metrics(flatten(report))
        write_json(metrics_path, report)
        write_json(accuracy_plot, [{"model": m, "greedy_accuracy": r["greedy_accuracy"]} for m, r in report.items()])
        write_json(pass_at_k_plot, [{"model": m, "k": int(k), "pass_at_k": v}
                                    for m, r in report.items() for k, v in r["pass_at_k"].items()])
    return report
