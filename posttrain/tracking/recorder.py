"""What a stage records, and the one way the library below flows/ and tasks/ reaches MLflow.

A stage gets a `Recorder` from `stage_run` (posttrain.tracking.mlflow_runs) and hands it to
whatever records for it: the memory plan, the gate's time-limit warning, the weight-change
plot. Code that runs where no recorder can be handed, a launched rank's training job, asks
for `Recorder.active()`: the run its process was attached to (`attached`), or one that
records nothing. A check or a test with no run gets `Recorder(on=False)` and logs nothing.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path


class Recorder:
    """Tags, params, metrics and artifacts of the active MLflow run (MLflow's fluent API);
    with `on=False` every call records nothing."""

    def __init__(self, on: bool = True):
        self.on = on

    @classmethod
    def active(cls) -> Recorder:
        """The run this process logs into, if any (a launched rank's is its stage's)."""
        import mlflow

        return cls(mlflow.active_run() is not None)

    def _mlflow(self):
        """MLflow's module when this recorder records, else None."""
        if not self.on:
            return None
        import mlflow

        return mlflow

    def tag(self, key: str, value: str) -> None:
        self.tags({key: value})

    def tags(self, tags: dict[str, str]) -> None:
        if mlflow := self._mlflow():
            mlflow.set_tags(tags)

    def params(self, params: dict) -> None:
        if mlflow := self._mlflow():
            mlflow.log_params(params)

    def metrics(self, metrics: dict, prefix: str = "") -> None:
        """Nested metrics flattened to MLflow names (`flatten`),
        each under `prefix`."""
        if mlflow := self._mlflow():
            mlflow.log_metrics({f"{prefix}{k}": v for k, v in flatten(metrics).items()})

    def dict(self, data: dict, path: str) -> None:
        if mlflow := self._mlflow():
            mlflow.log_dict(data, path)

    def json(self, data, path: str) -> None:
        """`data` as indented, key-sorted JSON (values it cannot encode as their text)."""
        self.text(json.dumps(data, indent=2, sort_keys=True, default=str), path)

    def text(self, text: str, path: str) -> None:
        if mlflow := self._mlflow():
            mlflow.log_text(text, path)

    def figure(self, figure, path: str) -> None:
        if mlflow := self._mlflow():
            mlflow.log_figure(figure, path)

    def table(self, data: dict[str, list], path: str) -> None:
        if mlflow := self._mlflow():
            mlflow.log_table(data, path)

    def artifacts(self, folder: str | Path, path: str) -> None:
        if mlflow := self._mlflow():
            mlflow.log_artifacts(str(folder), path)

    def follow(self, trainer) -> None:
        """The trainer's logs (loss, rewards, KL, TRL's `step_time`) into the run, by
        transformers' MLflow callback added as a callback: the stages build their TRL config
        with `report_to=[]`. With "mlflow" in `report_to`, TRL also logs a timing to MLflow
        for every profiled call (generation, each reward function, the loss: several a
        step), each a round trip to the tracking store: 6% of a default GRPO step on SQLite,
        and more with MLflow's asynchronous logging (bench/grpo_throughput.py)."""
        from transformers.integrations import MLflowCallback

        trainer.add_callback(MLflowCallback)

    def handle(self) -> dict:
        """What a launched rank needs to log into this run (`attached`): its store and id."""
        import mlflow

        run = mlflow.active_run() if self.on else None
        return {"tracking_uri": mlflow.get_tracking_uri(), "run_id": run.info.run_id if run else None}


@contextlib.contextmanager
def attached(handle: dict):
    """The run `handle` names (`Recorder.handle`) active in this process for the block, left
    RUNNING after it: the stage's own process ends it, with the stage's outcome."""
    import mlflow

    mlflow.set_tracking_uri(handle["tracking_uri"])
    mlflow.start_run(run_id=handle["run_id"])
    try:
        yield Recorder()
    finally:
        mlflow.end_run("RUNNING")


def flatten(metrics: dict, prefix: str = "") -> dict[str, float]:
    """`{"a": {"b": 1}}` -> `{"a.b": 1.0}`: nested metrics as MLflow metric names. An
    interval `[low, high]` becomes `name.low` and `name.high`; other lists are left out."""
    flat = {}
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, f"{name}."))
        elif isinstance(value, list) and len(value) == 2 and all(_is_number(v) for v in value):
            flat[f"{name}.low"], flat[f"{name}.high"] = float(value[0]), float(value[1])
        elif _is_number(value):
            flat[name] = float(value)
    return flat


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
