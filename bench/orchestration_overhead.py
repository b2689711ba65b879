"""Orchestration overhead of the last `retrain` flow run in this workspace.

Splits the run's wall time, from the start of the process that ran it (`posttrain run`,
or a Prefect worker's flow-run process) to the end of its MLflow parent run, into

- each stage's own compute, as the stage timed it (`compute.<part>_seconds` on its child
  run, posttrain.tracking.mlflow_runs.compute): training, the pass-rate filter's sampling, the
  gates' evaluations, the evaluation's sampling, the vLLM start, check and load test;
- everything else: before the parent run (process start, imports, Prefect's server, the
  lock, data versioning), inside each stage but outside its compute (the stage
  process's start and imports, DVC, MLflow), and between stages (Prefect tasks, DVC's
  status, MLflow records, the memory plan, promotion).

The goal is everything else <= 10% of the wall time.

    make run && make bench          # or: .venv/bin/python bench/orchestration_overhead.py [WORKDIR]
"""

from __future__ import annotations

import sys
from pathlib import Path

import mlflow

from posttrain.config import load_config
from posttrain.tracking.dead_runs import STARTED_TAG
from posttrain.tracking.mlflow_runs import COMPUTE_PREFIX, tracking_uri

GOAL = 0.10


def compute_parts(run) -> dict[str, float]:
    """A child run's `compute.<part>_seconds` metrics, by part."""
    head, tail = f"metrics.{COMPUTE_PREFIX}", "_seconds"
    return {k[len(head):-len(tail)]: float(v) for k, v in run.items()
            if k.startswith(head) and k.endswith(tail) and v == v}  # NaN: not logged by this run


def main(workdir: str = ".") -> None:
    config = load_config(Path(workdir) / "configs" / "pipeline.yaml")
    mlflow.set_tracking_uri(tracking_uri(config, workdir))
    runs = mlflow.search_runs(experiment_names=[config.tracking.experiment], order_by=["start_time DESC"],
                              filter_string="tags.`posttrain.flow` = 'retrain' and attributes.status = 'FINISHED'")
    if runs.empty:
        sys.exit("no finished retrain run in this workspace: run `make run` first")
    parent = runs.iloc[0]
    children = mlflow.search_runs(experiment_names=[config.tracking.experiment], order_by=["start_time ASC"],
                                  filter_string=f"tags.`mlflow.parentRunId` = '{parent.run_id}'")
    end = parent.end_time.timestamp()
    started = parent.get(f"tags.{STARTED_TAG}")
    start = float(started) if isinstance(started, str) and started else parent.start_time.timestamp()
    wall = end - start
    before = parent.start_time.timestamp() - start
    print(f"retrain run {parent.run_id}: {wall:.1f} s from its process's start to the end of its parent run")
    print(f"  {'before the parent run':<28}{before:8.1f} s   (process start, imports, Prefect, lock, data versioning)")
    compute = staged = 0.0
    for _, child in children.iterrows():
        seconds = (child.end_time - child.start_time).total_seconds()
        parts = compute_parts(child)
        staged += seconds
        compute += sum(parts.values())
        cached = " (cached by DVC)" if child.get("tags.posttrain.cached") == "true" else ""
        shown = ", ".join(f"{part} {s:.1f}" for part, s in parts.items()) or "none"
        print(f"  {child['tags.mlflow.runName']:<28}{seconds:8.1f} s   compute {sum(parts.values()):7.1f} s ({shown}), "
              f"rest {seconds - sum(parts.values()):5.1f} s{cached}")
    between = wall - before - staged
    print(f"  {'between stages':<28}{between:8.1f} s   (Prefect tasks, DVC, MLflow records, memory plan, promotion)")
    rest = wall - compute
    print(f"stage compute     {compute:8.1f} s ({compute / wall:.1%} of wall)")
    print(f"everything else   {rest:8.1f} s ({rest / wall:.1%} of wall; goal <= {GOAL:.0%}: "
          f"{'met' if rest / wall <= GOAL else 'not met'})")


if __name__ == "__main__":
    main(*sys.argv[1:])
