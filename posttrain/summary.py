"""The end-of-run summary: models' accuracy and pass@k, serving figures, MLflow link."""

from __future__ import annotations


def render(evaluate: dict, serving: dict, gpu: str, run_id: str, tracking_uri: str) -> str:
    """A markdown table a terminal reads as well as Prefect's artifact page does."""
    ks = sorted({int(k) for r in evaluate.values() for k in r["pass_at_k"]})
    lines = ["| model | greedy accuracy | " + " | ".join(f"pass@{k}" for k in ks) + " |",
             "|---|---|" + "---|" * len(ks)]
    for model, result in evaluate.items():
        cells = [f"{result['pass_at_k'][str(k)]:.3f}" for k in ks]
        lines.append(f"| {model} | {result['greedy_accuracy']:.3f} | " + " | ".join(cells) + " |")
    if serving:
        lines += ["", f"Serving on {gpu}: {serving['kv_bytes_per_token']:,.0f} KV bytes/token, "
                      f"{serving['kv_cache_tokens']:,.0f} cache tokens, {serving['max_concurrency']:,.1f} concurrent "
                      f"sessions of {serving['context_length']:,.0f} tokens."]
    lines += ["", f"MLflow run: {run_id}", f"Open it: mlflow ui --backend-store-uri {tracking_uri}"]
    return "\n".join(lines)
