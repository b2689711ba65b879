"""What each run read and made, as MLflow sees it: dataset inputs (the UI's Datasets
panel) and logged models (its Logged models panel).

Every dataset file a run reads (the train and held-out splits, each versioned batch in
`datasets/`) is logged with `mlflow.log_input` as a `MetaDataset` whose digest is the
file's DVC md5 (DVC 3 hashes a file's bytes with md5: what its directory manifest and
`.dvc` files record) and whose source names the DVC path and the git commit of the
workspace (a `dvc` source: `git checkout <commit> && dvc pull <path>` brings it back).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from dvc_data.hashfile.hash import file_md5  # DVC's own file hash: what dvc.lock and .dvc files record
from mlflow.data.dataset_source import DatasetSource
from mlflow.data.meta_dataset import MetaDataset

CONTEXT_TAG = "mlflow.data.context"  # MLflow's own tag: what the run used the dataset for


class DVCDatasetSource(DatasetSource):
    """A file of a DVC-versioned workspace: its path there and the git commit."""

    def __init__(self, path: str, git_commit: str):
        self.path, self.git_commit = path, git_commit

    @staticmethod
    def _get_source_type() -> str:
        return "dvc"

    def load(self, **kwargs) -> Any:  # `dvc pull` restores the bytes; MLflow needs no loader
        raise NotImplementedError("restore it with `git checkout <git_commit> && dvc pull <path>`")

    @staticmethod
    def _can_resolve(raw_source: Any) -> bool:
        return False

    @classmethod
    def _resolve(cls, raw_source: Any) -> DVCDatasetSource:
        raise NotImplementedError

    def to_dict(self) -> dict[str, str]:
        return {"path": self.path, "git_commit": self.git_commit}

    @classmethod
    def from_dict(cls, source_dict: dict) -> DVCDatasetSource:
        return cls(source_dict["path"], source_dict.get("git_commit", ""))


def dataset(path: str | Path, workspace: str | Path, git_commit: str) -> MetaDataset:
    """The MLflow dataset of one workspace file (named by its path in the workspace)."""
    workspace = Path(workspace).resolve()
    full = Path(workspace, path).resolve()
    rel = str(full.relative_to(workspace)) if full.is_relative_to(workspace) else str(full)
    return MetaDataset(DVCDatasetSource(rel, git_commit), name=rel, digest=file_md5(str(full)))


def workspace_datasets(workspace: str | Path, data_dir: str = "data", datasets_dir: str = "datasets") -> dict[str, str]:
    """path -> context of every dataset file a whole pipeline run reads: the splits and
    each versioned incoming batch."""
    root = Path(workspace)
    found = {f"{data_dir}/train.jsonl": "training", f"{data_dir}/heldout.jsonl": "evaluation"} if data_dir else {}
    found |= {str(p.relative_to(root)): "incoming" for p in sorted((root / datasets_dir).glob("*.jsonl"))}
    return {path: context for path, context in found.items() if (root / path).is_file()}


def log_datasets(paths: dict[str, str], workspace: str | Path = ".", run_id: str | None = None,
                 client=None) -> None:
    """Log each `path -> context` as a dataset input of the active run, or of `run_id`
    through `client` (an MlflowClient)."""
    from mlflow.entities import DatasetInput, InputTag

    from posttrain.tracking.mlflow_runs import git_state

    commit = git_state(workspace)["git.commit"]
    inputs = [DatasetInput(dataset(path, workspace, commit)._to_mlflow_entity(), [InputTag(CONTEXT_TAG, context)])
              for path, context in paths.items()]
    if not inputs:
        return
    if client is None:
        import mlflow

        client, run_id = mlflow.MlflowClient(), mlflow.active_run().info.run_id
    client.log_inputs(run_id, datasets=inputs)


def log_model(client, run_id: str, name: str, *, tags: dict[str, str], metrics: dict[str, float],
              files: str | None = None):
    """An MLflow logged model (MLflow 3) of run `run_id`: `files` (a Hugging Face folder) as
    its artifacts, or none where DVC holds the bytes; `metrics`, the run's figures of that
    model, logged to the run linked to it. Returns the LoggedModel."""
    from mlflow.entities import LoggedModelOutput, Metric

    model = client.create_logged_model(client.get_run(run_id).info.experiment_id, name=name, source_run_id=run_id,
                                       model_type="transformers", tags=tags)
    if files:
        client.log_model_artifacts(model.model_id, files)
    client.finalize_logged_model(model.model_id, "READY")
    client.log_outputs(run_id, [LoggedModelOutput(model.model_id, 0)])  # the run page's "Logged models"
    now = int(time.time() * 1000)
    if metrics:
        client.log_batch(run_id, metrics=[Metric(k, v, now, 0, model_id=model.model_id) for k, v in metrics.items()])
    return model

