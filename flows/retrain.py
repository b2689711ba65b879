"""The `retrain` flow: one MLflow parent run, the DVC stages in DVC's order, a summary.

Runs on Prefect's ephemeral local API by default, on a Prefect server when
`PREFECT_API_URL` is set. Each stage is a `run_stage` task (retried on failure) that
runs `dvc repro --single-item` under an MLflow child run.
"""

from __future__ import annotations

import time
from pathlib import Path

import mlflow
import yaml
from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from posttrain import registry, summary
from posttrain.cli import PARAMS_FILE
from posttrain.config import load_config
from posttrain.io import final_model_dir, flatten, flatten_params
from posttrain.tracking import dvc_lock_hashes, experiment_id, provenance, tracking_uri
from tasks.dvc_stages import push_data, run_stage, stage_order


MODELS = "artifacts/models"  # dvc.yaml's model folders


def gate_tags(results: dict) -> dict[str, str]:
    """`gate.<stage>`: accepted / rejected / skipped, for every GRPO stage."""
    def verdict(m):
        return "skipped" if m.get("skipped") else "accepted" if m.get("accepted") else "rejected"
    return {f"gate.{name.split('@', 1)[1]}": verdict(m) for name, m in results.items() if name.startswith("grpo@")}


@flow(name="retrain")
def retrain(workdir: str = ".") -> dict:
    """Run the pipeline of `workdir`: a git + DVC repo with dvc.yaml and its params file."""
    logger = get_run_logger()
    workdir = str(Path(workdir).resolve())
    config = load_config(Path(workdir) / PARAMS_FILE)
    uri = tracking_uri(config, workdir)
    exp = experiment_id(config, workdir)
    stage_task = run_stage.with_options(retries=config.orchestration.retries,
                                        retry_delay_seconds=config.orchestration.retry_delay_seconds)
    with mlflow.start_run(experiment_id=exp, run_name=f"retrain-{time.strftime('%Y%m%d-%H%M%S')}") as parent:
        mlflow.set_tags({**provenance(config, workdir), "posttrain.flow": "retrain"})
        mlflow.log_text(yaml.safe_dump(config.model_dump(), sort_keys=False), "config.resolved.yaml")
        mlflow.log_params(flatten_params(config.model_dump(by_alias=True)))  # what `posttrain compare` diffs
        results = {}
        for stage in stage_order(workdir):
            results[stage["name"]] = stage_task(stage, workdir, parent.info.run_id, uri)
        mlflow.set_tags({**dvc_lock_hashes(workdir), **gate_tags(results)})
        # MLflow names allow no '@': grpo@dense -> grpo.dense
        metrics = flatten({name.replace("@", "."): m for name, m in results.items()})
        mlflow.log_metrics(metrics)
        mlflow.log_artifact(str(Path(workdir) / "dvc.lock"))
        logger.info(push_data(workdir))
        text = summary.render(results.get("evaluate", {}), results.get("serving", {}),
                              config.serving.gpu, parent.info.run_id, uri)
        if config.promotion.enabled:
            promotion = registry.promote(config, parent.info.run_id, final_model_dir(config, Path(workdir) / MODELS),
                                         metrics, results.get("serving", {}))
            text += (f"\nModel registry: {config.promotion.model_name} version {promotion.version} "
                     f"is the {promotion.reason}")
    create_markdown_artifact(text, key="retrain-summary", description="posttrain retrain summary")
    print(text)
    return results
