"""Stage `serving`: how many concurrent sessions the trained model fits on a GPU profile.

Predicted from the model's config and weights' size with vLLM's arithmetic
(`posttrain.kv`) on the configured GPU profile and context length, and checked against
real vLLM on this machine: the model is loaded with a fixed KV memory, and vLLM's own
block count, KV cache tokens and maximum concurrency must equal the prediction.
"""

from __future__ import annotations

import mlflow
import yaml

from posttrain.errors import UserError
from posttrain.io import resolve_model_dir, write_json
import importlib.util
import json

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


class PredictionMismatch(RuntimeError):
    """vLLM disagrees with the estimator: the arithmetic no longer describes the engine."""


def check_with_vllm(model_dir: str, check, context_length: int) -> dict:
    """Run `posttrain.vllm_check` in its own process and compare with the prediction.

    The context is capped at the model's `max_position_embeddings` (vLLM refuses more);
    the block size is whatever the engine chose (128 on CPU, 16 on most GPUs).
    """
    import subprocess
    import sys
    import tempfile

    model_config = load_config_json(model_dir)
    context = min(context_length, int(model_config.get("max_position_embeddings", context_length)))
    kv_memory = check.kv_memory_mib * 2**20
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/vllm.json"
        done = subprocess.run([sys.executable, "-m", "posttrain.vllm_check", model_dir, "--kv-memory-bytes",
                               str(kv_memory), "--context", str(context), "--dtype", check.dtype, "--out", out],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"vLLM could not load {model_dir}: {done.stderr.strip()[-800:]}")
        reported = json.loads(open(out).read())
    predicted = capacity(kv_spec(model_config), kv_memory_bytes=kv_memory, block_size=reported["block_size"],
                         context_length=context)
    fields = ("num_blocks", "kv_cache_tokens", "max_concurrency")
    wrong = [f"{f}: predicted {getattr(predicted, f)}, vLLM {reported[f]}" for f in fields
             if abs(getattr(predicted, f) - reported[f]) > 1e-6]
    if wrong:
        raise PredictionMismatch(f"KV prediction differs from vLLM for {model_dir}: " + "; ".join(wrong))
    return {f"vllm_{f}": reported[f] for f in ("block_size", *fields)} | {
        f"predicted_{f}": getattr(predicted, f) for f in fields} | {"vllm_context_length": context,
                                                                    "vllm_kv_memory_bytes": kv_memory}


def vllm_check_or_warn(model_dir: str, serving) -> dict:
    """The vLLM cross-check's figures; a loud tag instead when it is off or vLLM is absent."""
    if not serving.vllm_check.enabled:
        mlflow.set_tag("posttrain.vllm_check", "disabled in config (serving.vllm_check.enabled)")
        return {}
    if importlib.util.find_spec("vllm") is None:
        print("posttrain: WARNING: vLLM is not installed: the KV prediction is not checked", flush=True)
        mlflow.set_tag("posttrain.vllm_check", "vllm not installed")
        return {}
    result = check_with_vllm(model_dir, serving.vllm_check, serving.context_length)
    mlflow.set_tag("posttrain.vllm_check", "matched")
    return result


def main(config, *, models_dir: str, gpus_path: str, report_path: str, metrics_path: str) -> dict[str, float]:
    from posttrain.stages.evaluate import final_model_dir

    profile = load_gpu_profile(gpus_path, config.serving.gpu)
    with stage_run(config, "serving"):
        model_dir = resolve_model_dir(final_model_dir(config, models_dir))
        report = predict(model_dir, config.serving, profile)
        report.update(vllm_check_or_warn(model_dir, config.serving))
        metrics = {k: float(v) for k, v in report.items() if isinstance(v, (int, float))}
        mlflow.log_params({"gpu": config.serving.gpu, "context_length": config.serving.context_length,
                           "tensor_parallel_size": config.serving.tensor_parallel_size,
                           "kv_dtype": config.serving.kv_dtype})
        mlflow.log_metrics(metrics)
        log_json_artifact(report, "serving_report.json")
        write_json(report_path, report)
        write_json(metrics_path, metrics)
    return metrics
