"""Orchestration overhead of the last `retrain` flow run in this workspace.

Prints the pipeline's wall time (MLflow parent run) against the summed `train()`
seconds of its SFT and GRPO stages, and each stage's wall time (child runs), so the
cost of process starts, DVC, MLflow and Prefect is visible.

    make run && make bench          # or: .venv/bin/python bench/orchestration_overhead.py [WORKDIR]
"""

from __future__ import annotations

import sys
from pathlib import Path

import mlflow

from posttrain.config import load_config
from posttrain.tracking import tracking_uri


def main(workdir: str = ".") -> None:
    config = load_config(Path(workdir) / "configs" / "pipeline.yaml", check_trl=False)
    mlflow.set_tracking_uri(tracking_uri(config, workdir))
    runs = mlflow.search_runs(experiment_names=[config.tracking.experiment], order_by=["start_time DESC"],
                              filter_string="tags.`posttrain.flow` = 'retrain' and attributes.status = 'FINISHED'")
    if runs.empty:
        sys.exit("no finished retrain run in this workspace: run `make run` first")
    parent = runs.iloc[0]
    children = mlflow.search_runs(experiment_names=[config.tracking.experiment], order_by=["start_time ASC"],
                                  filter_string=f"tags.`mlflow.parentRunId` = '{parent.run_id}'")
    wall = (parent.end_time - parent.start_time).total_seconds()
    train = sum(v for k, v in parent.items() if k.startswith("metrics.") and k.endswith("train_seconds"))
    print(f"retrain run {parent.run_id}")
    stages = 0.0
    for _, child in children.iterrows():
        seconds = (child.end_time - child.start_time).total_seconds()
        stages += seconds
        cached = " (cached)" if child.get("tags.posttrain.cached") == "true" else ""
        print(f"  {child['tags.mlflow.runName']:<12} {seconds:7.1f} s{cached}")
    print(f"pipeline wall time        {wall:7.1f} s")
    print(f"SFT + GRPO train() time   {train:7.1f} s")
    print(f"overhead                  {wall - train:7.1f} s ({(wall - train) / wall:.0%} of wall time), of which")
    print(f"  between stages          {wall - stages:7.1f} s (Prefect, DVC, MLflow outside the stage runs)")
    print(f"  inside stages           {stages - train:7.1f} s (process start, evaluation, pass-rate filter, vLLM)")


if __name__ == "__main__":
    main(*sys.argv[1:])
