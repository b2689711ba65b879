"""Small file helpers: JSON lines, metrics files, and the base-model pointer."""

from __future__ import annotations

import json
import os
from pathlib import Path

BASE_POINTER = "posttrain_base.json"
# A workspace's config: dvc.yaml reads its params from this file.
PARAMS_FILE = "configs/pipeline.yaml"


def read_jsonl(path: str | Path) -> list[dict]:
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def write_jsonl(path: str | Path, rows: list[dict]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fh.writelines(json.dumps(row, sort_keys=True) + "\n" for row in rows)


def write_json(path: str | Path, data) -> None:
    """Write atomically, so a crash never leaves a half-written metrics file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def read_json(path: str | Path):
    return json.loads(Path(path).read_text())


def resolve_model_dir(model_dir: str | Path) -> str:
    """The folder holding weights: `model_dir` itself, or where its base pointer leads.

    A real model named by `model.path` is not copied into the workspace; the prepare
    stage writes a pointer file instead.
    """
    pointer = Path(model_dir) / BASE_POINTER
    return read_json(pointer)["path"] if pointer.is_file() else str(model_dir)


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


def run_metrics(results: dict[str, dict]) -> dict[str, float]:
    """Stage name -> its metrics files' content, as the parent run's metric names
    (`grpo@dense` -> `grpo.dense.*`: MLflow names allow no '@')."""
    return flatten({name.replace("@", "."): metrics for name, metrics in results.items()})


def flatten_params(config: dict, prefix: str = "") -> dict[str, str]:
    """`{"grpo": {"dense": {"trl": {"learning_rate": 1e-4}}}}` -> `{"grpo.dense.trl.learning_rate": "0.0001"}`:
    every leaf of a config as an MLflow param (what `posttrain compare` diffs)."""
    flat = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten_params(value, f"{name}."))
        else:
            flat[name] = str(value)
    return flat


def model_dirs(config, models_dir: str) -> dict[str, str]:
    """Report name -> model folder: base, sft, then each GRPO stage in order."""
    dirs = {"base": resolve_model_dir(Path(models_dir) / "base"), "sft": str(Path(models_dir) / "sft")}
    return dirs | {f"grpo.{name}": str(Path(models_dir) / name) for name in config.grpo}


def final_model_dir(config, models_dir: str) -> str:
    """The pipeline's result: what the last GRPO stage output (trained, or carried through)."""
    return str(Path(models_dir) / list(config.grpo)[-1])
