"""Where things are in a workspace: its config file and its model folders."""

from __future__ import annotations

from pathlib import Path

from posttrain.files import read_json, write_json
from posttrain.stageid import final, training_stages

BASE_POINTER = "posttrain_base.json"
CARD = "posttrain_card.json"  # beside a trained model's weights: its held-out evaluation, the gate's verdict
# A workspace's config: dvc.yaml reads its params from this file.
PARAMS_FILE = "configs/pipeline.yaml"


def resolve_model_dir(model_dir: str | Path) -> str:
    """The folder holding weights: `model_dir` itself, or where its base pointer leads.

    A real model named by `model.path` is not copied into the workspace; the prepare
    stage writes a pointer file instead.
    """
    pointer = Path(model_dir) / BASE_POINTER
    return read_json(pointer)["path"] if pointer.is_file() else str(model_dir)


def model_dirs(config, models_dir: str) -> dict[str, str]:
    """Report name (a training stage's config field) -> model folder: base, sft, then each
    GRPO stage in order."""
    dirs = {"base": resolve_model_dir(Path(models_dir) / "base")}
    return dirs | {stage.field: str(Path(models_dir) / stage.model) for stage in training_stages(config)}


def final_model_dir(config, models_dir: str) -> str:
    """The pipeline's result: what the last GRPO stage output (trained, or carried through)."""
    return str(Path(models_dir) / final(config).model)


def read_card(model_dir: str | Path) -> dict:
    """The model card a training stage left next to its weights ({} when there is none)."""
    path = Path(model_dir) / CARD
    return read_json(path) if path.is_file() else {}


def write_card(model_dir: str | Path, card: dict) -> None:
    write_json(Path(model_dir) / CARD, card)
