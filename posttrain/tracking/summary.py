"""The end-of-run summary: models' accuracy and pass@k with intervals, serving figures, the gates."""

from __future__ import annotations

from posttrain.stageid import StageId, kind_of
from posttrain.scoring.harness import TASK as HARNESS_TASK
from posttrain.scoring.stats import format_p
from posttrain.tracking.mlflow_runs import run_link


def figure(value: float, ci: list[float] | None) -> str:
    """`0.418 [0.375, 0.462]`: a figure with its 95% interval (when it has one)."""
    return f"{value:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else f"{value:.3f}"


def render(evaluate: dict, serving: dict, gpu: str, run_id: str, tracking_uri: str, experiment_id: str) -> str:
    """A markdown table a terminal reads as well as Prefect's artifact page does; every
    figure with its 95% interval."""
    ks = sorted({int(k) for r in evaluate.values() for k in r["pass_at_k"]})
    harnessed = any("harness" in r for r in evaluate.values())
    prompts = {r.get("n_prompts") for r in evaluate.values()} - {None}
    lines = [f"Held-out evaluation{f' on {min(prompts):,} prompts' if len(prompts) == 1 else ''}, "
             "each figure with its 95% interval (Wilson for greedy accuracy, bootstrap over prompts for pass@k):", "",
             "| model | greedy accuracy | " + " | ".join(f"pass@{k}" for k in ks) + " |"
             + " lm-eval exact_match |" * harnessed,
             "|---|---|" + "---|" * (len(ks) + harnessed)]
    for model, result in evaluate.items():
        intervals = result.get("pass_at_k_ci95", {})
        cells = [figure(result["pass_at_k"][str(k)], intervals.get(str(k))) for k in ks]
        if harnessed:
            cells.append(f"{result['harness'][HARNESS_TASK]['exact_match']:.3f}" if "harness" in result else "-")
        lines.append(f"| {model} | {figure(result['greedy_accuracy'], result.get('greedy_accuracy_ci95'))} | "
                     + " | ".join(cells) + " |")
    if harnessed:
        seconds = sum(r["harness"]["seconds"] for name, r in evaluate.items() if "harness" in r and name != "grpo")
        lines += ["", f"lm-eval: the held-out split as lm-evaluation-harness task {HARNESS_TASK} (greedy, the "
                      f"environment's verifier as its filter), {duration(seconds)} more than posttrain's own."]
    if serving:
        lines += ["", f"Serving on {gpu}: {serving['kv_bytes_per_token']:,.0f} KV bytes/token, "
                      f"{serving['kv_cache_tokens']:,.0f} cache tokens, {serving['max_concurrency']:,.1f} concurrent "
                      f"sessions of {serving['context_length']:,.0f} tokens."]
    lines += ["", f"MLflow run: {run_id}", f"Open it: {run_link(tracking_uri, experiment_id, run_id)}"]
    return "\n".join(lines)


def gates_line(gates: dict[str, str], results: dict) -> str:
    """`Gates: dense accepted (... greedy_accuracy p<0.001, pass_at_8 p=0.004)`: each GRPO
    stage's verdict with the p-values of its paired tests against the previous model."""
    parts = []
    for tag, verdict in gates.items():
        stage = tag.split(".", 1)[1]
        p_values = {k.removeprefix("gate_p_"): v for k, v in results.get(StageId.grpo(stage).dvc, {}).items()
                    if k.startswith("gate_p_")}
        shown = ", ".join(f"{k} {format_p(v)}" for k, v in p_values.items())
        parts.append(f"{stage} {verdict}" + (f" (paired tests vs the previous model: {shown})" if shown else ""))
    return "Gates: " + (", ".join(parts) or "none")


def duration(seconds: float) -> str:
    """`6 min 19 s`, `16 s`, `0.4 s`, `1 h 2 min`."""
    if seconds < 10:
        return f"{seconds:.1f} s"
    whole = round(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours} h {minutes} min"
    return f"{minutes} min {secs} s" if minutes else f"{secs} s"


