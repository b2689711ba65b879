"""Promotion: the run's final model into the MLflow Model Registry, as champion or challenger.

The final model is logged as an MLflow logged model of the parent run (its files, and the
run's figures of it linked to it) and registered as a new version of
`promotion.model_name` from it. It takes the alias `champion` only if it meets the
serving target and beats the current champion on `promotion.metric` (a metric of the
parent run, e.g. `evaluate.grpo.greedy_accuracy`); otherwise `challenger`. With
`require_significance`, beating means beyond noise: a paired test of the two runs'
per-prompt held-out outcomes (artifact `reports/heldout_outcomes.json` of each parent
run) gives p < `stats.alpha`. The decision and its reason, naming the test and its
p-value, go to the version's and the run's tags.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

from mlflow.utils.mlflow_tags import MLFLOW_MODEL_VERSIONS

from posttrain.scoring import stats
from posttrain.tracking.lineage import log_model
from posttrain.tracking.mlflow_runs import OUTCOMES_ARTIFACT, global_tracking_uri, run_outcomes


class Promotion(NamedTuple):
    alias: str
    version: str
    reason: str


def decide(metric: str, value: float, champion: tuple[str, float] | None, *, higher_is_better: bool,
           serving_ok: bool, test: stats.Test | None = None, alpha: float = 0.05,
           untested: str | None = None) -> tuple[str, str]:
    """(alias, reason) for a new version scoring `value`; champion: (version, its value) or None.

    test: the paired test of this version against the champion (None: decide on the
    values alone; `untested` then says why, when significance was asked for).
    """
    if not serving_ok:
        return "challenger", "challenger: the serving target is not met"
    if champion is None:
        return "champion", f"champion: first version with {metric} = {value:.4f} (no champion yet)"
    version, best = champion
    better = value > best if higher_is_better else value < best
    against = f"{metric} {value:.4f} {{}} the champion's {best:.4f} (version {version})"
    if test is not None:
        real = better and test.p_value < alpha
        verb = "beats" if real else "does not beat" if not better else "is not beyond noise of"
        noise = f"{'beyond' if real else 'within'} noise" if better else "not better"
        return ("champion" if real else "challenger"), \
            f"{'champion' if real else 'challenger'}: {against.format(verb)}; {noise}: {test.describe()}, alpha {alpha}"
    note = f" (no significance test: {untested})" if untested else ""
    verb = "beats" if better else "does not beat"
    return ("champion" if better else "challenger"), \
        f"{'champion' if better else 'challenger'}: {against.format(verb)}{note}"


def significance(config, outcomes: dict | None, champion_run_id: str) -> tuple[stats.Test | None, str | None]:
    """(the test of this run against the champion on `promotion.metric`, or None and why
    not). Only evaluate accuracies and pass@k have per-prompt outcomes."""
    settings = config.promotion
    if not settings.require_significance:
        return None, None
    if stats.split_metric(settings.metric) is None:
        return None, f"{settings.metric} has no per-prompt outcomes"
    test = stats.compare_runs(run_outcomes(champion_run_id), outcomes, settings.metric,
                              resamples=config.stats.bootstrap_resamples, seed=config.seed)
    return (test, None) if test else (None, f"a run lacks the per-prompt outcomes {OUTCOMES_ARTIFACT}")


FINAL_METRICS = "evaluate.grpo."  # the parent run's figures of the final model


def log_final_model(client, run_id: str, model_dir: str, metrics: dict[str, float]):
    """The final model as an MLflow logged model of the parent run (MLflow 3): its files
    (a Hugging Face folder), and the run's figures of it (`evaluate.grpo.*`) linked to it,
    so the UI's Logged models panel shows what it scored."""
    return log_model(client, run_id, "final", tags={"posttrain.stage": "final"}, files=model_dir,
                     metrics={k: v for k, v in metrics.items() if k.startswith(FINAL_METRICS)})


def export_champion(client, model_id: str, model_dir: str, name: str, *, kind: str, system: str | None) -> str:
    """The champion as a GGUF file and its Ollama Modelfile (posttrain.models.gguf_export),
    logged with the registered version's model files under gguf/; returns the file's path there."""
    import tempfile

    from posttrain.models.gguf_export import export_gguf

    with tempfile.TemporaryDirectory(prefix="posttrain-gguf-") as folder:
        export_gguf(model_dir, Path(folder) / name, kind=kind, system=system)
        client.log_model_artifacts(model_id, folder, artifact_path="gguf")
    return f"gguf/{name}"


def promote(config, run_id: str, model_dir: str, metrics: dict[str, float], serving: dict,
            outcomes: dict | None = None, *, tracking_uri: str) -> Promotion:
    """Log the final model to the parent run `run_id`, register it and alias it.
    outcomes: this run's per-prompt held-out outcomes (model -> outcomes)."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    settings = config.promotion
    client = MlflowClient(tracking_uri)
    if settings.metric not in metrics:
        raise KeyError(f"promotion.metric {settings.metric!r} is not a metric of this run")
    champion, test, untested = None, None, None
    try:
        current = client.get_model_version_by_alias(settings.model_name, "champion")
        best = client.get_run(current.run_id).data.metrics.get(settings.metric)
        champion = (current.version, best) if best is not None else None
    except MlflowException:
        pass  # no registered model or no champion yet
    if champion is not None:
        test, untested = significance(config, outcomes, current.run_id)
    serving_ok = serving.get("slo_sessions", 1.0) >= serving.get("slo_min_sessions", 0.0)
    alias, reason = decide(settings.metric, metrics[settings.metric], champion,
                           higher_is_better=settings.higher_is_better, serving_ok=serving_ok, test=test,
                           alpha=config.stats.alpha, untested=untested)
    model = log_final_model(client, run_id, model_dir, metrics)
    try:
        client.create_registered_model(settings.model_name)
    except MlflowException:
        pass  # it exists
    with global_tracking_uri(tracking_uri):  # where the registry looks the logged model up
        version = client.create_model_version(settings.model_name, f"models:/{model.model_id}", run_id=run_id,
                                              model_id=model.model_id).version
    # the link from the logged model to its registry versions, as mlflow.register_model records it
    client.set_logged_model_tags(model.model_id, {MLFLOW_MODEL_VERSIONS: json.dumps(
        [{"name": settings.model_name, "version": str(version)}])})
    client.set_registered_model_alias(settings.model_name, alias, version)
    client.set_model_version_tag(settings.model_name, version, "posttrain.tracking.promotion", reason)
    for key, value in {"posttrain.tracking.promotion": alias, "posttrain.promotion_reason": reason,
                       "posttrain.model_version": str(version)}.items():
        client.set_tag(run_id, key, value)
    if settings.export == "gguf" and alias == "champion":
        path = export_champion(client, model.model_id, model_dir, f"{settings.model_name}-v{version}.gguf",
                               kind=settings.export_type, system=config.data.options.get("system"))
        client.set_model_version_tag(settings.model_name, version, "posttrain.gguf", path)
    return Promotion(alias, str(version), reason)
