"""The end-of-run summary: models' accuracy and pass@k, serving figures, MLflow link."""

from __future__ import annotations


def run_link(tracking_uri: str, experiment_id: str, run_id: str) -> str:
    """Where the run opens in the MLflow UI (credentials in the URI are left out)."""
    from urllib.parse import urlsplit

    path = f"#/experiments/{experiment_id}/runs/{run_id}"
    parts = urlsplit(tracking_uri)
    if parts.scheme in ("http", "https"):
        return f"{parts.scheme}://{parts.hostname}{f':{parts.port}' if parts.port else ''}{parts.path.rstrip('/')}/{path}"
    return f"http://127.0.0.1:5000/{path} (after `mlflow ui --backend-store-uri {redact(tracking_uri)}`)"


def redact(uri: str) -> str:
    """`uri` without a password (`postgresql://user:secret@host/db` -> `postgresql://user:***@host/db`)."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(uri)
    if not parts.password:
        return uri
    return urlunsplit(parts._replace(netloc=parts.netloc.replace(f":{parts.password}@", ":***@", 1)))


def render(evaluate: dict, serving: dict, gpu: str, run_id: str, tracking_uri: str, experiment_id: str) -> str:
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
    lines += ["", f"MLflow run: {run_id}", f"Open it: {run_link(tracking_uri, experiment_id, run_id)}"]
    return "\n".join(lines)
