"""Promotion: the run's final model into the MLflow Model Registry, as champion or challenger.

The accepted final model is logged to the parent run (`model/`) and registered as a new
version of `promotion.model_name`. It takes the alias `champion` only if it meets the
serving target and beats the current champion on `promotion.metric` (a metric of the
parent run, e.g. `evaluate.grpo.greedy_accuracy`); otherwise `challenger`. The decision
and its reason go to the version's and the run's tags.
"""

from __future__ import annotations

from typing import NamedTuple


class Promotion(NamedTuple):
    alias: str
    version: str
    reason: str


def decide(metric: str, value: float, champion: tuple[str, float] | None, *, higher_is_better: bool,
           serving_ok: bool) -> tuple[str, str]:
    """(alias, reason) for a new version scoring `value`; champion: (version, its value) or None."""
    if not serving_ok:
        return "challenger", "challenger: the serving target is not met"
    if champion is None:
        return "champion", f"champion: first version with {metric} = {value:.4f} (no champion yet)"
    version, best = champion
    better = value > best if higher_is_better else value < best
    verb = "beats" if better else "does not beat"
    return ("champion" if better else "challenger"), \
        f"{'champion' if better else 'challenger'}: {metric} {value:.4f} {verb} the champion's {best:.4f} (version {version})"


def promote(config, run_id: str, model_dir: str, metrics: dict[str, float], serving: dict) -> Promotion:
    """Log, register and alias the final model; call inside the parent run."""
    import mlflow
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    settings = config.promotion
    client = MlflowClient()
    if settings.metric not in metrics:
        raise KeyError(f"promotion.metric {settings.metric!r} is not a metric of this run")
    champion = None
    try:
        current = client.get_model_version_by_alias(settings.model_name, "champion")
        best = client.get_run(current.run_id).data.metrics.get(settings.metric)
        champion = (current.version, best) if best is not None else None
    except MlflowException:
        pass  # no registered model or no champion yet
    serving_ok = serving.get("slo_sessions", 1.0) >= serving.get("slo_min_sessions", 0.0)
    alias, reason = decide(settings.metric, metrics[settings.metric], champion,
                           higher_is_better=settings.higher_is_better, serving_ok=serving_ok)
    mlflow.log_artifacts(model_dir, "model")
    try:
        client.create_registered_model(settings.model_name)
    except MlflowException:
        pass  # it exists
    # the model folder as logged (MLflow 3's register_model wants a LoggedModel flavour; this is a plain HF folder)
    version = client.create_model_version(settings.model_name, mlflow.get_artifact_uri("model"), run_id=run_id).version
    client.set_registered_model_alias(settings.model_name, alias, version)
    client.set_model_version_tag(settings.model_name, version, "posttrain.promotion", reason)
    mlflow.set_tags({"posttrain.promotion": alias, "posttrain.promotion_reason": reason,
                     "posttrain.model_version": str(version)})
    return Promotion(alias, str(version), reason)