def pass_at(metrics: dict, prefix: str = "") -> str:
    """`, pass@8 0.752`: the largest k a stage's metrics hold, or nothing."""
    ks = [int(k[len(prefix) + 8:]) for k in metrics if k.startswith(f"{prefix}pass_at_") and k[len(prefix) + 8:].isdigit()]
    return f", pass@{max(ks)} {metrics[f'{prefix}pass_at_{max(ks)}']:.3f}" if ks else ""


FLAT = 0.02  # a GRPO stage whose greedy accuracy moved less than this (or was rejected) says why


def flat_reason(metrics: dict, before: float | None) -> str:
    """For a GRPO stage that changed little or was rejected: what explains it
    (posttrain.training.diagnostics.explain), else ''."""
    from posttrain.training.diagnostics import explain

    moved = before is not None and abs(metrics["candidate_greedy_accuracy"] - before) >= FLAT
    return "" if moved and metrics.get("accepted") == 1.0 else explain(metrics)


def stage_line(name: str, metrics: dict, *, seconds: float, cached: bool, before: float | None = None) -> str:
    """What a stage did, in numbers, on one line (the flow's end-of-stage line), e.g.
    `grpo@dense: accepted, greedy 0.424 -> 0.712, pass@8 0.752, 600 steps, 2 min 57 s`.
    `before`: the greedy accuracy of the model a GRPO stage started from."""
    took = duration(seconds)
    if cached:
        return f"{name}: up to date (DVC kept its outputs), {took}"
    m = metrics
    if name == "prepare" and "train_rows" in m:
        batches = f" ({m['datasets_rows']:,.0f} from versioned batches)" if m.get("datasets_rows") else ""
        return (f"prepare: {m['train_rows']:,.0f} train / {m['heldout_rows']:,.0f} held-out rows{batches}, "
                f"base model of {m.get('base_params', 0):,.0f} parameters, {took}")
    if name == "sft" and m.get("off"):
        return f"sft: off (the first GRPO stage starts from the base model), {took}"
    if name == "sft" and "greedy_accuracy" in m:
        return f"sft: greedy {m['greedy_accuracy']:.3f} on held-out{pass_at(m)}, {m.get('steps', 0):,.0f} steps, {took}"
    if kind_of(name) == "grpo" and "candidate_greedy_accuracy" in m:
        verdict = "accepted" if m.get("accepted") == 1.0 else "rejected (the previous model carries on)"
        greedy, before = m["candidate_greedy_accuracy"], before if before is not None else m.get("start_greedy_accuracy")
        change = f"{before:.3f} -> {greedy:.3f}" if before is not None else f"{greedy:.3f}"
        why = flat_reason(m, before)
        return (f"{name}: {verdict}, greedy {change}{pass_at(m, 'candidate_')}, {m.get('steps', 0):,.0f} steps, "
                f"{took}{'; ' + why if why else ''}")
    if name == "serving" and "max_concurrency" in m:
        vllm = "; vLLM's own report agreed" if "vllm_num_blocks" in m else ""
        if m.get("load_sessions"):  # a tool environment's replayed multi-turn sessions
            load = (f", load test {m['load_sessions_per_second']:,.1f} sessions/s of {m['load_turns_per_session']:.1f} "
                    f"turns, p95 {m['load_session_latency_p95_ms']:,.0f} ms")
        else:
            load = (f", load test {m['load_requests_per_second']:,.0f} req/s, p95 {m['load_latency_p95_ms']:,.0f} ms"
                    if m.get("load_requests") else "")
        episode = (f"; {m['episode_max_concurrency']:,.0f} of a whole episode ({m['episode_max_tokens']:,.0f} tokens)"
                   if "episode_max_tokens" in m else "")
        return (f"serving: {m['max_concurrency']:,.0f} concurrent sessions of {m['context_length']:,.0f} tokens"
                f"{episode} (KV arithmetic{vllm}){load}, {took}")
    if name == "evaluate" and m and all(isinstance(v, dict) and "greedy_accuracy" in v for v in m.values()):
        greedy = ", ".join(f"{model} {r['greedy_accuracy']:.3f}" for model, r in m.items())
        return f"evaluate: greedy accuracy {greedy}, {took}"
    return f"{name}: done, {took}"
