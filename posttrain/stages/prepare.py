"""Stage `prepare`: the data set's splits and the base model.

Writes `data/{train,heldout}.jsonl` and a manifest, and the base model folder: the
tiny model built locally, or a pointer to the local `model.path`. With `data.chat`, each
row's prompt is rendered with the base model's chat template (posttrain.chat).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from posttrain.chat import load_tokenizer, render, tool_ready
from posttrain.envs import config_env
from posttrain.envs.tools import is_tool_env, tool_schemas
from posttrain.files import write_json, write_jsonl
from posttrain.ingest import extra_rows
from posttrain.layout import BASE_POINTER
from posttrain.tracking.lineage import log_datasets, workspace_datasets
from posttrain.training.tiny_model import save_tiny_model
from posttrain.tracking.mlflow_runs import compute, stage_run


def main(config, *, data_dir: str, datasets_dir: str, model_dir: str, metrics_path: str) -> dict[str, float]:
    with stage_run(config, "prepare") as recorder:
        log_datasets(workspace_datasets(".", data_dir="", datasets_dir=datasets_dir))  # the versioned batches
        with compute("data"):
            env = config_env(config.data)
            splits = env.generate(config.seed)
            added = add_rows(splits, extra_rows(datasets_dir))
        with compute("model"):
            params = prepare_model(config, Path(model_dir))
        with compute("data"):
            if config.data.chat:  # the base model's chat template around every prompt (posttrain.chat)
                splits = chat_splits(config, env, splits)
            manifest = write_splits(splits, Path(data_dir))
            if hasattr(env, "save_index"):  # a search index (retrieval): versioned with the splits
                manifest["index"] = env.save_index(Path(data_dir) / "index")
                write_json(Path(data_dir) / "manifest.json", manifest)
        metrics = {f"{name}_rows": float(len(rows)) for name, rows in splits.items()}
        metrics["datasets_rows"] = float(added)
        metrics["base_params"] = float(params)
        recorder.params({"env": config.data.env, **{f"data.{k}": v for k, v in config.data.options.items()}})
        recorder.metrics(metrics)
        recorder.json(manifest, "data_manifest.json")
        write_json(metrics_path, metrics)
    return metrics


def chat_splits(config, env, splits: dict[str, list[dict]]) -> dict[str, list[dict]]:
    tokenizer = load_tokenizer(str(Path(config.model.path).resolve()))
    tools = None
    if is_tool_env(env):  # the prompt as the episode starts: the tools' signatures in the system turn
        note = tool_ready(tokenizer)
        if note:
            print(note, flush=True)
        tools = tool_schemas(env.episode)
    return {name: render(rows, tokenizer, getattr(env, "system", None), tools) for name, rows in splits.items()}


def add_rows(splits: dict[str, list[dict]], rows: list[dict]) -> int:
    """Append versioned rows (`datasets/`) to train, skipping prompts either split has."""
    seen = {r["prompt"] for split in splits.values() for r in split}
    new = [r for r in rows if r["prompt"] not in seen and not seen.add(r["prompt"])]
    splits["train"] = splits["train"] + new
    return len(new)


def write_splits(splits: dict[str, list[dict]], data_dir: Path) -> dict:
    """Write each split as JSON lines; return a manifest with row counts and sha256."""
    manifest = {}
    for name, rows in splits.items():
        path = data_dir / f"{name}.jsonl"
        write_jsonl(path, rows)
        manifest[name] = {"rows": len(rows), "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    write_json(data_dir / "manifest.json", manifest)
    return manifest


def prepare_model(config, model_dir: Path) -> int:
    """Build the tiny model, or point at the real one; returns the parameter count."""
    model_dir.mkdir(parents=True, exist_ok=True)
    if config.model.path is None:
        return save_tiny_model(model_dir, seed=config.seed, **config.model.tiny.model_dump())
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    source = str(Path(config.model.path).resolve())
    with torch.device("meta"):
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source)).parameters())
    write_json(model_dir / BASE_POINTER, {"path": source})
    return params
