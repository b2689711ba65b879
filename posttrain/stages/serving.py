"""Stage `serving`: how many concurrent sessions the trained model fits on a GPU profile.

First version: predicted from the model's config and weights' size with vLLM's
arithmetic (`posttrain.kv`), on the GPU profile and context length of the config.
"""

from __future__ import annotations

import mlflow
import yaml

from posttrain.errors import UserError
from posttrain.io import resolve_model_dir, write_json
from posttrain.kv import capacity, kv_memory_on_gpu, kv_spec, load_config_json, weight_bytes
from posttrain.tracking import log_json_artifact, stage_run

GIB = 2**30


def load_gpu_profile(gpus_path: str, name: str) -> dict:
    profiles = yaml.safe_load(open(gpus_path))
    if name not in profiles:
        raise UserError(f"{gpus_path}", f"unknown GPU profile {name!r}", f"use one of {sorted(profiles)}")
    return profiles[name]


def predict(model_dir: str, serving, profile: dict) -> dict:
    """The serving report of one model on one GPU profile, as a flat dict."""
    config = load_config_json(model_dir)
    spec = kv_spec(config, tp=serving.tensor_parallel_size, kv_dtype=serving.kv_dtype)
    weights = weight_bytes(model_dir, config) // serving.tensor_parallel_size
    kv_memory = kv_memory_on_gpu(int(profile["memory_gib"] * GIB), serving.gpu_memory_utilization,
                                 weights, int(profile["reserve_gib"] * GIB))
    cap = capacity(spec, kv_memory_bytes=kv_memory, block_size=serving.block_size,
                   context_length=serving.context_length)
    return {"gpu": serving.gpu, "weights_bytes": weights, "session_kv_bytes": spec.session_bytes(serving.context_length),
            **cap.__dict__}


def main(config, *, models_dir: str, gpus_path: str, report_path: str, metrics_path: str) -> dict[str, float]:
    from posttrain.stages.evaluate import final_model_dir

    profile = load_gpu_profile(gpus_path, config.serving.gpu)
    with stage_run(config, "serving"):
        report = predict(resolve_model_dir(final_model_dir(config, models_dir)), config.serving, profile)
        metrics = {k: float(v) for k, v in report.items() if isinstance(v, (int, float))}
        mlflow.log_params({"gpu": config.serving.gpu, "context_length": config.serving.context_length,
                           "tensor_parallel_size": config.serving.tensor_parallel_size,
                           "kv_dtype": config.serving.kv_dtype})
        mlflow.log_metrics(metrics)
        log_json_artifact(report, "serving_report.json")
        write_json(report_path, report)
        write_json(metrics_path, metrics)
    return metrics
