"""The end-of-run summary: models' accuracy and pass@k with intervals, serving figures, the gates."""

from __future__ import annotations

from posttrain.stats import format_p
from posttrain.tracking import run_link


def figure(value: float, ci: list[float] | None) -> str:
    """`0.418 [0.375, 0.462]`: a figure with its 95% interval (when it has one)."""
    return f"{value:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else f"{value:.3f}"


def render(evaluate: dict, serving: dict, gpu: str, run_id: str, tracking_uri: str, experiment_id: str) -> str:
    """A markdown table a terminal reads as well as Prefect's artifact page does; every
    figure with its 95% interval."""
    ks = sorted({int(k) for r in evaluate.values() for k in r["pass_at_k"]})
    prompts = {r.get("n_prompts") for r in evaluate.values()} - {None}
    lines = [f"Held-out evaluation{f' on {min(prompts):,} prompts' if len(prompts) == 1 else ''}, "
             "each figure with its 95% interval (Wilson for greedy accuracy, bootstrap over prompts for pass@k):", "",
             "| model | greedy accuracy | " + " | ".join(f"pass@{k}" for k in ks) + " |",
             "|---|---|" + "---|" * len(ks)]
    for model, result in evaluate.items():
        intervals = result.get("pass_at_k_ci95", {})
        cells = [figure(result["pass_at_k"][str(k)], intervals.get(str(k))) for k in ks]
        lines.append(f"| {model} | {figure(result['greedy_accuracy'], result.get('greedy_accuracy_ci95'))} | "
                     + " | ".join(cells) + " |")
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
        p_values = {k.removeprefix("gate_p_"): v for k, v in results.get(f"grpo@{stage}", {}).items()
                    if k.startswith("gate_p_")}
        shown = ", ".join(f"{k} {format_p(v)}" for k, v in p_values.items())
        parts.append(f"{stage} {verdict}" + (f" (paired tests vs the previous model: {shown})" if shown else ""))
    return "Gates: " + (", ".join(parts) or "none")
